//! Running streams together, round by round (the campaign's transfers and
//! its baselines share this).

use anyhow::anyhow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;

/// Transfers at once, in lock-step rounds: `work(state, round)` runs on one
/// thread per state, all threads released together by a barrier each
/// round. After a failure every thread stops working (but keeps meeting the
/// barrier, so none waits forever); the first error is returned.
pub(super) fn lockstep<S, T, F>(states: Vec<S>, rounds: usize, work: F) -> anyhow::Result<Vec<Vec<T>>>
where
    S: Send,
    T: Send,
    F: Fn(usize, &mut S) -> anyhow::Result<T> + Sync,
{
    let barrier = Barrier::new(states.len());
    let failed = AtomicBool::new(false);
    let results: Vec<anyhow::Result<Vec<T>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = states
            .into_iter()
            .enumerate()
            .map(|(lane, mut state)| {
                let (barrier, failed, work) = (&barrier, &failed, &work);
                scope.spawn(move || {
                    let mut out = Vec::with_capacity(rounds);
                    let mut err = None;
                    for _ in 0..rounds {
                        barrier.wait();
                        if failed.load(Ordering::Acquire) {
                            continue;
                        }
                        match work(lane, &mut state) {
                            Ok(t) => out.push(t),
                            Err(e) => {
                                failed.store(true, Ordering::Release);
                                err = Some(e.context(format!("stream {lane}")));
                            }
                        }
                    }
                    err.map_or(Ok(out), Err)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a campaign thread panicked")))).collect()
    });
    results.into_iter().collect()
}
