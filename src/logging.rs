//! The binary's log output: the libraries' `tracing` events on stderr, filtered by level.
//!
//! `CONRUB_LOG` takes `tracing-subscriber`'s filter syntax (`warn`, `debug`,
//! `conrub_grpo=debug,info`); unset, conrub's own crates log at `info` and every other crate
//! (burn, CubeCL, HTTP clients) at `warn`. An `info` event prints as its bare message (the
//! progress lines users read), `warn` and `error` with `warning: ` and `error: ` in front,
//! `debug` and `trace` with their level and target.

use std::fmt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// The environment variable holding the filter.
pub const LOG_ENV: &str = "CONRUB_LOG";

/// The filter when `CONRUB_LOG` is unset.
const DEFAULT_FILTER: &str = "warn,conrub=info,conrub_grpo=info,conrub_trainer=info,\
    conrub_rewards=info,conrub_parallel=info,conrub_judge=info,conrub_kernels=info,conrub_models=info,conrub_rollout=info,\
    conrub_remote=info,conrub_eval=info,conrub_construct=info,conrub_config=info";

/// Lines as described in the module docs.
struct Lines;

impl<S, N> FormatEvent<S, N> for Lines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        match *meta.level() {
            Level::INFO => {}
            Level::WARN => write!(writer, "warning: ")?,
            Level::ERROR => write!(writer, "error: ")?,
            level => write!(writer, "{level} {}: ", meta.target())?,
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// The filter `CONRUB_LOG` asks for (an unreadable one is an error naming the variable).
fn filter() -> anyhow::Result<EnvFilter> {
    match std::env::var(LOG_ENV) {
        Ok(spec) if !spec.trim().is_empty() => EnvFilter::try_new(&spec)
            .map_err(|e| anyhow::anyhow!("{LOG_ENV}={spec}: not a log filter: {e}")),
        _ => Ok(EnvFilter::new(DEFAULT_FILTER)),
    }
}

/// Installs the stderr subscriber for the process (once; `log` records stay with
/// `conrub_kernels::events`, which counts CubeCL's).
pub fn install() -> anyhow::Result<()> {
    let subscriber = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter()?)
        // A closed stderr (`conrub train ... 2>&1 | head -3`, a dead `tee`) drops the line:
        // tracing-subscriber's own report of that failure is an `eprintln!`, which would panic
        // and end the run.
        .log_internal_errors(false)
        .event_format(Lines)
        .finish();
    tracing::subscriber::set_global_default(subscriber)
        .map_err(|e| anyhow::anyhow!("cannot install the log subscriber: {e}"))
}
