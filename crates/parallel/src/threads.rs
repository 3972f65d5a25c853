//! Ranks as threads of one process: every rank's work on a thread of its own, its panic caught
//! and turned into an error, and a failing rank aborting the group so that the others stop at
//! their next collective call instead of waiting for it.

use std::future::Future;
use std::panic::AssertUnwindSafe;

use crate::error::ParallelError;

/// Runs `work(rank, item)` for every item of `items` (rank `i` gets item `i`), each on a thread
/// of its own, and returns their results in rank order. Async work runs on the caller's tokio
/// runtime when there is one (a served judge needs a multi-threaded runtime: its worker is
/// blocked for the call, as `block_in_place` allows), else on a local executor. A rank whose
/// work fails or panics calls `abort(rank, message)` before its thread ends; a panic becomes
/// [`ParallelError::RankPanicked`].
pub fn on_rank_threads<I, O, E, F, Fut>(
    items: Vec<I>,
    work: F,
    abort: &(dyn Fn(usize, &str) + Sync),
) -> Vec<Result<O, E>>
where
    I: Send,
    O: Send,
    E: Send + std::fmt::Display + From<ParallelError>,
    F: Fn(usize, I) -> Fut + Sync,
    Fut: Future<Output = Result<O, E>>,
{
    let handle = tokio::runtime::Handle::try_current().ok();
    let run = || {
        std::thread::scope(|s| {
            let threads: Vec<_> = items
                .into_iter()
                .enumerate()
                .map(|(rank, item)| {
                    let (handle, work) = (handle.clone(), &work);
                    s.spawn(move || {
                        let out = std::panic::catch_unwind(AssertUnwindSafe(|| {
                            let fut = work(rank, item);
                            match &handle {
                                Some(h) => h.block_on(fut),
                                None => futures::executor::block_on(fut),
                            }
                        }))
                        .unwrap_or_else(|panic| {
                            Err(E::from(ParallelError::RankPanicked {
                                rank,
                                message: panic_message(panic.as_ref()),
                            }))
                        });
                        if let Err(e) = &out {
                            abort(rank, &e.to_string());
                        }
                        out
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("rank panics are caught"))
                .collect::<Vec<_>>()
        })
    };
    let multi_thread = handle
        .as_ref()
        .is_some_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi_thread {
        tokio::task::block_in_place(run)
    } else {
        run()
    }
}

/// A panic's message, where it has one.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn results_come_in_rank_order_and_a_panic_aborts_the_group() {
        let aborted = Mutex::new(Vec::new());
        let abort = |rank: usize, message: &str| {
            aborted.lock().unwrap().push((rank, message.to_string()));
        };
        let out: Vec<Result<usize, ParallelError>> = on_rank_threads(
            vec![10, 20, 30],
            |rank, x| async move {
                if rank == 1 {
                    panic!("rank one's bad day");
                }
                Ok(x + rank)
            },
            &abort,
        );
        assert_eq!(out[0].as_ref().unwrap(), &10);
        assert_eq!(out[2].as_ref().unwrap(), &32);
        let err = out[1].as_ref().unwrap_err().to_string();
        assert_eq!(err, "rank 1 panicked: rank one's bad day");
        assert_eq!(*aborted.lock().unwrap(), vec![(1, err)]);
    }
}
