//! Progress of the set-up's longer phases (the supervised warm-up, the kernel warm-up).

/// Progress of a phase that takes more than a few seconds: a bar with an ETA on a terminal, else a
/// plain line with the ETA about every 10% (so a log file shows it too).
pub(crate) struct PhaseProgress {
    name: &'static str,
    total: usize,
    bar: Option<indicatif::ProgressBar>,
    started: std::time::Instant,
}

impl PhaseProgress {
    pub(crate) fn new(name: &'static str, total: usize) -> Self {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total as u64);
            let template = format!("{name} {{bar:30}} {{pos}}/{{len}} steps, {{msg}}, ETA {{eta}}");
            bar.set_style(
                indicatif::ProgressStyle::with_template(&template).expect("valid template"),
            );
            bar
        });
        Self {
            name,
            total,
            bar,
            started: std::time::Instant::now(),
        }
    }

    pub(crate) fn update(&mut self, done: usize, message: &str) {
        match &self.bar {
            Some(bar) => {
                bar.set_message(message.to_string());
                bar.set_position(done as u64);
                if done == self.total {
                    bar.finish_and_clear();
                }
            }
            None if done.is_multiple_of(self.total.div_ceil(10).max(1)) && done < self.total => {
                let eta =
                    self.started.elapsed().as_secs_f64() / done as f64 * (self.total - done) as f64;
                tracing::info!(
                    "{}: {done}/{} steps, {message}, ETA {:.0} s",
                    self.name,
                    self.total,
                    eta
                );
            }
            None => {}
        }
    }
}
