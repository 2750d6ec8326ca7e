//! Striping a transfer across the destination's rails, with failover.
//!
//! The layer batches are cut into slices of at most `slice_bytes`, in layer
//! order; a slice never mixes destination ranks that prefer different
//! rails. Each rail has its own connection and its own thread, which keeps
//! up to `window` slices in flight, or more while they hold fewer than
//! `window_bytes` (small slices: a layer's few writes each), and takes the
//! next slice whenever one completes — so a faster rail simply takes more
//! slices, and early layers still finish first.
//!
//! Locality: a slice may name the rails it prefers (the destination's rails
//! closest to its rank's memory, by NUMA node or PCIe switch). Only those
//! take it while any of them is up; the others take it once all of them
//! failed. A slice that prefers nothing goes to any rail.
//!
//! A rail fails when its connection cannot be made, breaks, or goes
//! `stall` without a completion while slices are outstanding and another
//! rail is still up (a port that went down breaks no TCP connection by
//! itself; the last rail instead waits, bounded by the transfer and peer
//! timeouts). Its outstanding slices go
//! back to the front of the queue for the other rails; their bytes count as
//! re-sent. A slice is re-sent whole, with the same writes, so the
//! destination (which counts each byte range once) places it exactly once
//! however many copies land. A refused write (revoked key, overrun) is not a
//! rail failure: it fails the transfer. So does losing every rail.

use kvwire_client::control::RailUse;
use kvwire_core::session::msg::RailAddr;
use kvwire_transport::{Batch, BatchId, Connection, TransportError, WriteOp};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Cuts each layer's batch into slices of at most `slice_bytes`, splitting
/// writes where needed (never a strided one: a slice may then hold more). Layers without writes give no slice.
/// A new slice starts wherever `group` (the rails a write's destination
/// prefers) changes, so each slice can prefer the rails of one group.
pub fn cut(batches: Vec<Batch>, slice_bytes: u64, group: impl Fn(&WriteOp) -> u64) -> Vec<Batch> {
    let slice_bytes = slice_bytes.max(1);
    let mut out = Vec::new();
    for b in batches {
        let mut cur = Batch { tag: b.tag, writes: Vec::new() };
        let mut size = 0;
        for w in b.writes {
            if cur.writes.first().is_some_and(|f| group(f) != group(&w)) {
                out.push(std::mem::replace(&mut cur, Batch { tag: b.tag, writes: Vec::new() }));
                size = 0;
            }
            if w.len == 0 {
                // Goes out as is: the destination refuses it by name.
                cur.writes.push(w);
                continue;
            }
            if w.stride.is_some() {
                // Whole: one request, which a re-sent slice repeats exactly (counted once).
                cur.writes.push(w);
                size += w.bytes();
                if size >= slice_bytes {
                    out.push(std::mem::replace(&mut cur, Batch { tag: b.tag, writes: Vec::new() }));
                    size = 0;
                }
                continue;
            }
            let mut off = 0;
            while off < w.len {
                let n = (w.len - off).min(slice_bytes - size);
                cur.writes.push(WriteOp { src_offset: w.src_offset + off, dst_offset: w.dst_offset + off, len: n, ..w });
                size += n;
                off += n;
                if size == slice_bytes {
                    out.push(std::mem::replace(&mut cur, Batch { tag: b.tag, writes: Vec::new() }));
                    size = 0;
                }
            }
        }
        if !cur.writes.is_empty() {
            out.push(cur);
        }
    }
    out
}

/// What happened on a rail, for live metrics.
#[derive(Debug, Clone, Copy)]
pub enum RailEvent<'a> {
    /// The rail is about to post its first slice.
    Starting,
    /// A slice was posted.
    Posted,
    /// A slice of this many bytes completed.
    Completed(u64),
    /// The rail failed, for this reason; this many bytes of its slices go to other rails.
    Failed(u64, &'a str),
}

/// Opens a data connection to the destination's rail number `i` (the
/// index in `rails`), from the local rail that serves it.
pub type Connect<'a> = dyn Fn(usize, &RailAddr) -> Result<Box<dyn Connection>, TransportError> + Sync + 'a;

/// Takes back a rail's connection that ended its part well and may serve
/// another transfer ([`Connection::reusable`]).
pub type Park<'a> = dyn Fn(usize, &RailAddr, Box<dyn Connection>) + Sync + 'a;

/// The most slices one rail keeps in flight, however small.
pub const MAX_WINDOW: usize = 64;

/// How to run the slices.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Slices in flight per rail, at least.
    pub window: usize,
    /// More slices go in flight while those in flight hold fewer bytes
    /// than this (up to [`MAX_WINDOW`]).
    pub window_bytes: u64,
    /// No completion for this long with slices outstanding fails a rail.
    pub stall: Duration,
    /// The transfer fails after this.
    pub deadline: Instant,
}

/// What the rails carried.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    /// Payload bytes completed (each slice once).
    pub bytes: u64,
    /// Writes completed.
    pub writes: u64,
    /// Per rail.
    pub rails: Vec<RailUse>,
    /// Summed time spent handing slices to the transport.
    pub post_time: Duration,
    /// Bytes re-sent after a rail failed plus what transports retransmitted.
    pub retransmitted: u64,
    /// The links' busy span: first post on any rail to last completion on
    /// any (connection setup excluded).
    pub wire: Duration,
    /// Framing the connections really sent and got back for the writes
    /// (headers, trailers, verbs notes, acks), as each reports it.
    pub framing: u64,
}

impl Outcome {
    /// Adds what a later run of the same transfer carried (a streamed
    /// transfer runs once per layer): totals add, rails by name.
    pub fn absorb(&mut self, o: &Outcome) {
        self.bytes += o.bytes;
        self.writes += o.writes;
        self.post_time += o.post_time;
        self.retransmitted += o.retransmitted;
        self.wire += o.wire;
        self.framing += o.framing;
        for r in &o.rails {
            match self.rails.iter_mut().find(|m| m.name == r.name) {
                Some(m) => {
                    m.bytes += r.bytes;
                    m.slices += r.slices;
                    m.retransmitted_bytes += r.retransmitted_bytes;
                    m.busy_ns += r.busy_ns;
                    if r.failed.is_some() {
                        m.failed.clone_from(&r.failed);
                    }
                }
                None => self.rails.push(r.clone()),
            }
        }
    }
}

#[derive(Default)]
struct Shared {
    // Queued slices by the rails they prefer (a bit per rail; 0: any).
    queues: BTreeMap<u64, VecDeque<usize>>,
    done: usize,
    alive: usize,
    fatal: Option<String>,
    failures: Vec<String>,
    lanes: Vec<LaneState>,
    // Rail threads not yet returned: the watchdog ends when this reaches 0.
    running: usize,
    // Rail threads waiting on the condvar: a change wakes them only when
    // there are any (a lone rail never waits, and a wake is a system call).
    sleeping: usize,
}

/// Releases `sh`, the lock under which the caller changed the state, and
/// wakes the rails waiting for a change, if any.
fn wake(sh: std::sync::MutexGuard<'_, Shared>, cv: &Condvar) {
    let any = sh.sleeping > 0;
    drop(sh);
    if any {
        cv.notify_all();
    }
}

/// What the watchdog sees of a rail.
#[derive(Default)]
struct LaneState {
    up: bool,
    inflight: usize,
    last_progress: Option<Instant>,
    stalled: bool,
    // Breaks the rail's connection from outside, so a post blocked on a
    // dead link returns.
    interrupt: Option<Box<dyn Fn() + Send + Sync>>,
}

impl Shared {
    /// The next slice rail `me` may take: the earliest among those that
    /// prefer it, prefer nothing, or prefer only rails that are down.
    fn take(&mut self, me: usize) -> Option<usize> {
        let up: u64 = self.lanes.iter().enumerate().filter(|(_, l)| l.up).fold(0, |m, (i, _)| m | 1 << i);
        let mask = *self
            .queues
            .iter()
            .filter(|(&mask, q)| !q.is_empty() && (mask == 0 || mask & (1 << me) != 0 || mask & up == 0))
            .min_by_key(|(_, q)| q.front().copied())?
            .0;
        self.queues.get_mut(&mask)?.pop_front()
    }

    fn interrupt_all(&mut self) {
        for l in &mut self.lanes {
            if let Some(i) = l.interrupt.take() {
                i();
            }
        }
    }
}

/// Answers whether the transfer must end now (cancel, peer lost), and why.
pub type Interrupted = dyn Fn() -> Option<String> + Send + Sync;

/// Runs a check every few milliseconds on another thread until it returns
/// false: the transfer's watchdog, so that a one-rail transfer starts and
/// wakes no thread of its own.
pub type Watch<'a> = dyn Fn(Box<dyn FnMut() -> bool + Send>) -> std::io::Result<()> + 'a;

/// Sends `slices` over `rails` (connections made with `connect`) until each
/// completed once. `interrupted` is asked every few milliseconds (cancel,
/// peer lost); `event` hears of every post, completion and failure.
/// Rail 0 runs on the calling thread, the other rails on threads of their
/// own, and the watchdog's checks where `watch` runs them.
#[allow(clippy::too_many_arguments)] // the run's inputs, each used once
pub fn run(
    slices: &[Batch],
    prefer: &[u64],
    rails: &[RailAddr],
    (connect, park): (&Connect<'_>, &Park<'_>),
    settings: &Settings,
    interrupted: Arc<Interrupted>,
    event: &(dyn Fn(&RailAddr, RailEvent<'_>) + Sync),
    watch: &Watch<'_>,
) -> (Outcome, Result<(), String>) {
    let mut outcome = Outcome::default();
    if slices.is_empty() {
        return (outcome, Ok(()));
    }
    if rails.is_empty() {
        return (outcome, Err("the peer offered no data rail".into()));
    }
    let sync: Arc<(Mutex<Shared>, Condvar)> = Arc::new((
        Mutex::new(Shared {
            queues: (0..slices.len()).fold(BTreeMap::new(), |mut m: BTreeMap<u64, VecDeque<usize>>, i| {
                m.entry(prefer.get(i).copied().unwrap_or(0)).or_default().push_back(i);
                m
            }),
            done: 0,
            alive: rails.len(),
            fatal: None,
            failures: Vec::new(),
            lanes: rails.iter().map(|_| LaneState { up: true, ..LaneState::default() }).collect(),
            running: rails.len(),
            sleeping: 0,
        }),
        Condvar::new(),
    ));
    // The watchdog holds its own share of the state: its last look comes
    // after the last rail returned.
    let w = (sync.clone(), settings.clone());
    if let Err(e) = watch(Box::new(move || watchdog(&w.0 .0, &w.0 .1, &w.1, &*interrupted))) {
        return (outcome, Err(format!("cannot start the transfer's watchdog: {e}")));
    }
    let lanes: Vec<LaneResult> = std::thread::scope(|scope| {
        let (shared, cv) = (&sync.0, &sync.1);
        let run_lane = move |i: usize, rail: &RailAddr| {
            let r = lane(i, slices, prefer, rail, (connect, park), settings, event, shared, cv);
            let mut sh = shared.lock().expect("stripe lock");
            sh.running -= 1;
            wake(sh, cv);
            r
        };
        let others: Vec<_> = rails.iter().enumerate().skip(1).map(|(i, rail)| scope.spawn(move || run_lane(i, rail))).collect();
        let mut all = vec![run_lane(0, &rails[0])];
        all.extend(others.into_iter().map(|h| h.join().expect("rail thread")));
        all
    });
    let first = lanes.iter().filter_map(|l| l.span.map(|s| s.0)).min();
    let last = lanes.iter().filter_map(|l| l.span.map(|s| s.1)).max();
    if let (Some(a), Some(b)) = (first, last) {
        outcome.wire = b.saturating_duration_since(a);
    }
    for LaneResult { rail: r, post_time, writes, framing, .. } in lanes {
        outcome.framing += framing;
        outcome.bytes += r.bytes;
        outcome.writes += writes;
        outcome.post_time += post_time;
        outcome.retransmitted += r.retransmitted_bytes;
        outcome.rails.push(r);
    }
    let sh = std::mem::take(&mut *sync.0.lock().expect("stripe lock"));
    let result = match sh.fatal {
        Some(e) => Err(e),
        None if sh.done < slices.len() => Err(format!("{} of {} slices never completed: {}", slices.len() - sh.done, slices.len(), sh.failures.join("; "))),
        None => Ok(()),
    };
    (outcome, result)
}

/// One look, until every rail thread ended (then false): ends the transfer
/// on an interruption or the deadline, and breaks a rail that stalled
/// while another is up. Rail threads may be blocked in a post, so both are
/// done by breaking their connections from here. Never waits.
fn watchdog(shared: &Mutex<Shared>, cv: &Condvar, settings: &Settings, interrupted: &Interrupted) -> bool {
    if shared.lock().expect("stripe lock").running == 0 {
        return false;
    }
    let why = interrupted().or_else(|| (Instant::now() > settings.deadline).then(|| "transfer timed out".to_string()));
    let mut sh = shared.lock().expect("stripe lock");
    if let Some(why) = why {
        sh.fatal.get_or_insert(why);
    }
    if sh.fatal.is_some() {
        sh.interrupt_all();
        wake(sh, cv);
        return true;
    }
    // A stalled rail is given up only while another can take its
    // slices; the last one waits (the transfer and peer timeouts bound it).
    let up = sh.lanes.iter().filter(|l| l.up && !l.stalled).count();
    if up < 2 {
        return true;
    }
    if let Some(l) = sh.lanes.iter_mut().find(|l| {
        l.up && !l.stalled && l.inflight > 0 && l.last_progress.is_some_and(|t| t.elapsed() > settings.stall)
    }) {
        l.stalled = true;
        if let Some(i) = l.interrupt.take() {
            i();
        }
    }
    true
}

/// What one rail's thread did.
struct LaneResult {
    rail: RailUse,
    post_time: Duration,
    writes: u64,
    // Framing sent and answers received on its connection.
    framing: u64,
    // First post and last completion.
    span: Option<(Instant, Instant)>,
}

/// One rail's thread: what it posted, what is in flight, what it carried.
struct Lane<'a> {
    me: usize,
    slices: &'a [Batch],
    prefer: &'a [u64],
    rail: &'a RailAddr,
    settings: &'a Settings,
    event: &'a (dyn Fn(&RailAddr, RailEvent<'_>) + Sync),
    shared: &'a Mutex<Shared>,
    cv: &'a Condvar,
    use_: RailUse,
    post_time: Duration,
    writes: u64,
    inflight: HashMap<BatchId, usize>,
    first_post: Option<Instant>,
    last_done: Option<Instant>,
}

/// Whether a lane goes on after a step.
#[derive(PartialEq, Eq)]
enum Step {
    Go,
    Stop,
}

/// One rail's thread.
#[allow(clippy::too_many_arguments)]
fn lane(
    me: usize,
    slices: &[Batch],
    prefer: &[u64],
    rail: &RailAddr,
    (connect, park): (&Connect<'_>, &Park<'_>),
    settings: &Settings,
    event: &(dyn Fn(&RailAddr, RailEvent<'_>) + Sync),
    shared: &Mutex<Shared>,
    cv: &Condvar,
) -> LaneResult {
    let use_ = RailUse { name: rail.name.clone(), addr: rail.addr.clone(), bytes: 0, slices: 0, retransmitted_bytes: 0, busy_ns: 0, failed: None };
    let mut l = Lane {
        me,
        slices,
        prefer,
        rail,
        settings,
        event,
        shared,
        cv,
        use_,
        post_time: Duration::ZERO,
        writes: 0,
        inflight: HashMap::new(),
        first_post: None,
        last_done: None,
    };
    let mut conn: Box<dyn Connection> = match connect(me, rail) {
        Ok(c) => c,
        Err(e) => {
            l.fail(format!("unreachable: {e}"));
            return LaneResult { rail: l.use_, post_time: l.post_time, writes: l.writes, framing: 0, span: None };
        }
    };
    // A kept connection counts from where the last transfer left it.
    let (retransmitted0, framing0) = (conn.retransmitted_bytes(), conn.framing_bytes() + conn.answer_bytes());
    l.lock().lanes[me].interrupt = conn.interrupter();
    while l.step(&mut *conn) == Step::Go {}
    l.lock().lanes[me].interrupt = None;
    l.use_.retransmitted_bytes += conn.retransmitted_bytes().saturating_sub(retransmitted0);
    let span = l.first_post.zip(l.last_done);
    if let Some((a, b)) = span {
        l.use_.busy_ns = b.saturating_duration_since(a).as_nanos() as u64;
    }
    let framing = (conn.framing_bytes() + conn.answer_bytes()).saturating_sub(framing0);
    let ok = l.use_.failed.is_none() && l.lock().fatal.is_none();
    if ok && conn.reusable() {
        park(me, rail, conn);
    }
    LaneResult { rail: l.use_, post_time: l.post_time, writes: l.writes, framing, span }
}

impl Lane<'_> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().expect("stripe lock")
    }

    /// One round: stop when the transfer failed or this rail stalled;
    /// fill the window; then wait for a completion, or for other rails.
    fn step(&mut self, conn: &mut dyn Connection) -> Step {
        let (fatal, stalled) = {
            let sh = self.lock();
            (sh.fatal.is_some(), sh.lanes[self.me].stalled)
        };
        if fatal {
            return Step::Stop;
        }
        // The watchdog marked this rail stalled (and broke its connection
        // where the transport can): give its slices to the others.
        if stalled {
            self.fail(String::new());
            return Step::Stop;
        }
        if self.fill(conn) == Step::Stop {
            return Step::Stop;
        }
        if self.inflight.is_empty() {
            let mut sh = self.lock();
            if sh.done == self.slices.len() || sh.fatal.is_some() {
                return Step::Stop;
            }
            // Others hold the last slices: wait for them to finish, or to
            // fail and hand theirs back.
            sh.sleeping += 1;
            let (mut sh, _) = self.cv.wait_timeout(sh, Duration::from_millis(20)).expect("stripe lock");
            sh.sleeping -= 1;
            return Step::Go;
        }
        self.reap(conn)
    }

    /// Posts queued slices until the window is full or the queues are
    /// empty: all that fit go in one post, so the transport can send them
    /// together.
    fn fill(&mut self, conn: &mut dyn Connection) -> Step {
        let taken: Vec<usize> = {
            let mut sh = self.lock();
            let mut taken = Vec::new();
            let mut bytes: u64 = self.inflight.values().map(|&i| self.slices[i].bytes()).sum();
            loop {
                let n = self.inflight.len() + taken.len();
                if n >= MAX_WINDOW || (n >= self.settings.window && bytes >= self.settings.window_bytes) {
                    break;
                }
                let Some(i) = sh.take(self.me) else { break };
                bytes += self.slices[i].bytes();
                taken.push(i);
            }
            let l = &mut sh.lanes[self.me];
            if l.inflight == 0 && !taken.is_empty() {
                l.last_progress = Some(Instant::now());
            }
            l.inflight += taken.len();
            taken
        };
        if taken.is_empty() {
            return Step::Go;
        }
        let t = Instant::now();
        if self.first_post.is_none() {
            self.first_post = Some(t);
            (self.event)(self.rail, RailEvent::Starting);
        }
        match conn.post_all(taken.iter().map(|&i| self.slices[i].clone()).collect()) {
            Ok(ids) => {
                self.post_time += t.elapsed();
                for (b, i) in ids.into_iter().zip(taken) {
                    self.inflight.insert(b, i);
                    (self.event)(self.rail, RailEvent::Posted);
                }
                Step::Go
            }
            Err((posted, e)) => {
                // Every slice taken goes back to the queues (`fail`): those
                // not posted under ids no batch has.
                for (k, &i) in taken.iter().enumerate() {
                    self.inflight.insert(posted.get(k).copied().unwrap_or(BatchId(u64::MAX - k as u64)), i);
                }
                self.fail(format!("post: {e}"));
                Step::Stop
            }
        }
    }

    /// Takes the completions that arrive within 20 ms.
    fn reap(&mut self, conn: &mut dyn Connection) -> Step {
        let done = match conn.poll(Duration::from_millis(20)) {
            Ok(done) => done,
            Err(e) => {
                self.fail(e.to_string());
                return Step::Stop;
            }
        };
        for c in done {
            let Some(i) = self.inflight.remove(&c.batch) else { continue };
            match c.result {
                Ok(()) => self.completed(i, c.bytes, c.at),
                Err(TransportError::Refused(why)) => {
                    let mut sh = self.lock();
                    sh.fatal.get_or_insert(format!("peer refused a write on rail `{}`: {why}", self.rail.name));
                    wake(sh, self.cv);
                    return Step::Stop;
                }
                Err(e) => {
                    self.inflight.insert(c.batch, i);
                    self.fail(e.to_string());
                    return Step::Stop;
                }
            }
        }
        Step::Go
    }

    /// Slice `i` completed, as the transport saw at `at`: the rail's busy
    /// span ends there, not when this thread got to reap it.
    fn completed(&mut self, i: usize, bytes: u64, at: Instant) {
        let now = Instant::now();
        self.last_done = Some(self.last_done.map_or(at, |d| d.max(at)));
        self.use_.bytes += bytes;
        self.use_.slices += 1;
        self.writes += self.slices[i].writes.len() as u64;
        let mut sh = self.lock();
        sh.done += 1;
        sh.lanes[self.me].inflight -= 1;
        sh.lanes[self.me].last_progress = Some(now);
        wake(sh, self.cv);
        (self.event)(self.rail, RailEvent::Completed(bytes));
    }

    /// Gives this rail's outstanding slices back and leaves; the last rail
    /// to leave with work undone fails the transfer.
    fn fail(&mut self, why: String) {
        let mut back: Vec<usize> = self.inflight.drain().map(|(_, i)| i).collect();
        back.sort_unstable();
        let resent: u64 = back.iter().map(|&i| self.slices[i].bytes()).sum();
        let (rail, me) = (self.rail, self.me);
        let mut sh = self.lock();
        let why = if sh.lanes[me].stalled { format!("stalled: no completion for {} ms", self.settings.stall.as_millis()) } else { why };
        for i in back.into_iter().rev() {
            sh.queues.entry(self.prefer.get(i).copied().unwrap_or(0)).or_default().push_front(i);
        }
        sh.alive -= 1;
        sh.lanes[me].up = false;
        sh.lanes[me].interrupt = None;
        sh.failures.push(format!("rail `{}` ({}): {why}", rail.name, rail.addr));
        if sh.alive == 0 && sh.done < self.slices.len() && sh.fatal.is_none() {
            sh.fatal = Some(format!("every rail failed: {}", sh.failures.join("; ")));
        }
        wake(sh, self.cv);
        tracing::warn!(rail = rail.name, addr = rail.addr, why, resent, "rail failed; its slices go to the others");
        (self.event)(rail, RailEvent::Failed(resent, &why));
        self.use_.failed = Some(why);
        self.use_.retransmitted_bytes += resent;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvwire_transport::Tag;

    fn w(src: u64, dst: u64, len: u64) -> WriteOp {
        WriteOp { src_key: 1, src_offset: src, dst_key: 2, dst_offset: dst, len, stride: None }
    }

    #[test]
    fn cutting_keeps_every_byte_once_in_order_and_bounds_each_slice() {
        let t0 = Tag { slot: 3, layer: 0 };
        let t1 = Tag { slot: 3, layer: 1 };
        let batches = vec![
            Batch { tag: t0, writes: vec![w(0, 100, 10), w(50, 300, 25)] },
            Batch { tag: Tag { slot: 3, layer: 2 }, writes: vec![] },
            Batch { tag: t1, writes: vec![w(7, 0, 16)] },
        ];
        let slices = cut(batches, 16, |_| 0);
        type Runs = Vec<(u64, u64, u64)>;
        let got: Vec<(u16, Runs)> =
            slices.iter().map(|b| (b.tag.layer, b.writes.iter().map(|w| (w.src_offset, w.dst_offset, w.len)).collect())).collect();
        assert_eq!(
            got,
            vec![
                (0, vec![(0, 100, 10), (50, 300, 6)]),
                (0, vec![(56, 306, 16)]),
                (0, vec![(72, 322, 3)]),
                (1, vec![(7, 0, 16)]),
            ]
        );
        assert!(slices.iter().all(|b| b.bytes() <= 16));
    }

    #[test]
    fn a_slice_breaks_where_the_preferred_rails_change_not_the_rank() {
        // Writes to keys 10 and 11 (two ranks on the same rails) and 12
        // (a rank on other rails), alternating.
        let to = |key: u32, dst: u64| WriteOp { dst_key: key, ..w(dst, dst, 4) };
        let writes = vec![to(10, 0), to(11, 0), to(10, 4), to(12, 0), to(11, 4)];
        let prefers = |w: &WriteOp| if w.dst_key == 12 { 0b10 } else { 0b01 };
        let slices = cut(vec![Batch { tag: Tag { slot: 1, layer: 0 }, writes }], 1 << 20, prefers);
        let keys: Vec<Vec<u32>> = slices.iter().map(|b| b.writes.iter().map(|w| w.dst_key).collect()).collect();
        assert_eq!(keys, vec![vec![10, 11, 10], vec![12], vec![11]]);
    }
}
