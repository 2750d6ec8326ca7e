//! The source's book of posted batches, shared by every backend: which
//! batches are still waiting for parts (TCP frames, shm write requests,
//! verbs work requests), how each ends, and the completions
//! [`crate::Connection::poll`] has not returned yet.
//!
//! A batch is opened before its parts go out, gains parts as they are
//! handed to the transport, and is sealed once all of them were. It
//! completes when it is sealed and every part is answered: with the first
//! error any part met, or Ok (then its `wire` hop is recorded). A batch
//! whose parts can no longer be attributed is reported at once and kept,
//! holding what it keeps alive (verbs: its source MRs), until its parts
//! are done.

use crate::metrics::{Hop, Hops};
use crate::{BatchId, Completion, TransportError};
use kvwire_core::protocol::Tag;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

/// An answer named a part that is not outstanding: the stream lost sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UnknownPart(pub u64);

#[derive(Debug)]
struct Open<K> {
    tag: Tag,
    bytes: u64,
    posted_at: Instant,
    /// Parts handed over and not yet answered.
    left: u64,
    /// Every part was handed over.
    sealed: bool,
    /// Its completion was already reported (it lingers for `_keep`).
    reported: bool,
    error: Option<TransportError>,
    _keep: K,
}

/// Posted batches of one connection; `K` is what each keeps alive until
/// its parts are done.
#[derive(Debug)]
pub(crate) struct Ledger<K = ()> {
    hops: Arc<Hops>,
    next: u64,
    open: BTreeMap<u64, Open<K>>,
    /// Part sequence number → batch, for parts answered by sequence.
    seqs: HashMap<u64, u64>,
    done: VecDeque<Completion>,
}

impl<K> Ledger<K> {
    /// An empty ledger numbering batches from `first`.
    pub(crate) fn new(hops: Arc<Hops>, first: u64) -> Ledger<K> {
        Ledger { hops, next: first, open: BTreeMap::new(), seqs: HashMap::new(), done: VecDeque::new() }
    }

    /// Opens a batch, not yet sealed.
    pub(crate) fn begin(&mut self, tag: Tag, bytes: u64, posted_at: Instant, keep: K) -> BatchId {
        let id = self.next;
        self.next += 1;
        let b = Open { tag, bytes, posted_at, left: 0, sealed: false, reported: false, error: None, _keep: keep };
        self.open.insert(id, b);
        BatchId(id)
    }

    /// A part of `id` went out; its answer will name `seq`.
    pub(crate) fn part(&mut self, id: BatchId, seq: u64) {
        self.parts(id, 1);
        self.seqs.insert(seq, id.0);
    }

    /// `n` parts of `id` went out; each completion names the batch.
    pub(crate) fn parts(&mut self, id: BatchId, n: u64) {
        if let Some(b) = self.open.get_mut(&id.0) {
            b.left += n;
        }
    }

    /// Every part of `id` went out (some failing with `error`); it
    /// completes once the last is answered.
    pub(crate) fn seal(&mut self, id: BatchId, error: Option<TransportError>) {
        if let Some(b) = self.open.get_mut(&id.0) {
            b.sealed = true;
            if let Some(e) = error {
                b.error.get_or_insert(e);
            }
        }
        self.settle(id.0, Instant::now());
    }

    /// Forgets `id`, none of whose parts will be answered (none went out,
    /// or the connection is being closed for it).
    pub(crate) fn withdraw(&mut self, id: BatchId) {
        self.open.remove(&id.0);
        self.seqs.retain(|_, b| *b != id.0);
    }

    /// The answer to part `seq`, seen at `at`.
    pub(crate) fn answer(&mut self, seq: u64, result: Result<(), TransportError>, at: Instant) -> Result<(), UnknownPart> {
        let id = self.seqs.remove(&seq).ok_or(UnknownPart(seq))?;
        self.part_done(BatchId(id), result, |_| false, at);
        Ok(())
    }

    /// A part of `id` completed. A failure is kept unless the batch already
    /// failed, or `supersedes` says the earlier error only echoes this one.
    /// Parts of unknown batches are ignored.
    pub(crate) fn part_done(&mut self, id: BatchId, result: Result<(), TransportError>, supersedes: impl Fn(&TransportError) -> bool, at: Instant) {
        let Some(b) = self.open.get_mut(&id.0) else { return };
        b.left = b.left.saturating_sub(1);
        if let Err(e) = result {
            if b.error.as_ref().is_none_or(supersedes) {
                b.error = Some(e);
            }
        }
        self.settle(id.0, at);
    }

    /// Reports `id` failed now; it lingers, keeping what it keeps, until
    /// its outstanding parts complete.
    pub(crate) fn fail_now(&mut self, id: BatchId, error: TransportError) {
        let Some(b) = self.open.get_mut(&id.0) else { return };
        b.sealed = true;
        let e = b.error.get_or_insert(error).clone();
        if !b.reported {
            b.reported = true;
            self.done.push_back(Completion { batch: id, tag: b.tag, bytes: b.bytes, result: Err(e), at: Instant::now() });
        }
        self.settle(id.0, Instant::now());
    }

    /// The peer is gone: every waiting batch fails with what `why` makes
    /// of their number.
    pub(crate) fn close(&mut self, why: impl Fn(usize) -> TransportError) {
        let e = why(self.waiting());
        self.seqs.clear();
        for (id, b) in std::mem::take(&mut self.open) {
            if !b.reported {
                self.done.push_back(Completion { batch: BatchId(id), tag: b.tag, bytes: b.bytes, result: Err(e.clone()), at: Instant::now() });
            }
        }
    }

    /// Batches posted whose completion is not yet known.
    pub(crate) fn waiting(&self) -> usize {
        self.open.values().filter(|b| !b.reported).count()
    }

    /// Batches posted whose completion `take_done` has not returned yet.
    pub(crate) fn pending(&self) -> usize {
        self.waiting() + self.done.len()
    }

    /// Whether a completion is ready.
    pub(crate) fn has_done(&self) -> bool {
        !self.done.is_empty()
    }

    /// The completions ready, in the order the batches finished.
    pub(crate) fn take_done(&mut self) -> Vec<Completion> {
        self.done.drain(..).collect()
    }

    fn settle(&mut self, id: u64, at: Instant) {
        let finished = self.open.get(&id).is_some_and(|b| b.sealed && b.left == 0);
        if !finished {
            return;
        }
        let b = self.open.remove(&id).expect("finished batch");
        if b.reported {
            return;
        }
        if b.error.is_none() {
            self.hops.record_batch(Hop::Wire, at.saturating_duration_since(b.posted_at), b.bytes);
        }
        self.done.push_back(Completion { batch: BatchId(id), tag: b.tag, bytes: b.bytes, result: b.error.map_or(Ok(()), Err), at });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger() -> Ledger {
        Ledger::new(Arc::new(Hops::default()), 1)
    }

    const T: Tag = Tag { slot: 1, layer: 0 };

    #[test]
    fn a_batch_completes_once_sealed_and_every_part_answered() {
        let mut l = ledger();
        let id = l.begin(T, 10, Instant::now(), ());
        l.part(id, 7);
        l.part(id, 8);
        l.seal(id, None);
        l.answer(7, Ok(()), Instant::now()).unwrap();
        assert!(!l.has_done());
        l.answer(8, Err(TransportError::Refused("no".into())), Instant::now()).unwrap();
        assert_eq!(l.take_done()[0].result, Err(TransportError::Refused("no".into())));
        assert_eq!(l.answer(8, Ok(()), Instant::now()), Err(UnknownPart(8)));
        assert_eq!(l.pending(), 0);
    }

    #[test]
    fn a_batch_reported_early_lingers_until_its_parts_are_done() {
        let mut l = ledger();
        let id = l.begin(T, 10, Instant::now(), ());
        l.parts(id, 2);
        l.fail_now(id, TransportError::Refused("qp".into()));
        assert_eq!(l.take_done().len(), 1);
        assert_eq!(l.pending(), 0);
        l.part_done(id, Ok(()), |_| false, Instant::now());
        l.part_done(id, Ok(()), |_| false, Instant::now());
        assert!(!l.has_done(), "reported once only");
        assert!(l.open.is_empty());
    }
}
