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
    use kvwire_client::control::PrepareReceive;
    let dir = TempDir::new("hostile-prepared");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "[limits]\nmax_inflight_transfers = 2\n");
    let tokens = 20;
    let s = side(crate::daemons::DST, tokens);
    let prepare = |c: &Client, group: &str, request: &str| {
        c.prepare(PrepareReceive { group: group.into(), request: request.into(), block_table: s.block_table.clone(), tokens, prefix_tokens: 0 })
    };
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
fn prepared_receives_no_source_offered_into_expire_after_the_transfer_timeout() {
    use crate::daemons::{identity_of, register, side};
    use kvwire_client::control::{PrepareReceive, TransferState};
    let dir = TempDir::new("hostile-expire");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "[limits]\nmax_inflight_transfers = 1\ntransfer_timeout_secs = 1\npeer_timeout_secs = 1\n");
    let tokens = 20;
    let s = side(crate::daemons::DST, tokens);
    let c = Client::connect(&d.socket, "idle").unwrap();
    let _mem = register(&c, "g", crate::daemons::DST, &s, None, identity_of("toy-digest", "t1"));
    let prepare = |request: &str| c.prepare(PrepareReceive { group: "g".into(), request: request.into(), block_table: s.block_table.clone(), tokens, prefix_tokens: 0 });
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
    use kvwire_client::control::{FlagName, PrepareReceive};
    let dir = TempDir::new("hostile-wait");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "");
    let tokens = 20;
    let s = side(crate::daemons::DST, tokens);
    let c = Client::connect(&d.socket, "waiter").unwrap();
    let _mem = register(&c, "g", crate::daemons::DST, &s, None, identity_of("toy-digest", "t1"));
    let slot = c.prepare(PrepareReceive { group: "g".into(), request: "r".into(), block_table: s.block_table.clone(), tokens, prefix_tokens: 0 }).unwrap();
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

#[test]
fn writes_with_made_up_tags_are_refused_and_grow_nothing_and_the_tcp_hello_shows_no_addresses() {
    use crate::daemons::{identity_of, register, side};
    use kvwire_transport::tcp::{TcpEndpoint, TcpLimits};
    use kvwire_transport::{Batch, Endpoint, FlagTable, Hops, HostMem, Placement, Registry, Tag, WriteOp};
    use std::sync::Arc;
    let dir = TempDir::new("hostile-tags");
    let d = start_daemon(dir.path(), "h", SECRET, &[], "");
    let c = Client::connect(&d.socket, "victim").unwrap();
    let s = side(crate::daemons::DST, 20);
    let _mem = register(&c, "g", crate::daemons::DST, &s, None, identity_of("toy-digest", "t1"));
    // A rogue source with no secret: its own endpoint, straight to the data port.
    let placement = Arc::new(Placement::new(FlagTable::new(4, 4).unwrap(), Arc::new(Hops::default())));
    let rogue = TcpEndpoint::bind("rogue", "127.0.0.1:0".parse().unwrap(), Arc::new(Registry::new(4)), placement, TcpLimits::default()).unwrap();
    let src = rogue.register(Arc::new(HostMem::new("rogue", 4096).unwrap()), 0, 4096).unwrap();
    let mut conn = rogue.connect(&d.data).unwrap();
    let regions = conn.remote().regions.clone();
    assert!(!regions.is_empty());
    assert!(regions.iter().all(|r| r.addr == 0), "the tcp hello tells where memory lies: {regions:?}");
    let key = regions[0].key;
    let before = rss_kib(d.pid());
    // 20k one-byte writes, each under a tag no transfer declared.
    let mut refused = 0;
    for i in 0..20_000u32 {
        let tag = Tag { slot: (i % 256) as u16, layer: (i / 256 % 256) as u16 };
        let w = WriteOp { src_key: src.key, src_offset: 0, dst_key: key, dst_offset: u64::from(i % 64), len: 1 };
        conn.post(Batch { tag, writes: vec![w] }).unwrap();
        if i % 256 == 255 {
            while conn.pending() > 0 {
                refused += conn.poll(Duration::from_secs(5)).unwrap().iter().filter(|c| c.result.is_err()).count();
            }
        }
    }
    while conn.pending() > 0 {
        refused += conn.poll(Duration::from_secs(5)).unwrap().iter().filter(|c| c.result.is_err()).count();
    }
    assert_eq!(refused, 20_000, "every write under an undeclared tag is refused");
    let grown = rss_kib(d.pid()).saturating_sub(before);
    assert!(grown < 4096, "the daemon grew {grown} KiB for 20k refused writes");
    assert!(Client::connect(&d.socket, "still").is_ok());
}
