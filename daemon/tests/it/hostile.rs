//! What an outsider or a misbehaving local client can do to one real
//! kvwired, and what it must not be able to: each test runs the daemon,
//! does the hostile thing, and judges the outcome (fds back to where they
//! were, the reason named, the next client served).

use kvwire_client::client::Client;
use kvwire_testkit::{start_daemon, TempDir};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use std::io::{IoSlice, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

const SECRET: &str = "a-secret-of-at-least-16-bytes";

/// Prepares request `request` of group `group` to receive `tokens` tokens
/// into the blocks of `s`.
fn prepare(c: &Client, s: &kvwire_core::plan::Side, tokens: u64, group: &str, request: &str) -> Result<u16, kvwire_client::client::ClientError> {
    use kvwire_client::control::PrepareReceive;
    c.prepare(PrepareReceive { group: group.into(), request: request.into(), block_table: s.block_table.clone(), tokens, prefix_tokens: 0, source: None })
}

/// An authenticated peer connection to the daemon at `peer` as node
/// `node`, answered once (the daemon serves it from there on), reads
/// bounded at 10 s; and its data-plane credential.
fn open_peer(peer: &str, node: &str) -> (kvwired::peer::Sealed, kvwire_transport::Credential) {
    use kvwire_core::session::msg::PeerMsg;
    let mut pc = std::net::TcpStream::connect(peer).unwrap();
    let (_, cred) = kvwired::peer::connect_auth(&mut pc, SECRET.as_bytes(), node).unwrap();
    let mut sealed = kvwired::peer::Sealed::new(pc, cred.clone(), true);
    sealed.send(&PeerMsg::Ping).unwrap();
    assert_eq!(sealed.recv().unwrap(), PeerMsg::Pong);
    sealed.stream().set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    (sealed, cred)
}

/// The offer a source holding `tokens` tokens of the test cache in the
/// `SRC` layout makes into request `request` of group `g`.
fn offer_into(request: &str, src_request: &str, id: &kvwire_core::reuse::CacheIdentity, tokens: u64) -> kvwire_core::session::msg::Offer {
    let src = crate::daemons::side(crate::daemons::SRC, tokens);
    kvwire_core::session::msg::Offer {
        dst_group: "g".into(),
        dst_request: request.into(),
        src_request: src_request.into(),
        identity: id.clone(),
        tokens,
        codec: None,
        src_layout: crate::daemons::SRC.into(),
        src_num_blocks: src.num_blocks,
        src_block_table: src.block_table,
    }
}

/// Open descriptors of process `pid`.
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// Waits (bounded) until `pid` holds `want` descriptors; returns the last count.
fn settle(pid: u32, want: usize) -> usize {
    let mut n = fds(pid);
    for _ in 0..200 {
        if n == want {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        n = fds(pid);
    }
    n
}

#[test]
fn a_control_message_with_too_many_fds_leaks_none_of_them() {
    let dir = TempDir::new("hostile-fds");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "");
    // A client connected first, so the count below is of a serving daemon.
    let c = Client::connect(&d.socket, "first").unwrap();
    let before = fds(d.pid());
    let files: Vec<std::fs::File> = (0..12).map(|_| std::fs::File::open("/dev/null").unwrap()).collect();
    let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
    for round in 0..5 {
        let s = UnixStream::connect(&d.socket).unwrap();
        let body = br#"{"op":"stats"}"#;
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(body);
        let iov = [IoSlice::new(&frame)];
        sendmsg::<()>(s.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&raw)], MsgFlags::empty(), None).unwrap();
        // The daemon answers with the reason (or closes), and drops them all.
        let mut len = [0u8; 4];
        let _ = (&s).read_exact(&mut len);
        let mut reply = vec![0u8; u32::from_le_bytes(len) as usize];
        let _ = (&s).read_exact(&mut reply);
        let reply = String::from_utf8_lossy(&reply).into_owned();
        assert!(reply.contains("descriptors"), "round {round}: {reply}");
    }
    // Every refused message's descriptors were closed; the connections too.
    let after = settle(d.pid(), before);
    assert_eq!(after, before, "descriptors held after refusing 5 messages of 12 fds");
    // And the daemon still serves.
    assert!(c.stats().unwrap().contains("kvwire_"));
    assert!(Client::connect(&d.socket, "next").is_ok());
}

#[test]
fn prepared_receives_go_with_their_client_and_free_their_slots() {
    use crate::daemons::{identity_of, register, side};
    let dir = TempDir::new("hostile-prepared");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "[limits]\nmax_inflight_transfers = 2\n");
    let tokens = 20;
    let s = side(crate::daemons::DST, tokens);
    let prepare = |c: &Client, group: &str, request: &str| prepare(c, &s, tokens, group, request);
    {
        let a = Client::connect(&d.socket, "greedy").unwrap();
        let _mem = register(&a, "ga", crate::daemons::DST, &s, None, identity_of("toy-digest", "t1"));
        prepare(&a, "ga", "r1").unwrap();
        prepare(&a, "ga", "r2").unwrap();
        let e = prepare(&a, "ga", "r3").unwrap_err();
        assert!(e.to_string().contains("max_inflight_transfers"), "{e}");
    }
    // The greedy client left: its prepared receives went with it.
    let b = Client::connect(&d.socket, "next").unwrap();
    let _mem = register(&b, "gb", crate::daemons::DST, &s, None, identity_of("toy-digest", "t1"));
    let mut served = false;
    for _ in 0..100 {
        if prepare(&b, "gb", "r1").is_ok() {
            served = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(served, "a new client could not prepare after the greedy one left");
}

#[test]
fn one_client_cannot_hold_more_prepared_receives_than_its_quota() {
    use crate::daemons::{identity_of, register, side};
    let dir = TempDir::new("hostile-quota");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "[limits]\nmax_inflight_transfers = 8\nmax_prepared_per_client = 3\n");
    let tokens = 20;
    let s = side(crate::daemons::DST, tokens);
    let prepare = |c: &Client, group: &str, request: &str| prepare(c, &s, tokens, group, request);
    let a = Client::connect(&d.socket, "greedy").unwrap();
    let _ma = register(&a, "ga", crate::daemons::DST, &s, None, identity_of("toy-digest", "t1"));
    let first = prepare(&a, "ga", "r1").unwrap();
    for r in ["r2", "r3"] {
        prepare(&a, "ga", r).unwrap();
    }
    let e = prepare(&a, "ga", "r4").unwrap_err();
    assert!(e.to_string().contains("limits.max_prepared_per_client 3"), "{e}");
    // Another client still gets slots.
    let b = Client::connect(&d.socket, "other").unwrap();
    let _mb = register(&b, "gb", crate::daemons::DST, &s, None, identity_of("toy-digest", "t1"));
    for r in ["r1", "r2", "r3"] {
        prepare(&b, "gb", r).unwrap();
    }
    // A cancelled receive gives the client its place back.
    a.cancel(first).unwrap();
    prepare(&a, "ga", "r4").unwrap();
}

/// A group belongs to the client that registered it: another client can
/// neither register its missing rank nor touch its transfers, unless the
/// group was shared under a token that client presented.
#[test]
fn a_group_is_joined_only_by_the_clients_it_was_shared_with() {
    use crate::daemons::{identity_of, side};
    use kvwire_client::control::{ModelSource, RegisterCache};
    use kvwire_transport::HostMem;
    let dir = TempDir::new("hostile-groups");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "");
    let s = side(crate::daemons::DST, 20);
    let m = crate::daemons::model();
    let reg = |c: &Client, group: &str, rank: u32| {
        let total: u64 = s.regions(&m, rank).iter().map(|(_, l)| l).sum();
        let mem = HostMem::new("rank", total).unwrap();
        let r = RegisterCache {
            group: group.into(),
            model: ModelSource::Toml(crate::daemons::MODEL.into()),
            format: "bf16".into(),
            layout: crate::daemons::DST.into(),
            rank,
            num_blocks: s.num_blocks,
            identity: identity_of("toy-digest", "t1"),
        };
        c.register(r, &mem).map(|(_, _, complete)| (complete, mem))
    };
    let (a, b, intruder) = (Client::connect(&d.socket, "rank0").unwrap(), Client::connect(&d.socket, "rank1").unwrap(), Client::connect(&d.socket, "other").unwrap());
    // Not shared: the missing rank of a's group is a's alone to register.
    let (_, _ma) = reg(&a, "private", 0).unwrap();
    let e = reg(&intruder, "private", 1).unwrap_err();
    assert!(e.to_string().contains("belongs to another client"), "{e}");
    // Nor can another client share it on a's behalf.
    let e = intruder.share_group("private", "a-token-of-16-bytes+").unwrap_err();
    assert!(e.to_string().contains("only it can share it"), "{e}");
    // Shared before anyone registers: each rank's client presents the token.
    let token = "engine-7f3a9c-tp2-shared-token";
    a.share_group("engine", token).unwrap();
    b.share_group("engine", token).unwrap();
    let e = intruder.share_group("engine", "a-guessed-token-of-some-length").unwrap_err();
    assert!(e.to_string().contains("another token"), "{e}");
    assert!(intruder.share_group("engine", "short").unwrap_err().to_string().contains("at least 16"));
    let (c0, _m0) = reg(&a, "engine", 0).unwrap();
    let e = reg(&intruder, "engine", 1).unwrap_err();
    assert!(e.to_string().contains("has not presented"), "{e}");
    let (c1, _m1) = reg(&b, "engine", 1).unwrap();
    assert!(!c0 && c1, "the second rank completes the shared group");
    // The intruder holds no rank: it can neither prepare on the group nor
    // cancel the receive its owners prepared.
    assert!(prepare(&intruder, &s, 20, "engine", "r").unwrap_err().to_string().contains("registered by another client"));
    let slot = prepare(&a, &s, 20, "engine", "r").unwrap();
    assert!(intruder.cancel(slot).is_err());
    assert_eq!(a.status(slot).unwrap().state, kvwire_client::control::TransferState::Prepared);
}

#[test]
fn prepared_receives_no_source_offered_into_expire_after_the_transfer_timeout() {
    use crate::daemons::{identity_of, register, side};
    use kvwire_client::control::TransferState;
    let dir = TempDir::new("hostile-expire");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "[limits]\nmax_inflight_transfers = 1\ntransfer_timeout_secs = 1\npeer_timeout_secs = 1\n");
    let tokens = 20;
    let s = side(crate::daemons::DST, tokens);
    let c = Client::connect(&d.socket, "idle").unwrap();
    let _mem = register(&c, "g", crate::daemons::DST, &s, None, identity_of("toy-digest", "t1"));
    let prepare = |request: &str| prepare(&c, &s, tokens, "g", request);
    let first = prepare("r1").unwrap();
    assert!(prepare("r2").is_err(), "the one slot is held");
    std::thread::sleep(Duration::from_millis(1500));
    // Past the timeout: the next allocation expires the stale one, by name.
    let second = prepare("r2").unwrap();
    // Unless its slot already serves the new receive, the old one says why it ended.
    if first != second {
        let st = c.status(first).unwrap();
        assert_eq!(st.state, TransferState::Failed, "{st:?}");
        assert!(st.error.as_deref().is_some_and(|e| e.contains("no source offered")), "{st:?}");
    }
}

/// A config for kvwired `node` whose control socket is `socket`.
fn config_at(dir: &TempDir, node: &str, socket: &std::path::Path) -> std::path::PathBuf {
    let secret = dir.write_private(format!("{node}.secret"), SECRET);
    dir.write(
        format!("{node}.toml"),
        format!("node = \"{node}\"\ncontrol_socket = {:?}\npeer_listen = \"127.0.0.1:0\"\nsecret_file = {:?}\n", socket.display().to_string(), secret.display().to_string()),
    )
}

/// Runs kvwired with its control socket at `socket`, expecting it to refuse
/// to start; returns what it printed.
fn refused_start(dir: &TempDir, socket: &std::path::Path) -> String {
    let cfg = config_at(dir, "r", socket);
    let out = std::process::Command::new(kvwire_testkit::kvwired_bin()).arg("--config").arg(&cfg).output().unwrap();
    assert!(!out.status.success(), "kvwired started on {}", socket.display());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_control_socket_in_use_or_not_a_socket_is_refused_and_left_alone() {
    let dir = TempDir::new("hostile-socket");
    let a = start_daemon(dir.path(), "a", SECRET, &[], "");
    // A second daemon pointed at a live daemon's socket.
    let e = refused_start(&dir, &a.socket);
    assert!(e.contains("control_socket") && e.contains("another kvwired is serving it"), "{e}");
    assert!(Client::connect(&a.socket, "still").is_ok(), "the live daemon lost its socket");
    // A regular file where the socket would go: refused, and not deleted.
    let file = dir.write("b.sock", "precious");
    let e = refused_start(&dir, &file);
    assert!(e.contains("not a socket"), "{e}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "precious");
}

#[test]
fn a_peer_claiming_a_malformed_node_name_is_refused_before_it_is_used() {
    use kvwire_client::wire::{read_msg, write_msg};
    use kvwire_core::session::msg::PeerMsg;
    let dir = TempDir::new("hostile-node");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "");
    for node in ["evil\nkvwired: forged line", &"x".repeat(1 << 16), "\u{1b}[31mred", ""] {
        let mut s = std::net::TcpStream::connect(&d.peer).unwrap();
        assert!(matches!(read_msg::<PeerMsg>(&mut s).unwrap(), PeerMsg::Challenge { .. }));
        write_msg(&mut s, &PeerMsg::Auth { node: node.into(), nonce: "00".repeat(32), mac: "00".repeat(32) }).unwrap();
        match read_msg::<PeerMsg>(&mut s) {
            Ok(PeerMsg::Refused { reason }) => assert!(!reason.contains(node) || node.is_empty(), "{reason}"),
            other => panic!("{other:?}"),
        }
    }
    assert!(Client::connect(&d.socket, "still").is_ok());
}

/// Before it proves the secret, a peer may send a few KiB per message: a
/// length past that is refused at once, before its body is waited for.
#[test]
fn the_peer_port_refuses_a_large_message_before_authentication() {
    use kvwire_client::wire::read_msg;
    use kvwire_core::session::msg::PeerMsg;
    use std::io::Write;
    let dir = TempDir::new("hostile-preauth");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "");
    let mut s = std::net::TcpStream::connect(&d.peer).unwrap();
    assert!(matches!(read_msg::<PeerMsg>(&mut s).unwrap(), PeerMsg::Challenge { .. }));
    s.write_all(&(16u32 << 20).to_le_bytes()).unwrap();
    // Well inside the handshake's 10 s deadline: the answer comes without the body.
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    match read_msg::<PeerMsg>(&mut s) {
        Ok(PeerMsg::Refused { reason }) => assert!(reason.contains("authentication failed"), "{reason}"),
        other => panic!("a 16 MiB pre-auth message was not refused at once: {other:?}"),
    }
    assert!(Client::connect(&d.socket, "still").is_ok());
}

#[test]
fn a_daemon_shutting_down_leaves_another_daemons_socket_alone() {
    use nix::sys::signal::{kill, Signal};
    let dir = TempDir::new("hostile-unlink");
    let mut a = start_daemon(dir.path(), "a", SECRET, &[], "");
    // Someone removes a's socket and another daemon takes the path.
    std::fs::remove_file(&a.socket).unwrap();
    let mut c = take_socket(&dir, &a.socket);
    kill(nix::unistd::Pid::from_raw(a.pid() as i32), Signal::SIGTERM).unwrap();
    let _ = a.child().wait();
    assert!(a.socket.exists(), "a unlinked a socket it no longer owned");
    assert!(Client::connect(&a.socket, "still").is_ok(), "the daemon now at that path lost its socket");
    let _ = c.kill();
    let _ = c.wait();
}

/// Starts a daemon whose control socket is `socket` (free now).
fn take_socket(dir: &TempDir, socket: &std::path::Path) -> std::process::Child {
    let cfg = config_at(dir, "c", socket);
    let mut child = std::process::Command::new(kvwire_testkit::kvwired_bin()).arg("--config").arg(&cfg).stdout(std::process::Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    assert!(line.starts_with("kvwired ready"), "{line}");
    child
}

#[test]
fn idle_metrics_connections_do_not_stall_a_scrape() {
    use std::io::Write;
    let dir = TempDir::new("hostile-metrics");
    let addr = kvwire_testkit::free_addr();
    let d = start_daemon(dir.path(), "h", SECRET, &[], &format!("metrics_listen = \"{addr}\"\n"));
    // Three connections that say nothing.
    let idle: Vec<std::net::TcpStream> = (0..3).map(|_| std::net::TcpStream::connect(&addr).unwrap()).collect();
    // A scraper that gives up after 1.5 s still gets its answer (one
    // connection at a time would have made it wait out every idle one).
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(1500))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    assert!(body.starts_with("HTTP/1.1 200") && body.contains("kvwire_"), "{body:.200}");
    drop(idle);
    assert!(Client::connect(&d.socket, "still").is_ok());
}

/// CPU seconds (user + system) process `pid` has used.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command (which may hold spaces) start after ") ".
    let rest = &stat[stat.rfind(") ").unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).unwrap().unwrap() as f64
}

#[test]
fn a_pending_wait_costs_the_daemon_no_cpu() {
    use crate::daemons::{identity_of, register, side};
    use kvwire_client::control::FlagName;
    let dir = TempDir::new("hostile-wait");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "");
    let tokens = 20;
    let s = side(crate::daemons::DST, tokens);
    let c = Client::connect(&d.socket, "waiter").unwrap();
    let _mem = register(&c, "g", crate::daemons::DST, &s, None, identity_of("toy-digest", "t1"));
    let slot = prepare(&c, &s, tokens, "g", "r").unwrap();
    let before = cpu_seconds(d.pid());
    let started = std::time::Instant::now();
    // A round-trip wait of 3 s that nobody ends: the daemon's thread waits on the flag.
    let r = c.call(&kvwire_client::control::Request::Wait { slot, flag: FlagName::DecoderUsable, timeout_ms: 3000 }, &[]);
    assert!(matches!(r, Err(kvwire_client::ClientError::Daemon { code: 301, .. })), "{r:?}");
    assert!(started.elapsed() >= Duration::from_secs(3), "the wait did not wait");
    let used = cpu_seconds(d.pid()) - before;
    // A poll loop cost ~12% of a core per wait (~0.36 s here); a sleep costs ~0.
    assert!(used < 0.15, "the daemon used {used:.2} s of CPU for a 3 s wait");
}

#[test]
fn a_client_past_the_client_limit_reads_why_and_the_next_one_is_served() {
    let dir = TempDir::new("hostile-clients");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "[limits]\nmax_clients = 2\n");
    let a = Client::connect(&d.socket, "a").unwrap();
    let b = Client::connect(&d.socket, "b").unwrap();
    for _ in 0..3 {
        match Client::connect(&d.socket, "third") {
            Err(kvwire_client::ClientError::Daemon { code: 108, message }) => assert!(message.contains("max_clients"), "{message}"),
            other => panic!("expected the limit by name, got {other:?}"),
        }
    }
    drop(a);
    let mut served = false;
    for _ in 0..100 {
        if Client::connect(&d.socket, "next").is_ok() {
            served = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(served, "a slot freed by a leaving client was not given to the next one");
    drop(b);
}

/// Resident set of process `pid`, KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Every byte of a side's memfds.
fn snapshot(s: &crate::daemons::Side_) -> Vec<Vec<u8>> {
    s.mems
        .iter()
        .map(|m| {
            let mut v = vec![0u8; m.len() as usize];
            m.read(0, &mut v).unwrap();
            v
        })
        .collect()
}

/// The data port to a party without a session: a challenge and then a
/// refusal, never a key, an address or a placed byte; and a thousand such
/// tries leave the daemon's memory and descriptors where they were.
#[test]
fn the_data_port_tells_an_outsider_nothing_and_places_no_byte() {
    use crate::daemons::{identity_of, register, side};
    use kvwire_core::protocol::{Header, Kind, Tag, HEADER_LEN};
    use kvwire_transport::tcp::{TcpEndpoint, TcpLimits};
    use kvwire_transport::{Credential, Endpoint, FlagTable, Hops, Placement, Registry};
    use std::io::Write;
    use std::sync::Arc;
    let dir = TempDir::new("hostile-data");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "");
    let c = Client::connect(&d.socket, "victim").unwrap();
    let s = side(crate::daemons::DST, 20);
    let victim = register(&c, "g", crate::daemons::DST, &s, None, identity_of("toy-digest", "t1"));
    let before_bytes = snapshot(&victim);
    let placement = Arc::new(Placement::new(FlagTable::new(4, 4).unwrap(), Arc::new(Hops::default())));
    let rogue = TcpEndpoint::bind("rogue", "127.0.0.1:0".parse().unwrap(), Arc::new(Registry::new(4)), placement, TcpLimits::default()).unwrap();
    // Warm up the daemon's accept path before the baseline.
    let _ = rogue.connect(&d.data, &Credential::random());
    let (fds0, rss0) = (fds(d.pid()), rss_kib(d.pid()));
    for i in 0..1000u32 {
        if i % 2 == 0 {
            // A made-up session, proven properly: refused by name.
            let e = rogue.connect(&d.data, &Credential::random()).err().expect("an unknown session connects");
            assert!(e.to_string().contains("not open here"), "{e}");
        } else {
            // A write in place of a hello, at a guessed key.
            let mut raw = std::net::TcpStream::connect(&d.data).unwrap();
            let mut b = [0u8; HEADER_LEN];
            raw.read_exact(&mut b).unwrap();
            assert_eq!(Header::decode(&b, 0).unwrap().kind, Kind::Challenge);
            let mut challenge = [0u8; 32];
            raw.read_exact(&mut challenge).unwrap();
            let w = Header { kind: Kind::Write, tag: Tag { slot: 0, layer: 0 }, key: i, seq: 1, offset: 0, len: 8 };
            let _ = raw.write_all(&w.encode()).and_then(|()| raw.write_all(b"intruder"));
            let mut rest = Vec::new();
            let _ = raw.read_to_end(&mut rest);
            assert!(rest.len() >= HEADER_LEN && Header::decode(&rest, 0).unwrap().kind == Kind::Nack, "no refusal: {} bytes", rest.len());
        }
    }
    assert_eq!(snapshot(&victim), before_bytes, "an outsider's byte landed in a registered cache");
    let fds1 = settle(d.pid(), fds0);
    assert!(fds1 <= fds0 + 2, "descriptors {fds0} -> {fds1} after 1000 refused connections");
    let grown = rss_kib(d.pid()).saturating_sub(rss0);
    assert!(grown < 8192, "the daemon grew {grown} KiB for 1000 refused connections");
    assert!(Client::connect(&d.socket, "still").is_ok());
}

/// A party holding the cluster secret gets a session for the life of its
/// peer connection, no more: its data connection sees no region (none was
/// granted to it), its writes land nowhere, an unsealed message on the
/// peer connection ends that connection, and the session ends with it.
#[test]
fn a_secret_holder_gets_a_session_and_nothing_it_was_not_granted() {
    use crate::daemons::{identity_of, register, side};
    use kvwire_core::session::msg::PeerMsg;
    use kvwire_transport::tcp::{TcpEndpoint, TcpLimits};
    use kvwire_transport::{Batch, Endpoint, FlagTable, Hops, HostMem, Placement, Registry, Tag, WriteOp};
    use std::sync::Arc;
    let dir = TempDir::new("hostile-holder");
    let d = kvwire_testkit::start_daemon_logged(dir.path(), "h", SECRET, &[], "");
    let c = Client::connect(&d.socket, "victim").unwrap();
    let s = side(crate::daemons::DST, 20);
    let victim = register(&c, "g", crate::daemons::DST, &s, None, identity_of("toy-digest", "t1"));
    let before_bytes = snapshot(&victim);
    let mut pc = std::net::TcpStream::connect(&d.peer).unwrap();
    let (name, cred) = kvwired::peer::connect_auth(&mut pc, SECRET.as_bytes(), "holder").unwrap();
    assert_eq!(name, "h");
    // One sealed exchange: the daemon has opened the session by its answer.
    let mut sealed = kvwired::peer::Sealed::new(pc.try_clone().unwrap(), cred.clone(), true);
    sealed.send(&PeerMsg::Ping).unwrap();
    assert_eq!(sealed.recv().unwrap(), PeerMsg::Pong);
    let placement = Arc::new(Placement::new(FlagTable::new(4, 4).unwrap(), Arc::new(Hops::default())));
    let ep = TcpEndpoint::bind("holder", "127.0.0.1:0".parse().unwrap(), Arc::new(Registry::new(4)), placement.clone(), TcpLimits::default()).unwrap();
    let src = ep.register(Arc::new(HostMem::new("holder", 4096).unwrap()), 0, 4096, None).unwrap();
    // Its own session, but under another node's name: refused.
    let other = TcpEndpoint::bind("someone-else", "127.0.0.1:0".parse().unwrap(), Arc::new(Registry::new(4)), placement, TcpLimits::default()).unwrap();
    let e = other.connect(&d.data, &cred).err().expect("a session proven under another name");
    assert!(e.to_string().contains("belongs to `holder`"), "{e}");
    let mut conn = ep.connect(&d.data, &cred).unwrap();
    assert!(conn.remote().regions.is_empty(), "the hello lists regions: {:?}", conn.remote().regions);
    // Guessed keys, every slot: all refused, nothing placed.
    for i in 0..64u32 {
        let key = u32::from_le_bytes(kvwire_transport::auth::random_bytes());
        let w = WriteOp { src_key: src.key, src_offset: 0, dst_key: key, dst_offset: 0, len: 64, stride: None };
        conn.post(Batch { tag: Tag { slot: i as u16, layer: 0 }, writes: vec![w] }).unwrap();
    }
    let mut refused = 0;
    while conn.pending() > 0 {
        refused += conn.poll(Duration::from_secs(5)).unwrap().iter().filter(|c| c.result.is_err()).count();
    }
    assert_eq!(refused, 64);
    assert_eq!(snapshot(&victim), before_bytes);
    // Counted by reason; logged a few whole, not a line each, and the next
    // line logged says how many were held back.
    let stats = c.stats().unwrap();
    let by = |reason: &str| kvwire_testkit::counter(&stats, "kvwire_writes_refused_total", "h", &format!("reason=\"{reason}\""));
    assert_eq!(by("unknown_key") + by("not_granted"), 64, "{stats}");
    assert_eq!(by("out_of_bounds"), 0);
    let parsed = kvwire_client::promtext::Stats::from_text(&stats).unwrap();
    assert_eq!(parsed.writes_refused.iter().map(|r| r.count).sum::<u64>(), 64);
    std::thread::sleep(Duration::from_millis(1100));
    let w = WriteOp { src_key: src.key, src_offset: 0, dst_key: 0, dst_offset: 0, len: 64, stride: None };
    conn.post(Batch { tag: Tag { slot: 0, layer: 0 }, writes: vec![w] }).unwrap();
    assert!(conn.poll(Duration::from_secs(5)).unwrap()[0].result.is_err());
    drop(conn);
    let (whole, held) = logged(&d.log_text(), "write refused");
    assert_eq!(whole + held, 65, "{}", d.log_text());
    assert!(whole <= 12, "{whole} refusals logged whole: {}", d.log_text());
    // A message after the handshake with a seal that is not one: the
    // daemon hangs up without answering.
    let mut forged = kvwire_client::wire::frame(&PeerMsg::Ping);
    forged.extend_from_slice(&[0u8; kvwired::peer::SEAL_LEN]);
    drop(sealed);
    std::io::Write::write_all(&mut pc, &forged).unwrap();
    pc.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut rest = Vec::new();
    pc.read_to_end(&mut rest).expect("the daemon hangs up");
    assert!(rest.is_empty(), "the daemon answered a forged message");
    // With its peer connection gone, the session proves nothing.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match ep.connect(&d.data, &cred) {
            Err(e) if e.to_string().contains("not open here") => break,
            Err(e) => panic!("{e}"),
            Ok(_) => assert!(std::time::Instant::now() < deadline, "the session outlived its peer connection"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(Client::connect(&d.socket, "still").is_ok());
}

/// Lines of `log` with `what`, and the events they say were held back.
fn logged(log: &str, what: &str) -> (u64, u64) {
    assert!(!log.contains('\u{1b}'), "colour codes in a log that is not a terminal: {log}");
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(what)).collect();
    // A line with nothing held back before it has no such field.
    let held = lines.iter().filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("held_back="))).map(|n| n.parse::<u64>().expect("held_back=N")).sum();
    (lines.len() as u64, held)
}

/// Anyone can connect to the peer and data ports and hang up: each such
/// connection is counted, but only a few a second are logged, so an
/// outsider cannot flood the daemon's log.
#[test]
fn refused_connections_are_counted_and_cannot_flood_the_log() {
    let dir = TempDir::new("hostile-flood");
    let d = kvwire_testkit::start_daemon_logged(dir.path(), "f", SECRET, &[], "");
    let c = Client::connect(&d.socket, "watcher").unwrap();
    let refused = |who: &str| kvwire_testkit::counter(&c.stats().unwrap(), "kvwire_refused_total", "f", &format!("who=\"{who}\""));
    let (peer0, data0) = (refused("peer"), refused("data"));
    for _ in 0..40 {
        drop(std::net::TcpStream::connect(&d.peer).unwrap());
        drop(std::net::TcpStream::connect(&d.data).unwrap());
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while refused("peer") < peer0 + 40 || refused("data") < data0 + 40 {
        assert!(std::time::Instant::now() < deadline, "peer {} data {}", refused("peer"), refused("data"));
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!((refused("peer"), refused("data")), (peer0 + 40, data0 + 40));
    let log = d.log_text();
    let (peer_lines, _) = logged(&log, "peer refused");
    let (data_lines, _) = logged(&log, "tcp peer connection closed");
    assert!((1..=12).contains(&peer_lines) && (1..=12).contains(&data_lines), "{peer_lines} and {data_lines} lines for 40 refusals each: {log}");
    // The ports still serve.
    assert!(Client::connect(&d.socket, "next").is_ok());
    drop(std::net::TcpStream::connect(&d.peer).unwrap());
}

/// Connections still in their handshake are capped on the peer port and
/// on the data port: one past the cap is closed before it gets a
/// challenge, and their places come back when they go.
#[test]
fn the_peer_and_data_ports_cap_connections_still_in_their_handshake() {
    use std::net::TcpStream;
    let dir = TempDir::new("hostile-caps");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "");
    for port in [&d.peer, &d.data] {
        let held: Vec<TcpStream> = (0..16).map(|_| TcpStream::connect(port).unwrap()).collect();
        for mut s in &held {
            let mut b = [0u8; 1];
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.read_exact(&mut b).unwrap();
        }
        let mut past = TcpStream::connect(port).unwrap();
        past.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = Vec::new();
        let _ = past.read_to_end(&mut got);
        assert!(got.is_empty(), "{port}: a connection past the cap got {} bytes", got.len());
        drop(held);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let mut again = TcpStream::connect(port).unwrap();
            again.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
            let mut b = [0u8; 1];
            if again.read_exact(&mut b).is_ok() {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{port}: places never came back");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    assert!(Client::connect(&d.socket, "still").is_ok());
}

/// An announcement goes only to the node the prepare names, on one of its
/// idle connections. Any connection of that node may claim it (its keys
/// are the node's), in that preparation, for that request, with an offer
/// that fits; another node may neither claim it nor write into it. Each
/// other claim is refused by name and leaves the receive as it was; a
/// claim that does not fit fails it, with why. The claim stands when the
/// connection it was announced on goes; once the node's last connection
/// goes, the announcement is withdrawn, and a reconnected node cannot
/// claim it.
#[test]
fn an_announcement_is_claimed_only_by_its_node_for_its_request() {
    use crate::daemons::{identity_of, register, side};
    use kvwire_client::control::{PrepareReceive, TransferState};
    use kvwire_core::session::msg::{Claim, Offer, PeerMsg};
    use kvwire_transport::tcp::{TcpEndpoint, TcpLimits};
    use kvwire_transport::{Batch, Credential, Endpoint, FlagTable, Hops, HostMem, Placement, Registry, Tag, WriteOp};
    use kvwired::peer::Sealed;
    use std::sync::Arc;
    let dir = TempDir::new("hostile-claim");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "");
    let c = Client::connect(&d.socket, "victim").unwrap();
    let tokens = 20;
    let s = side(crate::daemons::DST, tokens);
    let id = identity_of("toy-digest", "t1");
    let victim = register(&c, "g", crate::daemons::DST, &s, None, id.clone());
    let before = snapshot(&victim);
    let ((mut one, one_cred), (mut two, _), (mut other, other_cred)) = (open_peer(&d.peer, "holder"), open_peer(&d.peer, "holder"), open_peer(&d.peer, "bystander"));
    let prep = |request: &str| PrepareReceive { group: "g".into(), request: request.into(), block_table: s.block_table.clone(), tokens, prefix_tokens: 0, source: Some("holder".into()) };
    let (slot, told) = c.prepare_announced(prep("r")).unwrap();
    assert_eq!(told, Some(Ok(())));
    // On the newest idle connection of the node named, and on no other.
    let PeerMsg::Announce(ann) = two.recv().unwrap() else { panic!("no announcement") };
    assert_eq!((ann.accept.slot, ann.request.as_str(), ann.tokens), (slot, "r", tokens));
    for c in [&one, &other] {
        assert_eq!(c.pending().unwrap(), false, "an announcement on another connection");
    }
    assert!(ann.accept.stage_len > 0, "this remap stages: {ann:?}");
    // One 64-byte write into a staging buffer over a data connection
    // proving `cred`'s session: its answer, refused or not.
    let write_stage = |node: &str, cred: &Credential, slot: u16, key: u32| -> Result<(), String> {
        let placement = Arc::new(Placement::new(FlagTable::new(4, 4).unwrap(), Arc::new(Hops::default())));
        let ep = TcpEndpoint::bind(node, "127.0.0.1:0".parse().unwrap(), Arc::new(Registry::new(4)), placement, TcpLimits::default()).unwrap();
        let src = ep.register(Arc::new(HostMem::new(node, 4096).unwrap()), 0, 4096, None).unwrap();
        let mut data = ep.connect(&d.data, cred).unwrap();
        let w = WriteOp { src_key: src.key, src_offset: 0, dst_key: key, dst_offset: 0, len: 64, stride: None };
        data.post(Batch { tag: Tag { slot, layer: 0 }, writes: vec![w] }).unwrap();
        let done = data.poll(Duration::from_secs(5)).unwrap();
        done.into_iter().next().expect("an answer").result.map_err(|e| e.to_string())
    };
    // Another node writes nothing into it; a connection of the node it was
    // announced to, other than the one it went on, may.
    let not_granted = write_stage("bystander", &other_cred, slot, ann.accept.stage_key).unwrap_err();
    assert!(not_granted.contains("not open to this connection's node"), "{not_granted}");
    assert_eq!(write_stage("holder", &one_cred, slot, ann.accept.stage_key), Ok(()));
    let offer = offer_into("r", "x", &id, tokens);
    let claim = |gen: u64, o: &Offer| PeerMsg::Claim(Claim { slot, gen, offer: o.clone() });
    let refused = |c: &mut Sealed, m: PeerMsg, why: &str| {
        c.send(&m).unwrap();
        match c.recv().unwrap() {
            PeerMsg::Refused { reason } => assert!(reason.contains(why), "{reason}"),
            m => panic!("{m:?}"),
        }
    };
    // Another node, an earlier preparation, another request: refused, the
    // receive untouched.
    refused(&mut other, claim(ann.gen, &offer), "not announced to `bystander`");
    refused(&mut one, claim(ann.gen - 1, &offer), "not announced to `holder`");
    refused(&mut two, claim(ann.gen - 1, &offer), "not announced to `holder`");
    refused(&mut one, claim(ann.gen, &Offer { dst_request: "q".into(), ..offer.clone() }), "names request `q`");
    assert_eq!(c.status(slot).unwrap().state, TransferState::Prepared);
    // A coded claim (a coded transfer must offer): refused, and the receive fails.
    refused(&mut one, claim(ann.gen, &Offer { codec: Some("fp8".into()), ..offer.clone() }), "no codec");
    assert_eq!(c.status(slot).unwrap().state, TransferState::Failed);
    // A cache that is not the one this side holds, claimed on the node's
    // other connection: refused by field, and the receive fails with it.
    let (slot, told) = c.prepare_announced(prep("r2")).unwrap();
    assert_eq!(told, Some(Ok(())));
    let PeerMsg::Announce(ann) = two.recv().unwrap() else { panic!("no announcement") };
    let wrong = Offer { dst_request: "r2".into(), identity: identity_of("another-digest", "t1"), ..offer.clone() };
    let m = PeerMsg::Claim(Claim { slot, gen: ann.gen, offer: wrong });
    refused(&mut one, m, "model digest mismatch");
    let st = c.status(slot).unwrap();
    assert_eq!(st.state, TransferState::Failed);
    assert!(st.error.as_deref().unwrap_or("").contains("refused the claim of `holder`"), "{st:?}");

    // Claimed on the node's other connection (unanswered): it runs there,
    // and goes on running when the connection it was announced on goes.
    let (slot, told) = c.prepare_announced(prep("r3")).unwrap();
    assert_eq!(told, Some(Ok(())));
    let PeerMsg::Announce(ann) = two.recv().unwrap() else { panic!("no announcement") };
    one.send(&PeerMsg::Claim(Claim { slot, gen: ann.gen, offer: offer_into("r3", "r3-src", &id, tokens) })).unwrap();
    one.send(&PeerMsg::Ping).unwrap();
    assert_eq!(one.recv().unwrap(), PeerMsg::Pong, "a claim is not answered");
    assert_eq!(c.status(slot).unwrap().state, TransferState::Running);
    drop(two);
    one.send(&PeerMsg::Ping).unwrap();
    assert_eq!(one.recv().unwrap(), PeerMsg::Pong);
    assert_eq!(write_stage("holder", &one_cred, slot, ann.accept.stage_key), Ok(()));
    assert_eq!(c.status(slot).unwrap().state, TransferState::Running);
    one.send(&PeerMsg::Abort { slot, reason: "done here".into() }).unwrap();
    assert_eq!(one.recv().unwrap(), PeerMsg::Ok);

    // Announced on the node's last connection, which goes: withdrawn. The
    // node back on a new connection cannot claim it, nor write into it.
    let (slot, told) = c.prepare_announced(prep("r4")).unwrap();
    assert_eq!(told, Some(Ok(())));
    let PeerMsg::Announce(ann) = one.recv().unwrap() else { panic!("no announcement") };
    drop(one);
    // Once its session is closed (a data connection proving it is refused),
    // the node had none left: one opened now is the node anew.
    let placement = Arc::new(Placement::new(FlagTable::new(4, 4).unwrap(), Arc::new(Hops::default())));
    let probe = TcpEndpoint::bind("holder", "127.0.0.1:0".parse().unwrap(), Arc::new(Registry::new(4)), placement, TcpLimits::default()).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while probe.connect(&d.data, &one_cred).is_ok() {
        assert!(std::time::Instant::now() < deadline, "the session outlived its connection");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (mut back, back_cred) = open_peer(&d.peer, "holder");
    refused(&mut back, PeerMsg::Claim(Claim { slot, gen: ann.gen, offer: offer_into("r4", "r4-src", &id, tokens) }), "not announced to `holder`");
    back.send(&PeerMsg::Ping).unwrap();
    assert_eq!(back.recv().unwrap(), PeerMsg::Pong);
    assert!(write_stage("holder", &back_cred, slot, ann.accept.stage_key).is_err_and(|e| e.contains("unknown or revoked remote key")));
    assert_eq!(c.status(slot).unwrap().state, TransferState::Prepared, "withdrawn, it waits for an offer");
    assert_eq!(snapshot(&victim), before);
    drop(other);
    assert!(Client::connect(&d.socket, "still").is_ok());
}

/// Unanswered `notify` samples, as a client of any age sends them: a quiet
/// batch is never answered (one over the limit is dropped whole, still
/// unanswered), the answered kind still is, and every reply that comes
/// belongs to the call it answers.
#[test]
fn quiet_notify_samples_are_never_answered_and_never_desync_replies() {
    let dir = TempDir::new("hostile-notify");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "");
    let s = UnixStream::connect(&d.socket).unwrap();
    let send = |body: &str| {
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(body.as_bytes());
        sendmsg::<()>(s.as_raw_fd(), &[IoSlice::new(&frame)], &[], MsgFlags::empty(), None).unwrap();
    };
    let reply = || {
        let mut len = [0u8; 4];
        (&s).read_exact(&mut len).unwrap();
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        (&s).read_exact(&mut body).unwrap();
        String::from_utf8(body).unwrap()
    };
    send(r#"{"op":"hello","client":"old-and-new"}"#);
    let hello = reply();
    assert!(hello.contains(r#""quiet_notify":true"#), "{hello}");
    let samples = |n: usize| (0..n).map(|i| (1000 + i).to_string()).collect::<Vec<_>>().join(",");
    send(&format!(r#"{{"op":"notified_quiet","notify_ns":[{}]}}"#, samples(1025)));
    send(&format!(r#"{{"op":"notified_quiet","notify_ns":[{}]}}"#, samples(2)));
    send(&format!(r#"{{"op":"notified","notify_ns":[{}]}}"#, samples(1)));
    assert_eq!(reply(), r#"{"reply":"recorded"}"#);
    send(r#"{"op":"stats"}"#);
    let stats = reply();
    let st = kvwire_client::promtext::Stats::from_text(serde_json::from_str::<serde_json::Value>(&stats).unwrap()["text"].as_str().unwrap()).unwrap();
    assert_eq!(st.hops.iter().find(|h| h.hop == "notify").unwrap().count, 3, "the two quiet samples and the answered one; the oversized batch dropped");
}

/// A small receive lands on the threads its events come on, with no
/// receive thread to time it out or give its staging buffer back: a
/// claimed one whose manifest never comes fails at the transfer timeout
/// by name, one whose manifest is refused fails at once by name, and one
/// its source aborts fails with the source's reason. Each time the
/// staging buffer's key is revoked (a write there is refused), and the
/// bytes already in the cache stay as they were.
#[test]
fn a_small_receive_with_no_receive_thread_still_fails_by_name_and_gives_its_staging_back() {
    use crate::daemons::{identity_of, register, side};
    use kvwire_client::control::{PrepareReceive, TransferState};
    use kvwire_core::session::msg::{Claim, Expect, ManifestWire, PeerMsg};
    use kvwire_transport::tcp::{TcpEndpoint, TcpLimits};
    use kvwire_transport::{Batch, Endpoint, FlagTable, Hops, HostMem, Placement, Registry, Tag, WriteOp};
    use kvwired::peer::Sealed;
    use std::sync::Arc;
    use std::time::Instant;
    let dir = TempDir::new("hostile-landing");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "[limits]\ntransfer_timeout_secs = 2\npeer_timeout_secs = 2\n");
    let c = Client::connect(&d.socket, "victim").unwrap();
    let tokens = 20;
    let s = side(crate::daemons::DST, tokens);
    let id = identity_of("toy-digest", "t1");
    let victim = register(&c, "g", crate::daemons::DST, &s, None, id.clone());
    let before = snapshot(&victim);
    let (mut peer, cred) = open_peer(&d.peer, "holder");
    let placement = Arc::new(Placement::new(FlagTable::new(4, 4).unwrap(), Arc::new(Hops::default())));
    let ep = TcpEndpoint::bind("holder", "127.0.0.1:0".parse().unwrap(), Arc::new(Registry::new(4)), placement, TcpLimits::default()).unwrap();
    let src = ep.register(Arc::new(HostMem::new("holder", 4096).unwrap()), 0, 4096, None).unwrap();
    let mut data = ep.connect(&d.data, &cred).unwrap();
    // One 64-byte write into the staging buffer: its answer, refused or not.
    let mut write_stage = |slot: u16, key: u32| -> Result<(), String> {
        let w = WriteOp { src_key: src.key, src_offset: 0, dst_key: key, dst_offset: 0, len: 64, stride: None };
        data.post(Batch { tag: Tag { slot, layer: 0 }, writes: vec![w] }).unwrap();
        let done = data.poll(Duration::from_secs(5)).unwrap();
        done.into_iter().next().expect("an answer").result.map_err(|e| e.to_string())
    };
    // Claimed (unanswered), with its staging buffer live: a write there lands.
    let claimed = |peer: &mut Sealed, request: &str| {
        let prep = PrepareReceive { group: "g".into(), request: request.into(), block_table: s.block_table.clone(), tokens, prefix_tokens: 0, source: Some("holder".into()) };
        let (slot, told) = c.prepare_announced(prep).unwrap();
        assert_eq!(told, Some(Ok(())));
        let PeerMsg::Announce(ann) = peer.recv().unwrap() else { panic!("no announcement") };
        assert!(ann.accept.stage_len > 0, "this remap stages: {ann:?}");
        peer.send(&PeerMsg::Claim(Claim { slot, gen: ann.gen, offer: offer_into(request, &format!("{request}-src"), &id, tokens) })).unwrap();
        (slot, ann.accept.stage_key)
    };
    // Waits (bounded) for the receive to fail; its error.
    let failed = |slot: u16, within: Duration| -> String {
        let deadline = Instant::now() + within;
        loop {
            let st = c.status(slot).unwrap();
            if st.state == TransferState::Failed {
                return st.error.unwrap_or_default();
            }
            // Prepared until the connection's thread reads the claim.
            assert!(matches!(st.state, TransferState::Prepared | TransferState::Running), "{st:?}");
            assert!(Instant::now() < deadline, "slot {slot} still running: {st:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let revoked = |r: Result<(), String>| r.is_err_and(|e| e.contains("unknown or revoked remote key"));

    // No manifest: failed at the transfer timeout (pings keep the source
    // alive meanwhile, so only the landing's own deadline can end it).
    let (slot, stage) = claimed(&mut peer, "r1");
    assert_eq!(write_stage(slot, stage), Ok(()));
    let claimed_at = Instant::now();
    // Its verdict comes unasked, between the pongs, naming the reason.
    let why = loop {
        peer.send(&PeerMsg::Ping).unwrap();
        match peer.recv().unwrap() {
            PeerMsg::Pong => {}
            PeerMsg::Verdict { slot: s, error: Some(why) } if s == slot => {
                assert_eq!(peer.recv().unwrap(), PeerMsg::Pong);
                break why;
            }
            other => panic!("{other:?}"),
        }
        assert!(claimed_at.elapsed() < Duration::from_secs(10), "never failed: {:?}", c.status(slot).unwrap());
        std::thread::sleep(Duration::from_millis(200));
    };
    let st = c.status(slot).unwrap();
    assert_eq!((st.state, st.error.as_deref()), (TransferState::Failed, Some(why.as_str())));
    assert!(why.contains("no manifest within 2s of the accept"), "{why}");
    assert!(claimed_at.elapsed() >= Duration::from_millis(1500), "failed after {:?}", claimed_at.elapsed());
    assert!(revoked(write_stage(slot, stage)), "the staging buffer outlived its failed receive");

    // A manifest that is not one: refused at once, by name.
    let (slot, stage) = claimed(&mut peer, "r2");
    assert_eq!(write_stage(slot, stage), Ok(()));
    peer.send(&PeerMsg::Expect(Expect { slot, manifest: ManifestWire::from_bytes(b"not a manifest".to_vec()), layer_sums: false })).unwrap();
    let why = failed(slot, Duration::from_secs(1));
    assert!(why.starts_with("manifest:"), "{why}");
    assert_eq!(peer.recv().unwrap(), PeerMsg::Verdict { slot, error: Some(why) });
    assert!(revoked(write_stage(slot, stage)), "the staging buffer outlived its refused manifest");

    // Aborted by its source: failed with the source's reason, and the
    // staging buffer goes back within a tick or so.
    let (slot, stage) = claimed(&mut peer, "r3");
    assert_eq!(write_stage(slot, stage), Ok(()));
    peer.send(&PeerMsg::Abort { slot, reason: "engine gone".into() }).unwrap();
    let why = failed(slot, Duration::from_secs(1));
    assert!(why.contains("source aborted: engine gone"), "{why}");
    // The abort is answered, and no verdict follows: the slot was no
    // longer the connection's.
    assert_eq!(peer.recv().unwrap(), PeerMsg::Ok);
    peer.send(&PeerMsg::Ping).unwrap();
    assert_eq!(peer.recv().unwrap(), PeerMsg::Pong);
    let deadline = Instant::now() + Duration::from_secs(2);
    while !revoked(write_stage(slot, stage)) {
        assert!(Instant::now() < deadline, "the staging buffer outlived its aborted receive");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(snapshot(&victim), before);
    assert!(Client::connect(&d.socket, "still").is_ok());
}
