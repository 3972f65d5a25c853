//! The workspace's one retry loop with exponential backoff, for every client of a server: the
//! judge client, the SGLang rollout client and the HTTP reward function. What counts as worth
//! another attempt stays with the caller (each protocol has its own answer); how long to wait
//! and when to give up is decided here. It names no runtime: the caller passes its sleep (for
//! tokio, `tokio::time::sleep`).

use std::future::Future;
use std::time::Duration;

/// When to try again: the wait before retry `k` (1-based) is `base_secs · 2^(k-1)`, at most
/// `max_secs`, drawn uniformly below that when `jitter` is set (AWS's "full jitter", which
/// spreads many clients' retries), and never shorter than a server's `Retry-After` (itself
/// capped at `max_secs`). At most `max_retries` retries follow the first attempt.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    /// The first wait, in seconds.
    pub base_secs: f64,
    /// The longest wait, in seconds.
    pub max_secs: f64,
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// A draw from `[0, 1)` that scales each wait (full jitter), or `None` for exact waits.
    pub jitter: Option<fn() -> f64>,
}

impl Backoff {
    /// Exact waits (no jitter).
    pub fn exponential(base_secs: f64, max_secs: f64, max_retries: u32) -> Self {
        Self {
            base_secs,
            max_secs,
            max_retries,
            jitter: None,
        }
    }

    /// The same waits, each scaled by a draw from `[0, 1)` of `draw`.
    pub fn with_jitter(self, draw: fn() -> f64) -> Self {
        Self {
            jitter: Some(draw),
            ..self
        }
    }

    /// The longest wait before retry `k` (1-based): `base_secs · 2^(k-1)`, at most `max_secs`.
    pub fn ceiling(&self, k: u32) -> Duration {
        let factor = 2f64.powi(k.saturating_sub(1).min(60) as i32);
        secs((self.base_secs * factor).min(self.max_secs))
    }

    /// The wait before retry `k` (1-based), at least `floor` (a server's `Retry-After`, capped
    /// at `max_secs`) when there is one.
    pub fn delay(&self, k: u32, floor: Option<Duration>) -> Duration {
        let ceiling = self.ceiling(k);
        let wait = match self.jitter {
            Some(draw) => ceiling.mul_f64(draw().clamp(0.0, 1.0)),
            None => ceiling,
        };
        match floor {
            Some(f) => wait.max(f.min(secs(self.max_secs))),
            None => wait,
        }
    }
}

/// Seconds as a duration; negative and non-finite values (a misconfiguration the callers'
/// checks refuse) as zero and the longest duration.
fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX)
}

/// What one attempt came to.
#[derive(Debug)]
pub enum Attempt<T, E> {
    /// A result: no more attempts.
    Done(T),
    /// A failure worth another attempt, after at least the server's `Retry-After` if it sent one.
    Retry(E, Option<Duration>),
    /// A failure another attempt would repeat: no more attempts.
    Fatal(E),
}

/// Why [`retry`] gave up.
#[derive(Debug, Clone, PartialEq)]
pub struct GaveUp<E> {
    /// The last attempt's error.
    pub error: E,
    /// The attempts made, the first included.
    pub attempts: u32,
    /// Whether the retries were spent (otherwise the last error was fatal).
    pub exhausted: bool,
}

/// Runs `attempt(n)` for `n` = 1, 2, ... until it is done, fails fatally or the retries of
/// `backoff` are spent, waiting `backoff.delay(n, ..)` with `sleep` after failure `n`. Returns
/// the result and the attempts made.
pub async fn retry<T, E, S, SF, A, AF>(
    backoff: &Backoff,
    sleep: S,
    mut attempt: A,
) -> Result<(T, u32), GaveUp<E>>
where
    S: Fn(Duration) -> SF,
    SF: Future<Output = ()>,
    A: FnMut(u32) -> AF,
    AF: Future<Output = Attempt<T, E>>,
{
    let mut n = 0;
    loop {
        n += 1;
        match attempt(n).await {
            Attempt::Done(value) => return Ok((value, n)),
            Attempt::Fatal(error) => {
                return Err(GaveUp {
                    error,
                    attempts: n,
                    exhausted: false,
                })
            }
            Attempt::Retry(error, floor) => {
                if n > backoff.max_retries {
                    return Err(GaveUp {
                        error,
                        attempts: n,
                        exhausted: true,
                    });
                }
                sleep(backoff.delay(n, floor)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// Runs a future that never waits on anything but the recording sleep below.
    fn run<T>(f: impl Future<Output = T>) -> T {
        let mut f = std::pin::pin!(f);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match f.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(v) => v,
            std::task::Poll::Pending => panic!("the test's futures never wait"),
        }
    }

    #[test]
    fn waits_double_up_to_the_cap_and_the_retries_are_counted() {
        let b = Backoff::exponential(0.5, 10.0, 3);
        let waits: Vec<f64> = (1..=7).map(|k| b.ceiling(k).as_secs_f64()).collect();
        assert_eq!(waits, [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]);
        assert_eq!(b.ceiling(40), Duration::from_secs(10));
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(10));
        let slept = RefCell::new(Vec::new());
        let out: Result<((), u32), GaveUp<String>> = run(retry(
            &b,
            |d| {
                slept.borrow_mut().push(d.as_secs_f64());
                async {}
            },
            |n| async move { Attempt::Retry(format!("try {n}"), None) },
        ));
        let gave_up = out.unwrap_err();
        assert_eq!((gave_up.error.as_str(), gave_up.attempts), ("try 4", 4));
        assert!(gave_up.exhausted);
        assert_eq!(*slept.borrow(), [0.5, 1.0, 2.0]);
    }

    #[test]
    fn fatal_errors_stop_at_once_and_success_reports_its_attempt() {
        let b = Backoff::exponential(0.0, 0.0, 5);
        let out: Result<(u32, u32), GaveUp<&str>> = run(retry(
            &b,
            |_| async {},
            |n| async move {
                if n < 3 {
                    Attempt::Retry("busy", None)
                } else {
                    Attempt::Done(n * 10)
                }
            },
        ));
        assert_eq!(out.unwrap(), (30, 3));
        let out: Result<((), u32), GaveUp<&str>> =
            run(retry(&b, |_| async {}, |_| async { Attempt::Fatal("no") }));
        let gave_up = out.unwrap_err();
        assert_eq!((gave_up.attempts, gave_up.exhausted), (1, false));
    }

    #[test]
    fn jitter_scales_below_the_ceiling_and_retry_after_is_a_capped_floor() {
        let b = Backoff::exponential(1.0, 30.0, 8).with_jitter(|| 0.25);
        assert_eq!(b.delay(3, None), Duration::from_secs(1));
        assert_eq!(
            b.delay(3, Some(Duration::from_secs(7))),
            Duration::from_secs(7)
        );
        assert_eq!(
            b.delay(1, Some(Duration::from_secs(600))),
            Duration::from_secs(30)
        );
        let exact = Backoff::exponential(1.0, 30.0, 8);
        assert_eq!(exact.delay(6, None), Duration::from_secs(30));
    }
}
