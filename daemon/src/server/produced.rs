//! Layers an engine has written, per (group, source request) and rank: what
//! a streamed submit waits on before it hashes and sends each layer.
//!
//! Announcements may come before the submit (each rank's process announces
//! its own layers as its forward pass writes them, while the submitting
//! rank may still be negotiating), so an entry exists from the first
//! announcement or wait until the streamed transfer ends. Entries nobody
//! submits are dropped once older than the transfer timeout, and at most
//! [`MAX_ENTRIES`] are held.

use super::error::Refusal;
use kvwire_client::control::Code;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Requests with announcements held at once.
pub(super) const MAX_ENTRIES: usize = 4096;

/// How often a waiter looks at its stop flag while nothing is announced.
const STOP_POLL: Duration = Duration::from_millis(20);

#[derive(Default)]
struct Entry {
    // Layers written, per rank.
    ranks: BTreeMap<u32, u16>,
    touched: Option<Instant>,
}

#[derive(Default)]
pub(super) struct Produced {
    map: Mutex<HashMap<(String, String), Entry>>,
    changed: Condvar,
}

impl Produced {
    /// Rank `rank` of `group` wrote layers `0..layers` of `request`.
    /// A smaller count than one already announced changes nothing.
    pub fn announce(&self, group: &str, request: &str, rank: u32, layers: u16, stale_after: Duration) -> Result<(), Refusal> {
        let mut m = self.map.lock().expect("produced lock");
        let now = Instant::now();
        let key = (group.to_string(), request.to_string());
        if !m.contains_key(&key) && m.len() >= MAX_ENTRIES {
            m.retain(|_, e| e.touched.is_none_or(|t| now.duration_since(t) < stale_after));
            if m.len() >= MAX_ENTRIES {
                return Err(Refusal::new(
                    Code::Limit,
                    format!("{MAX_ENTRIES} requests have layers announced and no streamed transfer has ended them; `{request}` of group `{group}` is refused"),
                ));
            }
        }
        let e = m.entry(key).or_default();
        let n = e.ranks.entry(rank).or_default();
        *n = (*n).max(layers);
        e.touched = Some(now);
        self.changed.notify_all();
        Ok(())
    }

    /// Waits until every rank of `ranks` announced more than `layer`
    /// layers of `request`, until `deadline`, or until `stop` is set.
    pub fn wait(&self, group: &str, request: &str, ranks: &[u32], layer: u16, deadline: Instant, stop: &AtomicBool) -> Result<(), String> {
        let key = (group.to_string(), request.to_string());
        let mut m = self.map.lock().expect("produced lock");
        loop {
            let missing = {
                let e = m.entry(key.clone()).or_default();
                ranks.iter().copied().find(|r| e.ranks.get(r).is_none_or(|&n| n <= layer))
            };
            let Some(rank) = missing else { return Ok(()) };
            if stop.load(Ordering::Acquire) {
                return Err("cancelled".into());
            }
            let now = Instant::now();
            if now >= deadline {
                let had = m.get(&key).and_then(|e| e.ranks.get(&rank)).copied().unwrap_or(0);
                return Err(format!("rank {rank} of group `{group}` announced {had} layers of `{request}`, and layer {layer} never came"));
            }
            m = self.changed.wait_timeout(m, (deadline - now).min(STOP_POLL)).expect("produced lock").0;
        }
    }

    /// How many layers from `from` on are written already by every rank
    /// that reads them (`readers[layer]`), without waiting: a streamed
    /// transfer that falls behind its engine moves those together.
    pub fn ready_from(&self, group: &str, request: &str, readers: &[Vec<u32>], from: usize) -> usize {
        let m = self.map.lock().expect("produced lock");
        let Some(e) = m.get(&(group.to_string(), request.to_string())) else {
            return readers[from..].iter().take_while(|r| r.is_empty()).count();
        };
        readers[from..].iter().enumerate().take_while(|(i, r)| r.iter().all(|rank| e.ranks.get(rank).is_some_and(|&n| usize::from(n) > from + i))).count()
    }

    /// The streamed transfer of `request` ended: its announcements go.
    pub fn forget(&self, group: &str, request: &str) {
        self.map.lock().expect("produced lock").remove(&(group.to_string(), request.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_wait_ends_when_every_rank_announced_the_layer() {
        let p = Arc::new(Produced::default());
        let stop = AtomicBool::new(false);
        let later = Instant::now() + Duration::from_secs(5);
        p.announce("g", "r", 0, 2, Duration::from_secs(60)).unwrap();
        p.wait("g", "r", &[0], 1, later, &stop).unwrap();
        let q = p.clone();
        let t = std::thread::spawn(move || q.wait("g", "r", &[0, 1], 1, later, &AtomicBool::new(false)));
        p.announce("g", "r", 1, 1, Duration::from_secs(60)).unwrap();
        // Rank 1 has layer 0 only; a smaller count never lowers what was said.
        p.announce("g", "r", 0, 1, Duration::from_secs(60)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished());
        p.announce("g", "r", 1, 2, Duration::from_secs(60)).unwrap();
        t.join().unwrap().unwrap();
        // Past the deadline, the rank that fell short is named.
        let e = p.wait("g", "r", &[0, 1], 2, Instant::now(), &stop).unwrap_err();
        assert!(e.contains("rank 0 of group `g` announced 2 layers of `r`, and layer 2 never came"), "{e}");
        stop.store(true, Ordering::Release);
        assert_eq!(p.wait("g", "r", &[0], 5, later, &stop), Err("cancelled".into()));
        // Layers 0 and 1 are written by both ranks, and nobody reads layer 3.
        let readers = vec![vec![0, 1], vec![0, 1], vec![0, 1], vec![]];
        assert_eq!(p.ready_from("g", "r", &readers, 0), 2);
        assert_eq!(p.ready_from("g", "r", &readers, 2), 0);
        // Layer 2 by rank 0 only: still not ready.
        p.announce("g", "r", 0, 3, Duration::from_secs(60)).unwrap();
        assert_eq!(p.ready_from("g", "r", &readers, 1), 1);
        p.announce("g", "r", 1, 3, Duration::from_secs(60)).unwrap();
        assert_eq!(p.ready_from("g", "r", &readers, 1), 3);
        p.forget("g", "r");
        assert!(p.map.lock().unwrap().is_empty());
    }

    #[test]
    fn entries_nobody_submits_are_bounded() {
        let p = Produced::default();
        for i in 0..MAX_ENTRIES {
            p.announce("g", &i.to_string(), 0, 1, Duration::from_secs(60)).unwrap();
        }
        let e = p.announce("g", "one-more", 0, 1, Duration::from_secs(60)).unwrap_err();
        assert!(e.message.contains("4096 requests have layers announced"), "{}", e.message);
        // Known requests still count up.
        p.announce("g", "7", 0, 2, Duration::from_secs(60)).unwrap();
        // Stale ones make room.
        p.announce("g", "one-more", 0, 1, Duration::ZERO).unwrap();
        assert_eq!(p.map.lock().unwrap().len(), 1);
    }
}
