//! The peer session, stepped as a deterministic pair: a source session and a
//! destination session exchange messages through a simulated link, with
//! simulated time. The destination's "daemon" accepts every offer into
//! slot 7 and stages 4096 bytes; each test changes one thing.

use kvwire_core::layout::Tensor;
use kvwire_core::manifest::LayerChecksum;
use kvwire_core::protocol::TransportKind;
use kvwire_core::reuse::CacheIdentity;
use kvwire_core::session::msg::{Accept, Claim, Expect, LayerSums, ManifestWire, Offer, PeerMsg, RailAddr, RankRails};
use kvwire_core::session::{DestinationSession, DestinationStep, SessionError, SlotPhase, SourceEvent, SourcePhase, SourceSession, Timeouts, MAX_RAILS};
use std::time::{Duration, Instant};

const SLOT: u16 = 7;
const STAGE: u64 = 4096;

fn timeouts() -> Timeouts {
    Timeouts { reply: Duration::from_secs(5), peer: Duration::from_secs(2), transfer: Duration::from_secs(60) }
}

fn offer() -> Offer {
    Offer {
        dst_group: "decode".into(),
        dst_request: "r1".into(),
        src_request: "s1".into(),
        identity: CacheIdentity {
            model_digest: "m".into(),
            adapter_digest: String::new(),
            format: "bf16/v1".into(),
            tenant: "t".into(),
            rope: "theta=10000".into(),
            position_offset: 0,
        },
        tokens: 100,
        codec: None,
        src_layout: "tp=2".into(),
        src_num_blocks: 8,
        src_block_table: vec![0, 1],
    }
}

fn accept() -> Accept {
    Accept {
        slot: SLOT,
        layout: "tp=1".into(),
        format: "bf16/v1".into(),
        num_blocks: 8,
        block_table: vec![0, 1],
        prefix_tokens: 0,
        data_addr: "127.0.0.1:1".into(),
        transport: "tcp".into(),
        regions: vec![],
        rails: vec![RailAddr { name: "rail0".into(), addr: "127.0.0.1:1".into() }],
        locality: vec![RankRails { rank: 0, rails: vec!["rail0".into()], level: "same-numa".into() }],
        stage_key: 42,
        stage_len: STAGE,
    }
}

fn expect() -> Expect {
    Expect { slot: SLOT, manifest: ManifestWire::from_bytes(Vec::new()), layer_sums: false }
}

/// Both sides and the simulated clock.
struct Pair {
    now: Instant,
    src: SourceSession,
    dst: DestinationSession,
    /// The source's next message, not yet delivered.
    in_flight: Option<PeerMsg>,
}

impl Pair {
    fn new() -> Pair {
        let now = Instant::now();
        let (src, first) = SourceSession::start(now, offer(), TransportKind::Tcp, timeouts());
        Pair { now, src, dst: DestinationSession::new(now, "prefill", timeouts()), in_flight: Some(first) }
    }

    /// Delivers the source's message; the destination's default daemon
    /// answers it; the answer goes back to the source.
    fn step(&mut self, answer: impl FnOnce(&mut DestinationSession, DestinationStep) -> PeerMsg) -> Result<SourceEvent, SessionError> {
        let m = self.in_flight.take().expect("a message to deliver");
        let step = self.dst.handle(self.now, m);
        let reply = answer(&mut self.dst, step);
        self.src.handle(self.now, reply)
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
    }

    /// Delivers the source's message, which has no answer.
    fn deliver(&mut self) -> DestinationStep {
        let m = self.in_flight.take().expect("a message to deliver");
        self.dst.handle(self.now, m)
    }

    /// The destination's daemon ends the slot: the verdict it pushes, which
    /// the session then no longer holds.
    fn judge(&mut self, error: Option<&str>) -> PeerMsg {
        assert!(self.dst.judged(SLOT, error.map(String::from)), "the slot is the connection's");
        assert_eq!(self.dst.slot(SLOT), None);
        DestinationSession::verdict(SLOT, error.map(String::from))
    }

    /// Offer → accept → expect (not answered), with the default daemon.
    fn to_moving(&mut self) {
        assert!(matches!(self.step(default_daemon), Ok(SourceEvent::Accepted(_))));
        self.in_flight = Some(self.src.expect(self.now, expect(), STAGE).unwrap());
        assert!(matches!(self.deliver(), DestinationStep::Expect(_)));
    }
}

fn default_daemon(d: &mut DestinationSession, step: DestinationStep) -> PeerMsg {
    match step {
        DestinationStep::Offer(_) => d.accept(accept()),
        DestinationStep::Reply(m) | DestinationStep::Aborted { reply: m, .. } => m,
        step @ (DestinationStep::Expect(_) | DestinationStep::LayerSums(_) | DestinationStep::Ignore | DestinationStep::Claim(_)) => panic!("{step:?} has no answer"),
    }
}

#[test]
fn a_transfer_runs_offer_to_verdict_on_both_sides() {
    let mut p = Pair::new();
    assert!(matches!(p.step(default_daemon), Ok(SourceEvent::Accepted(a)) if a.slot == SLOT));
    assert_eq!((p.src.phase(), p.src.peer_slot(), p.dst.slot(SLOT)), (SourcePhase::Accepted, Some(SLOT), Some(SlotPhase::Accepted)));
    p.in_flight = Some(p.src.expect(p.now, expect(), STAGE).unwrap());
    // The writes follow the manifest at once: no answer is awaited.
    assert_eq!(p.src.phase(), SourcePhase::Moving);
    assert_eq!(p.deliver(), DestinationStep::Expect(Box::new(expect())));
    assert_eq!((p.src.phase(), p.dst.slot(SLOT)), (SourcePhase::Moving, Some(SlotPhase::Receiving)));
    // Pings every quarter of the peer timeout (2 s): none before 500 ms.
    p.advance(Duration::from_millis(499));
    assert_eq!(p.src.handle_timeout(p.now), Ok(None));
    p.advance(Duration::from_millis(1));
    p.in_flight = p.src.handle_timeout(p.now).unwrap();
    assert_eq!(p.in_flight, Some(PeerMsg::Ping));
    assert_eq!(p.step(default_daemon), Ok(SourceEvent::Alive));
    // Every write completed: nothing is sent, and the source waits for the
    // verdict, pinging as it did while moving.
    assert_eq!(p.src.moved(), Ok(false));
    assert_eq!(p.src.phase(), SourcePhase::Done);
    p.advance(Duration::from_millis(500));
    p.in_flight = p.src.handle_timeout(p.now).unwrap();
    assert_eq!(p.in_flight, Some(PeerMsg::Ping));
    assert_eq!(p.step(default_daemon), Ok(SourceEvent::Alive));
    // The destination published decoder_usable: its verdict, unasked.
    let verdict = p.judge(None);
    assert_eq!(verdict, PeerMsg::Verdict { slot: SLOT, error: None });
    assert_eq!(p.src.handle(p.now, verdict), Ok(SourceEvent::Closed));
    // Done: nothing more to ping for, nothing to abort.
    assert_eq!((p.src.phase(), p.src.abort("late"), p.src.poll_timeout()), (SourcePhase::Done, None, None));
    // The slot is gone on the destination: no timeout waits on it.
    assert_eq!(p.dst.poll_timeout(), p.now + timeouts().transfer);
    assert_eq!(p.dst.closed(), Vec::<u16>::new());
}

#[test]
fn a_destination_that_fails_the_transfer_gives_its_reason_in_its_verdict() {
    let mut p = Pair::new();
    p.to_moving();
    assert_eq!(p.src.moved(), Ok(false));
    let verdict = p.judge(Some("layer 3 checksum mismatch"));
    assert_eq!(p.src.handle(p.now, verdict), Err(SessionError::Rejected("layer 3 checksum mismatch".into())));
    assert_eq!(p.src.phase(), SourcePhase::Failed);
    assert_eq!(p.src.error(), Some(&SessionError::Rejected("layer 3 checksum mismatch".into())));
    // Nothing to abort: the destination decided.
    assert_eq!(p.src.abort("late"), None);
}

#[test]
fn a_verdict_before_the_last_completion_is_kept_for_moved_and_a_failing_one_ends_the_source_at_once() {
    // Landed before the source reaped its last completions (a ping's
    // exchange may read it): kept, and the pong still comes.
    let mut p = Pair::new();
    p.to_moving();
    let verdict = p.judge(None);
    assert_eq!(p.src.handle(p.now, verdict), Ok(SourceEvent::Judged));
    assert_eq!(p.src.phase(), SourcePhase::Moving);
    p.advance(Duration::from_millis(500));
    p.in_flight = p.src.handle_timeout(p.now).unwrap();
    assert_eq!(p.step(default_daemon), Ok(SourceEvent::Alive));
    assert_eq!(p.src.moved(), Ok(true));
    assert_eq!(p.src.abort("late"), None);

    // Failed while the writes still move: the source fails now, not when
    // its writes are done, and has nothing to abort.
    let mut p = Pair::new();
    p.to_moving();
    let verdict = p.judge(Some("checksum mismatch: dst rank 0 layer 1 tensor k chunk 0"));
    let why = SessionError::Rejected("checksum mismatch: dst rank 0 layer 1 tensor k chunk 0".into());
    assert_eq!(p.src.handle(p.now, verdict), Err(why.clone()));
    assert_eq!(p.src.moved(), Err(why));
    assert_eq!(p.src.abort("writes refused"), None);

    // A verdict for another slot, or before any accept, is out of turn.
    let mut p = Pair::new();
    assert!(matches!(p.src.handle(p.now, PeerMsg::Verdict { slot: SLOT, error: None }), Err(SessionError::Unexpected { .. })));
    let mut p = Pair::new();
    p.to_moving();
    assert!(matches!(p.src.handle(p.now, PeerMsg::Verdict { slot: SLOT + 1, error: None }), Err(SessionError::Unexpected { .. })));
}

#[test]
fn an_abort_that_crosses_the_verdict_is_answered_as_the_verdict_was() {
    for error in [None, Some("layer 2 checksum mismatch")] {
        let mut p = Pair::new();
        p.to_moving();
        // Both go at once: the destination's verdict, the source's abort.
        let verdict = p.judge(error);
        p.in_flight = p.src.abort("cancelled by client");
        assert!(matches!(p.in_flight, Some(PeerMsg::Abort { .. })));
        // The source reads the verdict first: not the abort's answer.
        assert_eq!(p.src.handle(p.now, verdict), Ok(SourceEvent::Judged));
        let answer = p.step(default_daemon);
        match error {
            None => assert_eq!(answer, Ok(SourceEvent::Closed)),
            Some(why) => assert_eq!(answer, Err(SessionError::Rejected(why.into()))),
        }
        // Asked once: a second abort of the slot is stale.
        assert!(matches!(p.dst.handle(p.now, PeerMsg::Abort { slot: SLOT, reason: "again".into() }), DestinationStep::Reply(PeerMsg::Refused { reason }) if reason.contains("not a transfer of this connection")));
    }
    // A verdict for a slot the connection no longer runs is not pushed.
    let mut p = Pair::new();
    p.to_moving();
    p.in_flight = p.src.abort("cancelled by client");
    assert!(matches!(p.deliver(), DestinationStep::Aborted { slot: SLOT, .. }));
    assert!(!p.dst.judged(SLOT, None));
}

#[test]
fn an_abort_answered_with_the_destinations_own_failure_names_it() {
    let mut p = Pair::new();
    p.to_moving();
    let abort = p.src.abort("rail0: peer refused a write: unknown or revoked remote key").unwrap();
    assert!(matches!(abort, PeerMsg::Abort { .. }));
    let got = p.src.handle(p.now, PeerMsg::Refused { reason: "checksum mismatch: dst rank 0 layer 2".into() });
    assert_eq!(got, Err(SessionError::Rejected("checksum mismatch: dst rank 0 layer 2".into())));
    // The first failure stays the session's: the local one.
    assert!(matches!(p.src.error(), Some(SessionError::Local(_))));
}

#[test]
fn a_refused_offer_fails_the_source_without_an_abort() {
    let mut p = Pair::new();
    let r = p.step(|d, _| d.refuse("request `r1` is not prepared".into()));
    assert_eq!(r, Err(SessionError::Refused("request `r1` is not prepared".into())));
    assert_eq!((p.src.phase(), p.dst.slot(SLOT)), (SourcePhase::Failed, None));
    // The destination took no slot, so there is nothing to abort.
    assert_eq!(p.src.abort("give up"), None);
    assert_eq!(p.src.error(), Some(&SessionError::Refused("request `r1` is not prepared".into())));
}

#[test]
fn a_manifest_that_fails_its_check_is_heard_in_the_verdict() {
    let mut p = Pair::new();
    p.to_moving();
    // A second manifest for the slot is ignored, not answered: the source
    // reads no answer to it.
    p.in_flight = Some(PeerMsg::Expect(expect()));
    assert_eq!(p.deliver(), DestinationStep::Ignore);
    assert_eq!(p.src.moved(), Ok(false));
    let verdict = p.judge(Some("manifest: model digest differs"));
    assert_eq!(p.src.handle(p.now, verdict), Err(SessionError::Rejected("manifest: model digest differs".into())));
    assert_eq!(p.src.abort("late"), None);
}

#[test]
fn a_staging_size_that_differs_from_the_schedule_aborts_the_slot() {
    let mut p = Pair::new();
    let r = p.step(|d, _| d.accept(Accept { stage_len: STAGE + 1, ..accept() }));
    assert!(matches!(r, Ok(SourceEvent::Accepted(_))));
    let r = p.src.expect(p.now, expect(), STAGE);
    assert_eq!(r, Err(SessionError::StagingSize { got: STAGE + 1, want: STAGE }));
    let abort = p.src.abort("staging size differs");
    assert_eq!(abort, Some(PeerMsg::Abort { slot: SLOT, reason: "staging size differs".into() }));
    p.in_flight = abort;
    let mut seen = None;
    assert_eq!(
        p.step(|d, s| {
            seen = Some(s.clone());
            default_daemon(d, s)
        }),
        Ok(SourceEvent::Closed)
    );
    assert_eq!(seen, Some(DestinationStep::Aborted { slot: SLOT, reason: "staging size differs".into(), reply: PeerMsg::Ok }));
    assert_eq!(p.dst.slot(SLOT), None);
}

#[test]
fn accepts_that_break_a_rule_are_refused_by_name() {
    let cases: Vec<(Accept, &str)> = vec![
        (Accept { transport: "shm".into(), ..accept() }, "peer speaks `shm`, this daemon `tcp`"),
        (
            Accept { rails: (0..MAX_RAILS + 6).map(|i| RailAddr { name: format!("r{i}"), addr: "127.0.0.1:1".into() }).collect(), locality: vec![], ..accept() },
            "70 rails, at most 64",
        ),
        (Accept { rails: vec![accept().rails[0].clone(), accept().rails[0].clone()], ..accept() }, "two rails share a name"),
        (
            Accept { locality: vec![RankRails { rank: 3, rails: vec!["nowhere".into()], level: "same-numa".into() }], ..accept() },
            "rank 3's preferred rails name a rail the accept does not list",
        ),
    ];
    for (a, why) in cases {
        let mut p = Pair::new();
        let r = p.step(move |d, _| d.accept(a));
        assert_eq!(r, Err(SessionError::BadAccept(why.into())));
        assert_eq!(p.src.phase(), SourcePhase::Failed);
        // The destination did take a slot: it is told.
        assert!(matches!(p.src.abort("bad accept"), Some(PeerMsg::Abort { slot: SLOT, .. })));
    }
}

#[test]
fn a_streaming_source_sends_each_layers_sums_after_the_manifest_and_only_then() {
    let sums = |layer: u16| vec![LayerChecksum { dst_rank: 0, layer: layer.into(), tensor: Tensor::K, chunk: 0, bytes: 64, xxh3: 7 }];
    let mut p = Pair::new();
    assert!(matches!(p.step(default_daemon), Ok(SourceEvent::Accepted(_))));
    // Before the manifest the source has nothing to vouch for.
    assert_eq!(p.src.layer_sums(0, sums(0)), Err(SessionError::OutOfOrder { step: "layer sums", phase: "planning" }));
    // A hostile source sending sums first: ignored, the slot stays waiting for its manifest.
    let early = PeerMsg::LayerSums(LayerSums { slot: SLOT, layer: 0, checksums: sums(0) });
    assert_eq!(p.dst.handle(p.now, early), DestinationStep::Ignore);
    assert_eq!(p.dst.slot(SLOT), Some(SlotPhase::Accepted));
    p.in_flight = Some(p.src.expect(p.now, Expect { layer_sums: true, ..expect() }, STAGE).unwrap());
    assert!(matches!(p.deliver(), DestinationStep::Expect(e) if e.layer_sums));
    for layer in 0..2 {
        p.in_flight = Some(p.src.layer_sums(layer, sums(layer)).unwrap());
        assert_eq!(p.deliver(), DestinationStep::LayerSums(Box::new(LayerSums { slot: SLOT, layer, checksums: sums(layer) })));
    }
    // Another connection's slot: ignored, never answered.
    let stray = PeerMsg::LayerSums(LayerSums { slot: SLOT + 1, layer: 0, checksums: sums(0) });
    assert_eq!(p.dst.handle(p.now, stray), DestinationStep::Ignore);
    assert_eq!(p.src.moved(), Ok(false));
    let verdict = p.judge(None);
    assert_eq!(p.src.handle(p.now, verdict), Ok(SourceEvent::Closed));
    // After its writes the source has no more sums to send, and the
    // destination, the slot gone, ignores late ones.
    assert_eq!(p.src.layer_sums(2, sums(2)), Err(SessionError::OutOfOrder { step: "layer sums", phase: "waiting for the verdict" }));
    assert_eq!(p.dst.handle(p.now, PeerMsg::LayerSums(LayerSums { slot: SLOT, layer: 2, checksums: sums(2) })), DestinationStep::Ignore);
}

#[test]
fn stale_and_out_of_order_messages_are_refused_without_touching_slots() {
    let now = Instant::now();
    let mut d = DestinationSession::new(now, "prefill", timeouts());
    let refused = |s: DestinationStep, needle: &str| match s {
        DestinationStep::Reply(PeerMsg::Refused { reason }) => assert!(reason.contains(needle), "{reason}"),
        other => panic!("expected a refusal containing {needle:?}, got {other:?}"),
    };
    // A manifest is never answered, stale or not.
    assert_eq!(d.handle(now, PeerMsg::Expect(expect())), DestinationStep::Ignore);
    refused(d.handle(now, PeerMsg::Verdict { slot: SLOT, error: None }), "unexpected verdict");
    refused(d.handle(now, PeerMsg::Abort { slot: 0xFFFF, reason: "x".into() }), "not a transfer of this connection");
    refused(d.handle(now, PeerMsg::Pong), "unexpected pong");
    assert!(!d.judged(SLOT, None), "no verdict for a slot the connection never ran");
    d.accept(accept());
    refused(d.handle(now, PeerMsg::Verdict { slot: SLOT, error: None }), "unexpected verdict");
    assert!(matches!(d.handle(now, PeerMsg::Expect(expect())), DestinationStep::Expect(_)));
    assert_eq!(d.handle(now, PeerMsg::Expect(expect())), DestinationStep::Ignore);
    assert_eq!(d.slot(SLOT), Some(SlotPhase::Receiving));
    assert_eq!(d.handle(now, PeerMsg::Ping), DestinationStep::Reply(PeerMsg::Pong));

    // On the source: a message its phase does not take ends it.
    let (mut s, _) = SourceSession::start(now, offer(), TransportKind::Tcp, timeouts());
    assert_eq!(s.handle(now, PeerMsg::Pong), Err(SessionError::Unexpected { phase: "waiting for accept", got: "pong" }));
    let (mut s, _) = SourceSession::start(now, offer(), TransportKind::Tcp, timeouts());
    assert_eq!(s.moved(), Err(SessionError::OutOfOrder { step: "moved", phase: "waiting for accept" }));
    assert_eq!(s.expect(now, expect(), 0), Err(SessionError::OutOfOrder { step: "expect", phase: "waiting for accept" }));
}

#[test]
fn a_late_accept_times_the_source_out_with_nothing_to_abort() {
    let mut p = Pair::new();
    assert_eq!(p.src.poll_timeout(), Some(p.now + Duration::from_secs(5)));
    p.advance(Duration::from_secs(5));
    assert_eq!(p.src.handle_timeout(p.now), Err(SessionError::TimedOut { phase: "waiting for accept", waited: Duration::from_secs(5) }));
    // No accept came, so the destination holds no slot to abort.
    assert_eq!(p.src.abort("timed out"), None);
    assert_eq!(p.src.poll_timeout(), None);
}

#[test]
fn the_transfer_deadline_ends_a_transfer_that_keeps_pinging() {
    let mut p = Pair::new();
    p.to_moving();
    let mut pings = 0;
    loop {
        let at = p.src.poll_timeout().unwrap();
        p.now = at;
        match p.src.handle_timeout(p.now) {
            Ok(Some(m)) => {
                p.in_flight = Some(m);
                assert_eq!(p.step(default_daemon), Ok(SourceEvent::Alive));
                pings += 1;
            }
            Ok(None) => {}
            Err(e) => {
                assert_eq!(e, SessionError::Deadline(Duration::from_secs(60)));
                break;
            }
        }
    }
    // 60 s at one ping per 500 ms, the last instant being the deadline itself.
    assert_eq!(pings, 119);
}

#[test]
fn a_silent_source_fails_every_receiving_slot_after_the_peer_timeout() {
    let mut p = Pair::new();
    p.to_moving();
    let heard = p.now;
    assert_eq!(p.dst.poll_timeout(), heard + Duration::from_secs(2));
    assert_eq!(p.dst.handle_timeout(heard + Duration::from_millis(1999)), None);
    let e = p.dst.handle_timeout(heard + Duration::from_secs(2)).unwrap();
    assert_eq!(e.to_string(), "silent for 2s while receiving");
    assert_eq!(p.dst.closed(), vec![SLOT]);
    assert_eq!(p.dst.slot(SLOT), None);
}

#[test]
fn a_closed_connection_returns_the_slots_still_running() {
    let mut p = Pair::new();
    p.step(default_daemon).unwrap();
    // Accepted but never expected: the reply timeout applies.
    assert_eq!(p.dst.poll_timeout(), p.now + Duration::from_secs(5));
    assert_eq!(p.dst.closed(), vec![SLOT]);
    assert_eq!(p.dst.closed(), Vec::<u16>::new());
    // An idle connection waits for the transfer timeout.
    assert_eq!(p.dst.poll_timeout(), p.now + Duration::from_secs(60));
}

/// A claimed transfer: the source starts accepted from the announcement,
/// its claim and manifest go out unanswered, and the destination enters
/// the slot when the daemon honours the claim.
#[test]
fn a_claimed_transfer_runs_with_no_answer_before_its_verdict() {
    let now = Instant::now();
    let (mut src, claim) = SourceSession::claim(now, accept(), 3, offer(), TransportKind::Tcp, timeouts()).unwrap();
    assert_eq!(claim, PeerMsg::Claim(Claim { slot: SLOT, gen: 3, offer: offer() }));
    assert_eq!((src.phase(), src.peer_slot()), (SourcePhase::Accepted, Some(SLOT)));
    let mut dst = DestinationSession::new(now, "prefill", timeouts());
    let DestinationStep::Claim(c) = dst.handle(now, claim.clone()) else { panic!("not a claim step") };
    assert_eq!((c.slot, c.gen), (SLOT, 3));
    dst.claimed(SLOT);
    assert_eq!(dst.slot(SLOT), Some(SlotPhase::Accepted));
    // A second claim of a slot the connection runs is refused, the slot untouched.
    assert!(matches!(dst.handle(now, claim), DestinationStep::Reply(PeerMsg::Refused { reason }) if reason.contains("runs already")));
    // The announced staging buffer is an upper bound: a schedule staging less fits.
    let e = src.expect(now, expect(), STAGE / 2).unwrap();
    assert!(matches!(dst.handle(now, e), DestinationStep::Expect(_)));
    assert_eq!((src.phase(), dst.slot(SLOT)), (SourcePhase::Moving, Some(SlotPhase::Receiving)));
    assert_eq!(src.moved(), Ok(false));
    assert!(dst.judged(SLOT, None));
    assert_eq!(src.handle(now, DestinationSession::verdict(SLOT, None)), Ok(SourceEvent::Closed));
}

#[test]
fn a_claim_staging_more_than_was_set_aside_or_refused_ends_without_an_abort() {
    let now = Instant::now();
    let (mut src, _) = SourceSession::claim(now, accept(), 1, offer(), TransportKind::Tcp, timeouts()).unwrap();
    assert_eq!(src.expect(now, expect(), STAGE + 1), Err(SessionError::StagingSize { got: STAGE, want: STAGE + 1 }));
    // The destination would not honour the claim: its refusal arrives
    // while the writes move, and it holds no slot to abort.
    let (mut src, _) = SourceSession::claim(now, accept(), 1, offer(), TransportKind::Tcp, timeouts()).unwrap();
    src.expect(now, expect(), STAGE).unwrap();
    let why = "claim of slot 7 (preparation 1), which is not announced to this connection now";
    assert_eq!(src.handle(now, PeerMsg::Refused { reason: why.into() }), Err(SessionError::Refused(why.into())));
    assert_eq!(src.abort("writes refused"), None);
    // An offered transfer still takes a refusal while moving as out of turn.
    let mut p = Pair::new();
    p.to_moving();
    assert!(matches!(p.src.handle(p.now, PeerMsg::Refused { reason: "x".into() }), Err(SessionError::Unexpected { .. })));
    // An announcement that breaks an accept's rules is refused as an accept would be.
    let mut bad = accept();
    bad.transport = "shm".into();
    assert!(matches!(SourceSession::claim(now, bad, 1, offer(), TransportKind::Tcp, timeouts()), Err(SessionError::BadAccept(_))));
}

#[test]
fn every_peer_message_reads_back_as_written_and_a_misplaced_or_unknown_tag_is_refused_by_name() {
    let sums = LayerSums { slot: SLOT, layer: 3, checksums: vec![LayerChecksum { dst_rank: 0, layer: 3, tensor: Tensor::V, chunk: 0, bytes: 96, xxh3: 7 }] };
    let announce = kvwire_core::session::msg::Announce { group: "decode".into(), request: "r1".into(), gen: 4, tokens: 100, identity: offer().identity, layer_bytes: vec![10, 20], accept: accept() };
    let all = [
        PeerMsg::Challenge { node: "b".into(), version: 6, nonce: "00".into() },
        PeerMsg::Auth { node: "a".into(), nonce: "01".into(), mac: "02".into() },
        PeerMsg::AuthOk { mac: "03".into() },
        PeerMsg::Refused { reason: "no \"such\" request".into() },
        PeerMsg::Offer(offer()),
        PeerMsg::Accept(accept()),
        PeerMsg::Expect(expect()),
        PeerMsg::LayerSums(sums),
        PeerMsg::Announce(announce),
        PeerMsg::Claim(Claim { slot: SLOT, gen: 4, offer: offer() }),
        PeerMsg::Ok,
        PeerMsg::Abort { slot: SLOT, reason: "cancelled".into() },
        PeerMsg::Ping,
        PeerMsg::Pong,
        PeerMsg::Verdict { slot: SLOT, error: None },
        PeerMsg::Verdict { slot: SLOT, error: Some("layer 1 checksum mismatch".into()) },
    ];
    for m in &all {
        let text = serde_json::to_string(m).unwrap();
        assert!(text.starts_with("{\"msg\":"), "{text}");
        assert_eq!(&serde_json::from_str::<PeerMsg>(&text).unwrap(), m, "{text}");
        // The binary form sealed connections carry: smaller, and the same message back.
        let bin = m.to_binary();
        assert!(bin.len() < text.len(), "{text}");
        assert_eq!(&PeerMsg::from_binary(&bin).unwrap(), m, "{text}");
        // Cut anywhere, or with a byte more, it is refused, never a panic.
        for cut in 0..bin.len() {
            assert!(PeerMsg::from_binary(&bin[..cut]).is_err(), "{text} cut at {cut}");
        }
        let mut longer = bin.clone();
        longer.push(0);
        assert_eq!(PeerMsg::from_binary(&longer).unwrap_err(), "malformed peer message: 1 bytes after it");
    }
    // A variant number past the last, and a length larger than what follows.
    assert!(PeerMsg::from_binary(&[15]).unwrap_err().starts_with("malformed peer message"));
    assert!(PeerMsg::from_binary(&[3, 0xff, 0xff, 0xff, 0xff, 0x0f, b'x']).is_err());
    let err = |text: &str| serde_json::from_str::<PeerMsg>(text).unwrap_err().to_string();
    assert!(err(r#"{"slot":7,"msg":"verdict"}"#).contains("first key must be `msg`"));
    assert!(err(r#"{"msg":"staging","key":9}"#).contains("unknown variant `staging`"));
    assert!(err(r#"{"msg":"verdict"}"#).contains("missing field `slot`"));
    assert!(err(r#"{"msg":"done","slot":3}"#).contains("unknown variant `done`"), "version 7's done is gone");
    assert!(err(r#"{"msg":"offer","slot":7}"#).contains("unknown field `slot`"), "the structs still deny unknown fields");
    assert!(err(r#"[1,2]"#).contains("first key is `msg`"));
    // Fields a message does not know are skipped where they were before (the tag-only messages, the unstructured ones).
    assert_eq!(serde_json::from_str::<PeerMsg>(r#"{"msg":"ping","extra":[1,{"a":2}]}"#).unwrap(), PeerMsg::Ping);
    assert_eq!(serde_json::from_str::<PeerMsg>(r#"{"msg":"verdict","slot":3,"why":"x"}"#).unwrap(), PeerMsg::Verdict { slot: 3, error: None });
    assert_eq!(serde_json::to_string(&PeerMsg::Verdict { slot: 3, error: None }).unwrap(), r#"{"msg":"verdict","slot":3}"#);
}
