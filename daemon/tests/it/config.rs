//! kvwired's settings: the example config documents every key with its real
//! default, bad settings fail naming the key, the environment layers over the
//! file and flags over both, and the real binary's `--check` reports it.

use kvwire_testkit::TempDir;
use kvwired::config::{Config, ConfigError, TransportKind};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const EXAMPLE: &str = include_str!("../../../config/kvwired.example.toml");
const SECRET: &str = "a-secret-of-at-least-16-bytes\n";

/// The example with `secret_file` pointed at `secret`.
fn example_with_secret(secret: &Path) -> String {
    let line = EXAMPLE.lines().find(|l| l.starts_with("secret_file =")).expect("example sets secret_file");
    EXAMPLE.replacen(line, &format!("secret_file = {:?}", secret.display().to_string()), 1)
}

/// A valid config as TOML text: `top` at top level, then `tables`.
fn minimal(dir: &TempDir, top: &str, tables: &str) -> String {
    let secret = dir.write_private("secret", SECRET);
    format!("node = \"n1\"\nsecret_file = {:?}\n{top}\n{tables}", secret.display().to_string())
}

/// Parse, then validate, then read the secret: the order kvwired uses.
fn load(text: &str) -> Result<Config, ConfigError> {
    let c = Config::from_toml("test.toml", text)?;
    c.validate()?;
    c.secret()?;
    Ok(c)
}

fn assert_refused(text: &str, needles: &[&str]) {
    let e = load(text).expect_err(text).to_string();
    for n in needles {
        assert!(e.contains(n), "error for\n{text}\nlacks `{n}`: {e}");
    }
    assert!(!e.contains('\n'), "error is not one line: {e}");
}

/// Dotted keys of every field of `Config`, read from its `{:#?}` — an
/// enumeration independent of the example file. Vec fields are given one
/// element so their element's fields appear (`peers.name`).
fn config_keys() -> BTreeSet<String> {
    let mut c = Config::default();
    c.peers.push(kvwired::config::PeerConfig { name: "p".into(), address: "127.0.0.1:1".into() });
    c.rails.push(kvwired::config::RailConfig {
        name: "r".into(),
        tcp_listen: "127.0.0.1:0".into(),
        tcp_advertise: None,
        verbs_device: None,
        verbs_port: 1,
        verbs_gid_index: None,
        verbs_listen: "127.0.0.1:0".into(),
        device: None,
    });
    let dbg = format!("{c:#?}");
    let mut keys = BTreeSet::new();
    let mut stack: Vec<(usize, String)> = Vec::new();
    for line in dbg.lines().skip(1) {
        let indent = line.len() - line.trim_start().len();
        let t = line.trim_start();
        let Some((key, rest)) = t.split_once(": ") else { continue };
        if !key.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
            continue;
        }
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        let full = stack.iter().map(|(_, k)| k.as_str()).chain([key]).collect::<Vec<_>>().join(".");
        // A struct or list value opens a nested level; record only leaves.
        if rest.ends_with('{') || rest.ends_with('[') {
            stack.push((indent, key.to_string()));
        } else {
            keys.insert(full);
        }
    }
    keys
}

/// Dotted keys the example documents: set ones and commented-out ones
/// (`# key = value`), under their `[table]` / `[[table]]` headers, also
/// commented or not.
fn documented_keys() -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    let mut table = String::new();
    for line in EXAMPLE.lines() {
        let l = line.trim().trim_start_matches('#').trim();
        if let Some(h) = l.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            table = h.trim_matches(['[', ']']).to_string();
        } else if let Some((k, _)) = l.split_once(" = ") {
            if k.chars().all(|c| c.is_ascii_lowercase() || c == '_') && !k.is_empty() {
                keys.insert(if table.is_empty() { k.to_string() } else { format!("{table}.{k}") });
            }
        }
    }
    keys
}

/// The example with every commented-out setting and table header enabled.
fn example_uncommented() -> String {
    EXAMPLE
        .lines()
        .map(|line| {
            let l = line.trim_start_matches('#').trim();
            let header = l.starts_with('[') && l.ends_with(']');
            let setting = l.split_once(" = ").is_some_and(|(k, _)| !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_'));
            if header || setting {
                l.to_string()
            } else {
                line.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn example_parses_validates_and_sets_only_defaults() {
    let dir = TempDir::new("config-example");
    let secret = dir.write_private("secret", SECRET);
    let text = example_with_secret(&secret);
    let c = load(&text).unwrap_or_else(|e| panic!("example config refused: {e}"));
    assert_eq!(c.secret_file.as_deref(), Some(secret.as_path()));
    // Every value the example sets is the documented default.
    let as_is = Config::from_toml("example", EXAMPLE).unwrap();
    assert_eq!(as_is.secret_file, Some(PathBuf::from("/etc/kvwire/secret")));
    assert_eq!(Config { secret_file: None, ..as_is }, Config::default());
}

#[test]
fn example_documents_every_key_of_config_and_nothing_else() {
    let want = config_keys();
    let have = documented_keys();
    // Sanity of the independent enumeration: keys named in issue 5 / config.rs.
    for k in ["node", "transport.kind", "transport.verbs_gid_index", "limits.max_inflight_transfers", "peers.address"] {
        assert!(want.contains(k), "Config's Debug lacks {k}: {want:?}");
    }
    let missing: Vec<_> = want.difference(&have).collect();
    assert!(missing.is_empty(), "keys of Config not documented in config/kvwired.example.toml: {missing:?}");
    let extra: Vec<_> = have.difference(&want).collect();
    assert!(extra.is_empty(), "keys documented in the example that Config lacks: {extra:?}");
    // Each key states its default (or that it has none).
    for k in &want {
        let leaf = k.rsplit('.').next().unwrap();
        let pos = EXAMPLE.lines().position(|l| l.trim_start_matches('#').trim().starts_with(&format!("{leaf} = "))).unwrap();
        let before: Vec<&str> = EXAMPLE.lines().take(pos).collect();
        let doc = before.iter().rev().take_while(|l| l.starts_with('#') && !l.trim_start_matches('#').trim().contains(" = ")).collect::<Vec<_>>();
        let doc_text = doc.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(" ");
        let peers_section = k.starts_with("peers.");
        assert!(
            peers_section || doc_text.contains("Default") || doc_text.contains("no default"),
            "`{k}` in the example does not state its default: {doc_text:?}"
        );
        assert!(peers_section || !doc.is_empty(), "`{k}` has no comment in the example");
    }
    // And the parser knows every documented key, commented-out ones included
    // (Config refuses unknown keys).
    let dir = TempDir::new("config-uncommented");
    let secret = dir.write_private("secret", SECRET);
    let all = example_uncommented().replacen("secret_file = \"/etc/kvwire/secret\"", &format!("secret_file = {:?}", secret.display().to_string()), 1);
    let c = load(&all).unwrap_or_else(|e| panic!("example with every setting enabled refused: {e}\n{all}"));
    assert_eq!(c.transport.verbs_device.as_deref(), Some("mlx5_0"));
    assert_eq!(c.peers.len(), 1);
}

#[test]
fn unknown_keys_are_refused_naming_them() {
    let dir = TempDir::new("config-unknown");
    assert_refused(&minimal(&dir, "bogus_key = 1", ""), &["bogus_key"]);
    assert_refused(&minimal(&dir, "", "[transport]\nkind = \"tcp\"\nverbs_gid = 3\n"), &["verbs_gid"]);
    assert_refused(&minimal(&dir, "", "[limits]\nmax_inflight = 3\n"), &["max_inflight"]);
    assert_refused(&minimal(&dir, "", "[[peers]]\nname = \"b\"\naddress = \"127.0.0.1:1\"\nsecret = \"x\"\n"), &["secret"]);
    // The example plus one unknown key.
    let secret = dir.write_private("secret", SECRET);
    let text = format!("not_a_setting = true\n{}", example_with_secret(&secret));
    assert_refused(&text, &["not_a_setting"]);
}

#[test]
fn wrong_types_are_refused_naming_the_key() {
    let dir = TempDir::new("config-types");
    assert_refused(&minimal(&dir, "", "[limits]\nmax_regions = \"many\"\n"), &["max_regions"]);
    assert_refused(&minimal(&dir, "verify_checksums = \"yes\"", ""), &["verify_checksums"]);
    assert_refused(&minimal(&dir, "", "[transport]\nkind = \"udp\"\n"), &["kind", "udp"]);
    assert_refused(&minimal(&dir, "", "[transport]\nverbs_port = 300\n"), &["verbs_port"]);
    assert_refused(&minimal(&dir, "peers = 3", ""), &["peers"]);
}

#[test]
fn bad_values_are_refused_naming_the_key() {
    let dir = TempDir::new("config-values");
    assert_refused(&minimal(&dir, "peer_listen = \"localhost\"", ""), &["peer_listen", "localhost"]);
    assert_refused(&minimal(&dir, "metrics_listen = \"1.2.3.4:99999\"", ""), &["metrics_listen"]);
    assert_refused(&minimal(&dir, "", "[transport]\ntcp_listen = \"nowhere\"\n"), &["transport.tcp_listen"]);
    assert_refused(&minimal(&dir, "", "[[peers]]\nname = \"b\"\naddress = \"b.example:port\"\n"), &["peers[0].address"]);
    assert_refused(
        &minimal(&dir, "", "[[peers]]\nname = \"b\"\naddress = \"127.0.0.1:1\"\n[[peers]]\nname = \"b\"\naddress = \"127.0.0.1:2\"\n"),
        &["peers[1].name", "`b`", "twice"],
    );
    assert_refused(&minimal(&dir, "", "[limits]\nmax_inflight_transfers = 0\n"), &["limits.max_inflight_transfers", "> 0"]);
    assert_refused(&minimal(&dir, "", "[limits]\nmax_inflight_transfers = 201\n"), &["limits.max_inflight_transfers", "200"]);
    assert_refused(&minimal(&dir, "", "[limits]\npeer_connections_kept = 65\n"), &["limits.peer_connections_kept", "at most 64"]);
    assert_refused(&minimal(&dir, "", "[limits]\npeer_connections_kept = -1\n"), &["peer_connections_kept"]);
    // None kept is a choice, not a mistake.
    assert_eq!(load(&minimal(&dir, "", "[limits]\npeer_connections_kept = 0\n")).unwrap().limits.peer_connections_kept, 0);
    assert_refused(&minimal(&dir, "", "[limits]\ntransfer_timeout_secs = 0\n"), &["limits.transfer_timeout_secs"]);
    assert_refused(&minimal(&dir, "", "[limits]\npeer_timeout_secs = 0\n"), &["limits.peer_timeout_secs", "> 0"]);
    let rail = |name: &str, listen: &str| format!("[[rails]]\nname = \"{name}\"\ntcp_listen = \"{listen}\"\n");
    assert_refused(&minimal(&dir, "", &rail("rail0", "127.0.0.1:0")), &["rails[0].name", "rail0"]);
    assert_refused(&minimal(&dir, "", &(rail("r1", "127.0.0.1:0") + &rail("r1", "127.0.0.1:0"))), &["rails[1].name", "r1"]);
    assert_refused(&minimal(&dir, "", &rail("r1", "eth1")), &["rails[0].tcp_listen"]);
    assert_refused(&minimal(&dir, "", &format!("[transport]\nkind = \"shm\"\n{}", rail("r1", "127.0.0.1:0"))), &["rails[0]", "not shm"]);
    // A verbs rail names its device.
    let verbs = "[transport]\nkind = \"verbs\"\n";
    assert_refused(&minimal(&dir, "", &format!("{verbs}[[rails]]\nname = \"r1\"\n")), &["rails[0].verbs_device", "ibv_devices"]);
    assert_refused(&minimal(&dir, "", &format!("{verbs}{}", rail("r1", "127.0.0.1:0"))), &["rails[0].verbs_device"]);
    assert_refused(&minimal(&dir, "", &format!("{verbs}[[rails]]\nname = \"r1\"\nverbs_device = \"rxe1\"\nverbs_port = 0\n")), &["rails[0].verbs_port"]);
    assert_refused(&minimal(&dir, "", &format!("{verbs}[[rails]]\nname = \"r1\"\nverbs_device = \"rxe1\"\nverbs_listen = \"x\"\n")), &["rails[0].verbs_listen"]);
    assert_refused(&minimal(&dir, "", "[transport]\nslice_bytes = 100\n"), &["transport.slice_bytes", "4096"]);
    assert_refused(&minimal(&dir, "", "[transport]\nrail_stall_ms = 0\n"), &["transport.rail_stall_ms"]);
    assert_refused(
        &minimal(&dir, "", "[limits]\ntransfer_timeout_secs = 5\npeer_timeout_secs = 6\n"),
        &["limits.peer_timeout_secs", "transfer_timeout_secs"],
    );
    // A node name outside [A-Za-z0-9-_.].
    assert_refused(&format!("node = \"bad name!\"\nsecret_file = {:?}\n", dir.write_private("s", SECRET).display().to_string()), &["node"]);
}

#[test]
fn discovery_table_bad_values_are_refused_naming_the_key() {
    let dir = TempDir::new("config-discovery");
    let disc = |body: &str| minimal(&dir, "", &format!("[discovery]\n{body}\n"));
    assert_refused(&disc("etcd = [\"127.0.0.1:2379\", \"nowhere\"]"), &["discovery.etcd[1]", "nowhere"]);
    assert_refused(&disc("etcd = [\"http://127.0.0.1:0\"]"), &["discovery.etcd[0]"]);
    assert_refused(&disc("etcd = [\"https://etcd-0:2379\"]"), &["discovery.etcd[0]", "TLS"]);
    assert_refused(&disc("etcd = \"127.0.0.1:2379\""), &["etcd"]);
    assert_refused(&disc("lease_ttl_secs = 1"), &["discovery.lease_ttl_secs", "at least 2"]);
    assert_refused(&disc("lease_ttl_secs = -3"), &["lease_ttl_secs"]);
    assert_refused(&disc("prefix = \"kvwire\""), &["discovery.prefix", "`kvwire`"]);
    assert_refused(&disc("prefix = \"/kvwire/\""), &["discovery.prefix"]);
    assert_refused(&disc("advertise_peer = \"0.0.0.0:7400\""), &["discovery.advertise_peer", "0.0.0.0:7400"]);
    assert_refused(&disc("advertise_peer = \"10.0.0.1:0\""), &["discovery.advertise_peer"]);
    assert_refused(&disc("advertise_peer = \"etcd-less\""), &["discovery.advertise_peer", "host:port"]);
    assert_refused(&disc("ttl = 3"), &["ttl"]);
    // A wildcard peer listener cannot be advertised: with etcd on, it needs
    // advertise_peer; without etcd, nothing is advertised.
    let wild = |tables: &str| minimal(&dir, "peer_listen = \"0.0.0.0:7400\"", tables);
    assert_refused(&wild("[discovery]\netcd = [\"127.0.0.1:2379\"]\n"), &["discovery.advertise_peer", "0.0.0.0:7400", "required"]);
    load(&wild("[discovery]\netcd = [\"127.0.0.1:2379\"]\nadvertise_peer = \"10.0.0.1:7400\"\n")).unwrap();
    load(&wild("")).unwrap();
    let c = load(&disc("etcd = [\"etcd-0.cluster:2379\", \"http://10.0.0.9:2379\"]\nlease_ttl_secs = 2")).unwrap();
    assert_eq!((c.discovery.etcd.len(), c.discovery.lease_ttl_secs, c.discovery.prefix.as_str()), (2, 2, "/kvwire/v1"));
    // Off by default: the embedded default config needs no etcd.
    assert!(Config::default().discovery.etcd.is_empty());
}

#[test]
fn secret_file_missing_absent_or_short_is_refused() {
    let dir = TempDir::new("config-secret");
    // Not set at all.
    assert_refused("node = \"n1\"\n", &["secret_file", "required"]);
    // Set, but no such file.
    let gone = dir.join("no-such-secret");
    assert_refused(&format!("secret_file = {:?}\n", gone.display().to_string()), &["secret_file", "no-such-secret"]);
    // Shorter than 16 bytes once the trailing newline is dropped (15 + "\n").
    let short = dir.write_private("short", "fifteen-bytes!!\n");
    assert_refused(&format!("secret_file = {:?}\n", short.display().to_string()), &["secret_file", "shorter than 16"]);
    // Exactly 16 is enough.
    let ok = dir.write_private("ok", "sixteen-bytes!!!\n");
    assert_eq!(load(&format!("secret_file = {:?}\n", ok.display().to_string())).unwrap().secret().unwrap(), b"sixteen-bytes!!!");
}

fn vars(kv: &[(&str, &str)]) -> Vec<(String, String)> {
    kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[test]
fn environment_layers_over_the_file() {
    let dir = TempDir::new("config-env");
    let text = minimal(&dir, "peer_listen = \"127.0.0.1:7500\"", "[transport]\nkind = \"shm\"\n");
    let mut c = Config::from_toml("f.toml", &text).unwrap();
    assert_eq!((c.node.as_str(), c.transport.kind), ("n1", TransportKind::Shm));
    c.apply_env(vars(&[
        ("KVWIRED_NODE", "from-env"),
        ("KVWIRED_TRANSPORT", "verbs"),
        ("KVWIRED_METRICS_LISTEN", "127.0.0.1:9400"),
        ("UNRELATED", "x"),
    ]))
    .unwrap();
    assert_eq!(c.node, "from-env");
    assert_eq!(c.transport.kind, TransportKind::Verbs);
    assert_eq!(c.metrics_listen, "127.0.0.1:9400");
    assert_eq!(c.peer_listen, "127.0.0.1:7500", "a file setting the environment does not name stays");
    c.validate().unwrap();
    let e = c.apply_env(vars(&[("KVWIRED_TRANSPORT", "bogus")])).unwrap_err();
    assert_eq!(e, ConfigError::Invalid { key: "KVWIRED_TRANSPORT".into(), reason: "expected tcp, shm or verbs, got `bogus`".into() });
    assert!(e.to_string().contains("KVWIRED_TRANSPORT") && e.to_string().contains("bogus"), "{e}");
}

/// Runs `kvwired ARGS` with `env` added (and no inherited KVWIRED_*).
fn kvwired(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvwired"));
    cmd.args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("KVWIRED_")) {
        cmd.env_remove(k);
    }
    cmd.envs(env.iter().copied());
    cmd.output().expect("run kvwired")
}

fn assert_check_fails(args: &[&str], env: &[(&str, &str)], needles: &[&str]) {
    let out = kvwired(args, env);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?} {env:?}: status {:?}, stderr: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: not one line: {stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{args:?} {env:?}: stderr lacks `{n}`: {stderr}");
    }
}

#[test]
fn kvwired_check_accepts_the_example_and_refuses_bad_settings() {
    let dir = TempDir::new("config-bin");
    let secret = dir.write_private("secret", SECRET);
    let good = dir.write("good.toml", example_with_secret(&secret));
    let good = good.to_str().unwrap();
    let out = kvwired(&["--config", good, "--check"], &[]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("settings ok"));

    let bad = dir.write("bad.toml", minimal(&dir, "", "[limits]\nmax_inflight_transfers = 0\n"));
    assert_check_fails(&["--config", bad.to_str().unwrap(), "--check"], &[], &["limits.max_inflight_transfers"]);
    let unknown = dir.write("unknown.toml", minimal(&dir, "colour = \"blue\"", ""));
    assert_check_fails(&["--config", unknown.to_str().unwrap(), "--check"], &[], &["colour", "unknown.toml"]);
    let typo = dir.write("type.toml", minimal(&dir, "", "[transport]\nverbs_port = \"one\"\n"));
    assert_check_fails(&["--config", typo.to_str().unwrap(), "--check"], &[], &["verbs_port"]);
    assert_check_fails(&["--config", dir.join("absent.toml").to_str().unwrap(), "--check"], &[], &["absent.toml"]);

    // Layering in the binary: env over file, flags over env.
    assert_check_fails(&["--config", good, "--check"], &[("KVWIRED_TRANSPORT", "bogus")], &["KVWIRED_TRANSPORT", "bogus"]);
    assert_check_fails(&["--config", good, "--check"], &[("KVWIRED_NODE", "has space")], &["node"]);
    let out = kvwired(&["--config", good, "--check", "--node", "flag-wins"], &[("KVWIRED_NODE", "has space")]);
    assert_eq!(out.status.code(), Some(0), "a flag must override the environment: {}", String::from_utf8_lossy(&out.stderr));
    assert_check_fails(&["--config", good, "--check", "--peer-listen", "nope"], &[("KVWIRED_PEER_LISTEN", "127.0.0.1:1")], &["peer_listen", "nope"]);
    let short = dir.write_private("short", "short\n");
    assert_check_fails(&["--config", good, "--check"], &[("KVWIRED_SECRET_FILE", short.to_str().unwrap())], &["secret_file", "shorter than 16"]);
}

#[test]
fn a_secret_file_others_can_read_is_refused_naming_its_mode() {
    let dir = TempDir::new("config-secret-mode");
    for mode in [0o644, 0o640, 0o604, 0o660] {
        let p = dir.write_private("secret", SECRET);
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
        let text = format!("node = \"n1\"\nsecret_file = {:?}\n", p.display().to_string());
        let e = load(&text).unwrap_err().to_string();
        assert!(e.contains("secret_file") && e.contains(&format!("{mode:03o}")) && e.contains("chmod 600"), "{mode:o}: {e}");
    }
    let p = dir.write_private("secret", SECRET);
    let text = format!("node = \"n1\"\nsecret_file = {:?}\n", p.display().to_string());
    assert!(load(&text).is_ok());
}

#[test]
fn cpus_are_a_linux_cpu_list_and_set_the_poll_window() {
    let dir = TempDir::new("config-cpus");
    let c = load(&minimal(&dir, "cpus = \"0, 2-3,3\"", "")).unwrap();
    assert_eq!(c.cpu_list().unwrap(), [0, 2, 3]);
    // Cores of its own: the daemon polls between close messages, unless told otherwise.
    assert_eq!(c.idle_poll(), kvwired::config::IDLE_POLL_PINNED);
    let c = load(&minimal(&dir, "cpus = \"1\"", "[transport]\nidle_poll_us = 0\n")).unwrap();
    assert_eq!(c.idle_poll(), std::time::Duration::ZERO);
    // Unpinned, it sleeps at once unless told to poll.
    let c = load(&minimal(&dir, "", "")).unwrap();
    assert!(c.cpu_list().unwrap().is_empty());
    assert_eq!(c.idle_poll(), std::time::Duration::ZERO);
    let c = load(&minimal(&dir, "", "[transport]\nidle_poll_us = 50\n")).unwrap();
    assert_eq!(c.idle_poll(), std::time::Duration::from_micros(50));
    for (bad, why) in [("x", "not a CPU number"), ("3-1", "backwards"), ("1,,2", "not a CPU number"), ("5000", "below 1024"), ("-1", "not a CPU number")] {
        assert_refused(&minimal(&dir, &format!("cpus = \"{bad}\""), ""), &["cpus", bad, why]);
    }
    assert_refused(&minimal(&dir, "", "[transport]\nidle_poll_us = 20000\n"), &["transport.idle_poll_us", "10000"]);
}
