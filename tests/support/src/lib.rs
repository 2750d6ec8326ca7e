//! kvwire's test support, shared by every crate's tests, the demo and the
//! benches: temporary directories, free ports, the workspace's binaries,
//! kvwired processes, network-namespace hosts ([`netns`]), and skipped tests
//! said out loud ([`skip`]).
//!
//! It depends on none of kvwire's crates, so any of them can use it as a
//! dev-dependency without a cycle.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod netns;
pub mod skip;

pub use skip::{current_test, skip, Need};

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// A fresh directory under the temp dir, removed on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates `kvwire-TAG-PID-N-NANOS` under the temp dir (unique per call).
    pub fn new(tag: &str) -> TempDir {
        TempDir::try_new(tag).expect("create a temporary directory")
    }

    /// [`TempDir::new`], with the failure as text.
    pub fn try_new(tag: &str) -> Result<TempDir, String> {
        // The counter keeps two calls with one tag in the same nanosecond apart.
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let p = std::env::temp_dir().join(format!("kvwire-{tag}-{}-{n}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(TempDir(p))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// `rel` inside the directory.
    pub fn join(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.0.join(rel)
    }

    /// Writes `text` to `rel` inside the directory, creating its parent
    /// directories; returns the file's path (panics on failure: tests).
    pub fn write(&self, rel: impl AsRef<Path>, text: impl AsRef<[u8]>) -> PathBuf {
        let p = self.0.join(rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).unwrap_or_else(|e| panic!("{}: {e}", parent.display()));
        }
        std::fs::write(&p, text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        p
    }

    /// [`TempDir::write`], readable by its owner only: what kvwired wants
    /// of a secret file.
    pub fn write_private(&self, rel: impl AsRef<Path>, text: impl AsRef<[u8]>) -> PathBuf {
        let p = self.write(rel, "");
        write_private(&p, text).unwrap_or_else(|e| panic!("{e}"));
        p
    }

    /// The directory as text (panics on a non-UTF-8 temp dir).
    pub fn as_str(&self) -> &str {
        self.0.to_str().expect("temp dir is UTF-8")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `text` to `path`, readable by its owner only (kvwired refuses a
/// secret file others could read).
pub fn write_private(path: &Path, text: impl AsRef<[u8]>) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("write {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).map_err(|e| format!("chmod {}: {e}", path.display()))
}

/// A loopback TCP port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("bind 127.0.0.1:0").port()
}

/// `127.0.0.1:PORT` with a port that was free a moment ago.
pub fn free_addr() -> String {
    format!("127.0.0.1:{}", free_port())
}

/// The workspace binary `name` next to the running executable
/// (target/<profile>/), or why it is not there.
pub fn find_bin(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
    let mut dir = exe.parent().ok_or("the executable has no directory")?.to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join(name);
    if bin.exists() {
        Ok(bin)
    } else {
        Err(format!("{} not found: build it first (cargo build --bins)", bin.display()))
    }
}

/// [`find_bin`], panicking when it is missing (tests).
pub fn bin(name: &str) -> PathBuf {
    find_bin(name).unwrap_or_else(|e| panic!("{e}"))
}

/// The `kvwired` binary next to the running executable.
pub fn kvwired_bin() -> PathBuf {
    bin("kvwired")
}

/// Runs the `kvwire` CLI with `args` and collects its output.
pub fn kvwire(args: &[&str]) -> Output {
    Command::new(bin("kvwire")).args(args).output().expect("run kvwire")
}

/// The count of counter `metric` of `node` with the one label `label`
/// (`how="opened"`) in a daemon's Prometheus text `stats`; panics naming
/// the series when it is not there.
pub fn counter(stats: &str, metric: &str, node: &str, label: &str) -> u64 {
    let key = format!("{metric}{{node=\"{node}\",{label}}} ");
    stats.lines().find_map(|l| l.strip_prefix(&key)).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("no {key} in {stats}"))
}

/// A kvwired process started for a test, a bench or the demo; stopped on
/// drop (SIGTERM, so it removes its sockets), killed if it does not stop.
#[derive(Debug)]
pub struct DaemonProc {
    child: Child,
    /// Its node name.
    pub node: String,
    /// Control socket.
    pub socket: PathBuf,
    /// Peer-control address.
    pub peer: String,
    /// Data-plane address.
    pub data: String,
    /// Where its log goes, when not to the test's stderr.
    pub log: Option<PathBuf>,
}

impl DaemonProc {
    /// The daemon's process id (for /proc figures and signals).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The process itself (to signal it or wait for its exit).
    pub fn child(&mut self) -> &mut Child {
        &mut self.child
    }

    /// What it logged so far ([`start_daemon_logged`]; empty otherwise).
    pub fn log_text(&self) -> String {
        self.log.as_ref().and_then(|p| std::fs::read_to_string(p).ok()).unwrap_or_default()
    }
}

impl Drop for DaemonProc {
    fn drop(&mut self) {
        // Reaped already (a test that stopped it itself): its pid may be
        // another process's now. Unreaped, it stays this one's.
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        if nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).is_ok() {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while std::time::Instant::now() < deadline {
                if !matches!(self.child.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `kvwired` with a config written into `dir`; `extra` is added to it
/// (its top-level keys first, its tables last).
pub fn start_daemon(dir: &Path, node: &str, secret: &str, peers: &[(&str, &str)], extra: &str) -> DaemonProc {
    start_daemon_in(None, "127.0.0.1", dir, node, secret, peers, extra)
}

/// [`start_daemon`] inside network namespace `netns` (via `ip netns exec`),
/// listening on `ip` for peers and data.
pub fn start_daemon_in(
    netns: Option<&str>,
    ip: &str,
    dir: &Path,
    node: &str,
    secret: &str,
    peers: &[(&str, &str)],
    extra: &str,
) -> DaemonProc {
    try_start_daemon_in(netns, ip, dir, node, secret, peers, extra).unwrap_or_else(|e| panic!("{e}"))
}

/// [`start_daemon`], logging into `dir/<node>.log` ([`DaemonProc::log_text`]).
pub fn start_daemon_logged(dir: &Path, node: &str, secret: &str, peers: &[(&str, &str)], extra: &str) -> DaemonProc {
    let log = dir.join(format!("{node}.log"));
    spawn_daemon(None, "127.0.0.1", dir, node, secret, peers, extra, Some(log)).unwrap_or_else(|e| panic!("{e}"))
}

/// [`start_daemon_in`], with the failure as text instead of a panic.
pub fn try_start_daemon_in(
    netns: Option<&str>,
    ip: &str,
    dir: &Path,
    node: &str,
    secret: &str,
    peers: &[(&str, &str)],
    extra: &str,
) -> Result<DaemonProc, String> {
    spawn_daemon(netns, ip, dir, node, secret, peers, extra, None)
}

#[allow(clippy::too_many_arguments)] // try_start_daemon_in's, and where the log goes
fn spawn_daemon(netns: Option<&str>, ip: &str, dir: &Path, node: &str, secret: &str, peers: &[(&str, &str)], extra: &str, log: Option<PathBuf>) -> Result<DaemonProc, String> {
    let secret_file = dir.join(format!("{node}.secret"));
    write_private(&secret_file, secret)?;
    let socket = dir.join(format!("{node}.sock"));
    let mut cfg = format!(
        "node = \"{node}\"\ncontrol_socket = \"{}\"\npeer_listen = \"{ip}:0\"\nsecret_file = \"{}\"\n",
        socket.display(),
        secret_file.display()
    );
    for (name, addr) in peers {
        cfg.push_str(&format!("[[peers]]\nname = \"{name}\"\naddress = \"{addr}\"\n"));
    }
    // Top-level keys of `extra` first; tables after, [transport] may be extended.
    let (top, tables) = match extra.find('[') {
        Some(i) => extra.split_at(i),
        None => (extra, ""),
    };
    cfg = format!("{top}\n{cfg}");
    // Off loopback the data plane listens on this host's address, in the
    // [transport] table `extra` brings, or in one of its own.
    let (header, listen) = ("[transport]\n", format!("tcp_listen = \"{ip}:0\"\n"));
    let tables = match tables.find(header) {
        _ if ip == "127.0.0.1" => tables.to_string(),
        None => format!("{header}{listen}{tables}"),
        Some(at) => {
            // The table runs to the next one's header.
            let body = &tables[at + header.len()..];
            match body[..body.find("\n[").map_or(body.len(), |end| end + 1)].contains("tcp_listen") {
                true => tables.to_string(),
                false => tables.replacen(header, &format!("{header}{listen}"), 1),
            }
        }
    };
    cfg.push_str(&tables);
    let path = dir.join(format!("{node}.toml"));
    std::fs::write(&path, cfg).map_err(|e| format!("write {}: {e}", path.display()))?;
    let kvwired = find_bin("kvwired")?;
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(kvwired);
            c
        }
        None => Command::new(kvwired),
    };
    if let Some(log) = &log {
        let f = std::fs::File::create(log).map_err(|e| format!("create {}: {e}", log.display()))?;
        cmd.stderr(f);
    }
    let mut child = cmd.arg("--config").arg(&path).stdout(Stdio::piped()).spawn().map_err(|e| format!("spawn kvwired: {e}"))?;
    let mut line = String::new();
    let mut out = BufReader::new(child.stdout.take().expect("stdout is piped"));
    let _ = out.read_line(&mut line);
    if !line.starts_with("kvwired ready") {
        let _ = out.read_to_string(&mut line);
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("kvwired {node} did not start: {line:?}"));
    }
    let field = |k: &str| line.split_whitespace().find_map(|w| w.strip_prefix(k)).unwrap_or_default().to_string();
    Ok(DaemonProc { peer: field("peer="), data: field("data="), node: node.into(), child, socket, log })
}
