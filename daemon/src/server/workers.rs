//! Threads kept for the transfers' own work (the source's transfer, the
//! destination's receive): starting a thread costs tens of microseconds,
//! and a small transfer's whole life is a few hundred. A job goes to an
//! idle worker, or to a new one when none is idle; a worker that finishes
//! waits for the next job, and idle ones beyond the cap, or all of them
//! once the daemon's last client left, end.

use std::sync::{Arc, Condvar, Mutex};

pub(super) type Job = Box<dyn FnOnce() + Send + 'static>;

/// Idle workers kept at most.
const KEEP_IDLE: usize = 16;

#[derive(Default)]
struct Queue {
    jobs: Vec<Job>,
    idle: usize,
    // Set by `shrink` until the next job: a worker with nothing to do ends.
    draining: bool,
}

#[derive(Default)]
pub(super) struct Workers {
    q: Arc<(Mutex<Queue>, Condvar)>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let q = self.q.0.lock().expect("workers lock");
        f.debug_struct("Workers").field("idle", &q.idle).field("queued", &q.jobs.len()).finish()
    }
}

impl Workers {
    /// Runs `job` on an idle worker, or on a new thread named `name`. A
    /// panic in `job` is caught and handed to `on_panic` (which fails the
    /// job's transfer), and the worker lives on.
    pub fn spawn(&self, name: &str, job: impl FnOnce() + Send + 'static, on_panic: impl FnOnce(String) + Send + 'static) -> std::io::Result<()> {
        let job = guarded(job, on_panic);
        let (lock, cv) = &*self.q;
        let mut q = lock.lock().expect("workers lock");
        q.draining = false;
        if q.idle > q.jobs.len() {
            q.jobs.push(job);
            // Woken after the lock is released: woken under it, the worker
            // would wake only to wait for the lock this thread holds.
            drop(q);
            cv.notify_one();
            return Ok(());
        }
        drop(q);
        let queue = self.q.clone();
        std::thread::Builder::new().name(name.into()).spawn(move || {
            job();
            worker(&queue);
        })?;
        Ok(())
    }

    /// Ends every idle worker, and every busy one when its job is done,
    /// until the next job arrives.
    pub fn shrink(&self) {
        let (lock, cv) = &*self.q;
        lock.lock().expect("workers lock").draining = true;
        cv.notify_all();
    }
}

/// `job`, with a panic in it caught and handed to `on_panic`.
pub(super) fn guarded(job: impl FnOnce() + Send + 'static, on_panic: impl FnOnce(String) + Send + 'static) -> Job {
    Box::new(move || {
        if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)) {
            on_panic(panic_text(&*p));
        }
    })
}

/// What a caught panic said.
pub(super) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_else(|| "a panic".into())
}

/// A worker's life after its first job: the next job, or an end.
fn worker(queue: &(Mutex<Queue>, Condvar)) {
    let (lock, cv) = queue;
    let mut q = lock.lock().expect("workers lock");
    loop {
        if q.jobs.is_empty() && (q.draining || q.idle >= KEEP_IDLE) {
            return;
        }
        q.idle += 1;
        while q.jobs.is_empty() && !q.draining {
            q = cv.wait(q).expect("workers lock");
        }
        q.idle -= 1;
        let Some(job) = q.jobs.pop() else { return };
        drop(q);
        job();
        q = lock.lock().expect("workers lock");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    fn threads() -> usize {
        std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
    }

    #[test]
    fn jobs_reuse_idle_workers_and_shrink_ends_them() {
        let w = Workers::default();
        let (tx, rx) = mpsc::channel();
        for i in 0..3 {
            let tx = tx.clone();
            w.spawn("t", move || tx.send(i).unwrap(), |_| {}).unwrap();
            assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), i);
            // Let the worker go idle before the next job.
            while w.q.0.lock().unwrap().idle == 0 {
                std::thread::yield_now();
            }
        }
        // One job at a time: one worker served all three.
        assert_eq!(w.q.0.lock().unwrap().idle, 1);
        let before = threads();
        w.shrink();
        while w.q.0.lock().unwrap().idle > 0 {
            std::thread::yield_now();
        }
        for _ in 0..500 {
            if threads() < before {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("an idle worker outlived shrink");
    }

    #[test]
    fn a_panicking_job_is_reported_and_its_worker_serves_the_next() {
        let w = Workers::default();
        let (tx, rx) = mpsc::channel();
        let t = tx.clone();
        w.spawn("t", || panic!("boom"), move |why| t.send(why).unwrap()).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), "boom");
        while w.q.0.lock().unwrap().idle == 0 {
            std::thread::yield_now();
        }
        // The one worker survived its panic and is idle, so the next job goes to it.
        w.spawn("t", move || tx.send("next".into()).unwrap(), |_| {}).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), "next");
        // It sent before going idle again: wait for that, then it is the only one.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while w.q.0.lock().unwrap().idle == 0 && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert_eq!(w.q.0.lock().unwrap().idle, 1, "the worker that caught the panic took the next job");
    }
}
