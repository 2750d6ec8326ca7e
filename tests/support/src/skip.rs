//! Skipped tests, said out loud. libtest shows a test that returned early as
//! `ok`, and hides what it printed; so a test that cannot run here (no root,
//! no RDMA device, no GPU, no etcd) calls [`skip`], which prints a `SKIPPED`
//! line and, when `KVWIRE_SKIP_LOG` names a file, appends one record to it.
//! `scripts/test` sets the variable and prints the count and the reasons at
//! its end.
//!
//! A record is one line of tab-separated fields: `NEED CRATE TEST REASON`
//! (tabs and newlines in the fields become spaces).

use std::fmt;
use std::io::Write;

/// What a skipped test lacked: the first field of a record, which
/// `scripts/test` groups by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Root, or root and iproute2 (network namespaces, another uid).
    Root,
    /// An RDMA device (scripts/softroce-vm provides one).
    Rdma,
    /// A GPU with `KVWIRE_GPU=1` (scripts/gpu-check).
    Gpu,
    /// A host without a CUDA driver (the no-driver error paths).
    NoGpu,
    /// etcd-server installed.
    Etcd,
}

impl fmt::Display for Need {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Need::Root => "root",
            Need::Rdma => "rdma",
            Need::Gpu => "gpu",
            Need::NoGpu => "no-gpu",
            Need::Etcd => "etcd",
        })
    }
}

/// The running test's name: libtest names each test's thread after it
/// (`module::test`); `?` elsewhere.
pub fn current_test() -> String {
    match std::thread::current().name() {
        Some(n) if n != "main" => n.to_string(),
        _ => "?".into(),
    }
}

/// Records that `test` did not run because it lacks `need`, and why: a
/// `SKIPPED test: why` line on stderr, and a record in `KVWIRE_SKIP_LOG`
/// when that is set (naming the test by its whole path when libtest runs
/// it). A log that cannot be written fails the test: a skip nobody hears
/// about is what this exists to prevent.
pub fn skip(test: &str, need: Need, why: &str) {
    eprintln!("SKIPPED {test}: {why}");
    let Some(log) = std::env::var_os("KVWIRE_SKIP_LOG").filter(|p| !p.is_empty()) else { return };
    // cargo sets CARGO_PKG_NAME when it runs a test; a binary run by hand
    // (inside the soft-RoCE VM) is named by its file.
    let krate = std::env::var("CARGO_PKG_NAME").ok().or_else(|| {
        std::env::current_exe().ok().and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()))
    });
    let clean = |s: &str| s.replace(['\t', '\n', '\r'], " ");
    // The thread's name is the whole test path, which scripts/test matches
    // against the filters of the runs that may have run the test elsewhere.
    let path = Some(current_test()).filter(|t| t != "?").unwrap_or_else(|| test.to_string());
    let line = format!("{need}\t{}\t{}\t{}\n", clean(krate.as_deref().unwrap_or("?")), clean(&path), clean(why));
    // One write of one line, with O_APPEND: concurrent tests do not interleave.
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .unwrap_or_else(|e| panic!("KVWIRE_SKIP_LOG {}: {e}", log.to_string_lossy()));
    f.write_all(line.as_bytes()).unwrap_or_else(|e| panic!("KVWIRE_SKIP_LOG {}: {e}", log.to_string_lossy()));
}
