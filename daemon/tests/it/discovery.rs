//! Discovery through a real etcd (Debian's etcd-server, /usr/bin/etcd): each
//! test starts its own etcd on free loopback ports, then real kvwired
//! processes with a `[discovery]` table and no static peers. Entries are read
//! back with etcd-client directly, as plain JSON, not through kvwired.

use crate::daemons::{identity_of, model, read_back, register, side, submit_to, DST, SRC, WAIT};
use kvwire_core::verify;
use kvwire_client::client::{Client, ClientError, Submitted};
use kvwire_client::control::*;
use kvwire_testkit::{free_port, start_daemon, DaemonProc, TempDir};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const ETCD: &str = "/usr/bin/etcd";
const SECRET: &str = "a-secret-of-at-least-16-bytes";

/// A private etcd on loopback: killed, and then its data removed (field
/// `dir` drops after `drop` ran), on drop.
struct Etcd {
    child: Child,
    dir: TempDir,
    endpoint: String,
    peer: u16,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Etcd {
    /// Starts one and waits until it answers; `None` (the test is skipped,
    /// loudly) when etcd-server is not installed and this is not root. As
    /// root — scripts/test, CI — a missing etcd is a failure.
    fn start(test: &str) -> Option<Etcd> {
        if !Path::new(ETCD).exists() {
            assert!(!nix::unistd::Uid::effective().is_root(), "{ETCD} is missing: run scripts/test, which installs etcd-server");
            kvwire_testkit::skip(test, kvwire_testkit::Need::Etcd, "etcd-server not installed (apt-get install etcd-server)");
            return None;
        }
        let dir = TempDir::new(&format!("etcd-{test}"));
        let endpoint = format!("127.0.0.1:{}", free_port());
        let peer = free_port();
        let child = Etcd::spawn(dir.path(), &endpoint, peer);
        let mut etcd = Etcd { child, dir, endpoint, peer };
        etcd.wait_ready();
        Some(etcd)
    }

    fn spawn(dir: &Path, endpoint: &str, peer: u16) -> Child {
        let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
        Command::new(ETCD)
            .args(["--name", "t", "--logger", "zap", "--log-level", "warn", "--initial-cluster-state", "new"])
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg(format!("--listen-client-urls=http://{endpoint}"))
            .arg(format!("--advertise-client-urls=http://{endpoint}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!("--initial-cluster=t=http://127.0.0.1:{peer}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap()
    }

    fn wait_ready(&mut self) {
        let r = Reader::new(&self.endpoint);
        let started = Instant::now();
        loop {
            if r.try_get("/probe").is_ok() {
                return;
            }
            let exited = self.child.try_wait().unwrap();
            if exited.is_some() || started.elapsed() > WAIT {
                let log = std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default();
                panic!("etcd on {} did not answer ({exited:?} after {:?}):\n{log}", self.endpoint, started.elapsed());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Replaces it with a fresh etcd, without data, on the same ports.
    fn restart_empty(&mut self) {
        self.kill();
        std::fs::remove_dir_all(self.dir.join("data")).unwrap();
        self.child = Etcd::spawn(self.dir.path(), &self.endpoint, self.peer);
        self.wait_ready();
    }
}

/// Reads etcd with etcd-client on its own runtime, independently of kvwired.
struct Reader {
    rt: tokio::runtime::Runtime,
    client: etcd_client::Client,
}

impl Reader {
    fn new(endpoint: &str) -> Reader {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let client = rt.block_on(etcd_client::Client::connect([endpoint], None)).unwrap();
        Reader { rt, client }
    }

    /// The value (JSON) and lease id at `key`, if it exists.
    fn try_get(&self, key: &str) -> Result<Option<(Value, i64)>, String> {
        let mut c = self.client.clone();
        let got = self.rt.block_on(async { tokio::time::timeout(Duration::from_secs(2), c.get(key, None)).await });
        let got = got.map_err(|_| "timed out".to_string())?.map_err(|e| e.to_string())?;
        Ok(got.kvs().first().map(|kv| (serde_json::from_slice(kv.value()).expect("entry is JSON"), kv.lease())))
    }

    fn get(&self, key: &str) -> Option<(Value, i64)> {
        self.try_get(key).unwrap_or_else(|e| panic!("etcd get {key}: {e}"))
    }

    fn revoke(&self, lease: i64) {
        let mut c = self.client.clone();
        self.rt.block_on(c.lease_revoke(lease)).unwrap();
    }

    /// The TTL a lease was granted with.
    fn granted_ttl(&self, lease: i64) -> i64 {
        let mut c = self.client.clone();
        self.rt.block_on(c.lease_time_to_live(lease, None)).unwrap().granted_ttl()
    }
}

/// Polls `f` every 20 ms until it returns `Some`, failing after `limit`.
fn until<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> (T, Duration) {
    let started = Instant::now();
    loop {
        if let Some(v) = f() {
            return (v, started.elapsed());
        }
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn entry_key(node: &str) -> String {
    // The documented default prefix, written out by hand.
    format!("/kvwire/v1/nodes/{node}")
}

/// SIGKILL: it cannot revoke its lease.
fn sigkill(d: &mut DaemonProc) {
    d.child().kill().unwrap();
    d.child().wait().unwrap();
}

/// SIGTERM, and its exit status once it is gone.
fn terminate(d: &mut DaemonProc) -> std::process::ExitStatus {
    use nix::sys::signal::{kill, Signal};
    kill(nix::unistd::Pid::from_raw(d.pid() as i32), Signal::SIGTERM).unwrap();
    until("kvwired exits on SIGTERM", Duration::from_secs(10), || d.child().try_wait().unwrap()).0
}

/// A kvwired with a `[discovery]` table naming `etcd` and no static peers.
fn start(dir: &TempDir, node: &str, etcd: &Etcd, lease_ttl_secs: u64) -> DaemonProc {
    let tables = format!("[discovery]\netcd = [\"{}\"]\nlease_ttl_secs = {lease_ttl_secs}\n", etcd.endpoint);
    start_daemon(dir.path(), node, SECRET, &[], &tables)
}

#[test]
fn daemons_register_in_etcd_and_transfer_by_name() {
    let Some(etcd) = Etcd::start("daemons_register_in_etcd_and_transfer_by_name") else { return };
    let dir = TempDir::new("discovery-register");
    let b = start(&dir, "b", &etcd, 3);
    let a = start(&dir, "a", &etcd, 3);
    let r = Reader::new(&etcd.endpoint);
    for d in [&a, &b] {
        // The first registration happens before `kvwired ready`; polled
        // anyway, in case a loaded host made it fall back to the background.
        let ((e, lease), _) = until("entry registered", Duration::from_secs(5), || r.get(&entry_key(&d.node)));
        assert_eq!(e["name"], d.node.as_str(), "{e}");
        assert_eq!(e["peer"], d.peer.as_str(), "{e}");
        assert_eq!(e["version"], kvwired::peer::PEER_VERSION, "{e}");
        assert_eq!(e["transport"], "tcp", "{e}");
        let data = e["data"].as_array().unwrap_or_else(|| panic!("data is not a list: {e}"));
        assert!(!data.is_empty() && data.iter().all(|a| a.as_str().is_some_and(|a| a.parse::<SocketAddr>().is_ok())), "{e}");
        assert_eq!(e["serves"], json!({"models": [], "tenants": []}), "{e}");
        assert_ne!(lease, 0, "entry of {} is not under a lease", d.node);
        assert_eq!(r.granted_ttl(lease), 3);
    }
    let ca = Client::connect(&a.socket, "prefill").unwrap();
    let cb = Client::connect(&b.socket, "decode").unwrap();
    let tokens = 100;
    let (ss, ds) = (side(SRC, tokens), side(DST, tokens));
    let src_bytes = verify::fill_source(&model(), &ss, tokens);
    let _src = register(&ca, "prefill", SRC, &ss, Some(&src_bytes), identity_of("toy-digest", "t1"));
    let dst = register(&cb, "decode", DST, &ds, None, identity_of("toy-digest", "t1"));
    let other = register(&cb, "other", "tp=1,block=16", &side("tp=1,block=16", 16), None, identity_of("big-digest", "t0"));
    // b's entry now says what it serves, sorted, under the same lease.
    let (_, lease_b) = r.get(&entry_key("b")).unwrap();
    let serves = json!({"models": ["big-digest", "toy-digest"], "tenants": ["t0", "t1"]});
    let ((e, lease), took) = until("b's entry lists its groups", Duration::from_secs(5), || r.get(&entry_key("b")).filter(|(e, _)| e["serves"] == serves));
    println!("b's entry updated {took:?} after its groups were registered: {e}");
    assert_eq!(lease, lease_b, "re-put under another lease");
    assert_eq!(r.get(&entry_key("a")).unwrap().0["serves"], json!({"models": ["toy-digest"], "tenants": ["t1"]}));

    // A transfer to `b` by name: a has no static peers, so it asks etcd.
    for m in &dst.mems {
        m.write(0, &vec![verify::CANARY; m.len() as usize]).unwrap();
    }
    let slot = cb
        .prepare(PrepareReceive { group: "decode".into(), request: "r1".into(), block_table: ds.block_table.clone(), tokens, prefix_tokens: 0, source: None })
        .unwrap();
    let Submitted { slot: sslot, peer_slot, .. } = submit_to(&ca, "b", &ss, tokens, "r1").unwrap();
    assert_eq!(peer_slot, slot);
    cb.wait(slot, FlagName::DecoderUsable, WAIT).unwrap();
    ca.wait(sslot, FlagName::SourceReleased, WAIT).unwrap();
    // The source is done when the destination says so: its decoder_usable.
    ca.wait(sslot, FlagName::DecoderUsable, WAIT).unwrap();
    let want = verify::expected_destination(&model(), &ds, tokens, 0);
    assert!(read_back(&dst) == want, "destination bytes differ from the independent expectation");
    assert_eq!(ca.status(sslot).unwrap().state, TransferState::Done);

    // Releasing a group takes it out of the summary.
    cb.release("other", 0).unwrap();
    drop(other);
    let want = json!({"models": ["toy-digest"], "tenants": ["t1"]});
    until("b's entry drops the released group", Duration::from_secs(5), || r.get(&entry_key("b")).filter(|(e, _)| e["serves"] == want));
    // A name nobody registered.
    let e = submit_to(&ca, "nobody", &ss, tokens, "r2").unwrap_err();
    assert!(matches!(&e, ClientError::Daemon { code: 200, .. }), "{e}");
    assert!(e.to_string().contains(&format!("peer `nobody` is not configured and not registered in etcd at {}", etcd.endpoint)), "{e}");
}

#[test]
fn killed_daemons_entry_expires_with_its_lease() {
    let Some(etcd) = Etcd::start("killed_daemons_entry_expires_with_its_lease") else { return };
    let dir = TempDir::new("discovery-expiry");
    let ttl = 2;
    let mut b = start(&dir, "b", &etcd, ttl);
    let r = Reader::new(&etcd.endpoint);
    until("entry registered", Duration::from_secs(5), || r.get(&entry_key("b")));
    // Kept alive past its TTL.
    std::thread::sleep(Duration::from_secs(ttl + 1));
    assert!(r.get(&entry_key("b")).is_some(), "a live daemon's entry expired");
    sigkill(&mut b);
    let killed = Instant::now();
    assert!(r.get(&entry_key("b")).is_some(), "SIGKILL cannot revoke: the entry stays until the lease expires");
    until("entry expires", Duration::from_secs(ttl + 5), || r.get(&entry_key("b")).is_none().then_some(()));
    let gone = killed.elapsed();
    println!("lease_ttl_secs = {ttl}: the entry of a SIGKILLed daemon disappeared {:.2} s after the kill", gone.as_secs_f64());
    // Kept alive every ttl/3, the lease had at least 2/3 of its TTL left.
    assert!(gone >= Duration::from_millis(ttl * 1000 / 2), "gone after {gone:?}: revoked, not expired?");
    assert!(gone <= Duration::from_secs(ttl + 3), "gone only after {gone:?}");
}

#[test]
fn vanished_peer_fails_fast_and_shutdown_revokes_the_lease() {
    let Some(mut etcd) = Etcd::start("vanished_peer_fails_fast_and_shutdown_revokes_the_lease") else { return };
    let dir = TempDir::new("discovery-vanished");
    let a = start(&dir, "a", &etcd, 10);
    let mut b = start(&dir, "b", &etcd, 2);
    let mut c = start(&dir, "c", &etcd, 10);
    let r = Reader::new(&etcd.endpoint);
    for n in ["a", "b", "c"] {
        until("entry registered", Duration::from_secs(5), || r.get(&entry_key(n)));
    }
    let ca = Client::connect(&a.socket, "prefill").unwrap();
    let tokens = 20;
    let ss = side(SRC, tokens);
    let _src = register(&ca, "prefill", SRC, &ss, None, identity_of("toy-digest", "t1"));

    // b dies: while its entry lingers, its address no longer answers.
    let b_peer = b.peer.clone();
    sigkill(&mut b);
    assert!(r.get(&entry_key("b")).is_some());
    let t = Instant::now();
    let e1 = submit_to(&ca, "b", &ss, tokens, "r1").unwrap_err();
    let unreachable = t.elapsed();
    assert!(matches!(&e1, ClientError::Daemon { code: 201, .. }), "{e1}");
    assert!(e1.to_string().contains(&format!("peer `b` at {b_peer}")), "{e1}");
    // Once the lease expired, the name is unknown.
    until("b's entry expires", Duration::from_secs(6), || r.get(&entry_key("b")).is_none().then_some(()));
    let t = Instant::now();
    let e = submit_to(&ca, "b", &ss, tokens, "r2").unwrap_err();
    let unknown = t.elapsed();
    assert!(matches!(&e, ClientError::Daemon { code: 200, .. }), "{e}");
    assert!(e.to_string().contains(&format!("peer `b` is not configured and not registered in etcd at {}", etcd.endpoint)), "{e}");
    println!("submit to a vanished peer: {unreachable:?} while its entry lingered ({e1}); {unknown:?} once it expired ({e})");
    assert!(unreachable < Duration::from_secs(3) && unknown < Duration::from_secs(3), "{unreachable:?} {unknown:?}");

    // SIGTERM: c revokes its lease on the way out, long before its 10 s TTL.
    let t = Instant::now();
    let status = terminate(&mut c);
    until("c's entry removed", Duration::from_secs(3), || r.get(&entry_key("c")).is_none().then_some(()));
    let removed = t.elapsed();
    println!("SIGTERM (lease_ttl_secs = 10): entry removed {removed:?} after the signal, kvwired exited {status}");
    assert!(status.success(), "{status}");
    assert!(removed < Duration::from_secs(3), "{removed:?}");
    let e = submit_to(&ca, "c", &ss, tokens, "r3").unwrap_err();
    assert!(e.to_string().contains("peer `c` is not configured and not registered in etcd"), "{e}");

    // etcd itself gone: a lookup fails within its call timeout, naming etcd.
    etcd.kill();
    let t = Instant::now();
    let e = submit_to(&ca, "b", &ss, tokens, "r4").unwrap_err();
    let no_etcd = t.elapsed();
    println!("submit with etcd down failed in {no_etcd:?}: {e}");
    assert!(matches!(&e, ClientError::Daemon { code: 200, .. }), "{e}");
    assert!(e.to_string().contains("etcd cannot say where it is") && e.to_string().contains(&etcd.endpoint), "{e}");
    assert!(no_etcd < Duration::from_secs(4), "{no_etcd:?}");
    // And a still serves its control socket.
    ca.stats().unwrap();
}

#[test]
fn entry_comes_back_when_etcd_loses_it() {
    let Some(mut etcd) = Etcd::start("entry_comes_back_when_etcd_loses_it") else { return };
    let dir = TempDir::new("discovery-recover");
    let b = start(&dir, "b", &etcd, 2);
    let key = entry_key("b");
    let r = Reader::new(&etcd.endpoint);
    let ((_, lease), _) = until("entry registered", Duration::from_secs(5), || r.get(&key));
    // The lease revoked behind b's back: its next keep-alive learns it, and
    // it registers again under a new lease.
    r.revoke(lease);
    assert!(r.get(&key).is_none());
    let ((_, again), took) = until("entry back after its lease was revoked", Duration::from_secs(5), || r.get(&key));
    assert_ne!(again, lease);
    println!("lease revoked by someone else: entry back {took:?} later");
    // etcd replaced by an empty one at the same address: b registers again
    // once it answers, and kept serving meanwhile.
    etcd.restart_empty();
    let r = Reader::new(&etcd.endpoint);
    let ((e, _), took) = until("entry back in an empty etcd", Duration::from_secs(10), || r.try_get(&key).ok().flatten());
    println!("etcd restarted empty: entry back {took:?} after it answered");
    assert_eq!(e["peer"], b.peer.as_str(), "{e}");
    Client::connect(&b.socket, "probe").unwrap().stats().unwrap();
}
