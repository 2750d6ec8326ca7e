//! Test hosts: two network namespaces joined by a veth pair, removed on drop.
//! A process runs in a host with `ip netns exec`; a closure with
//! [`Host::run`], on a thread that entered the namespace, so the sockets it
//! makes belong to that host. (kvwire-transport's tests include this file.)

use std::process::Command;

/// A namespace and its address on the veth link.
#[derive(Debug)]
pub struct Host {
    /// Namespace name (for `ip netns exec`).
    pub name: String,
    /// Its IPv4 address.
    pub ip: String,
    /// Its end of the veth pair.
    pub dev: String,
}

impl Host {
    /// Runs `f` on a fresh thread inside this namespace.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/var/run/netns/{}", self.name);
        std::thread::scope(|s| {
            s.spawn(move || {
                let ns = std::fs::File::open(&path).expect("open netns");
                nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
                f()
            })
            .join()
            .expect("namespace thread")
        })
    }

    /// Shapes this host's egress with a token bucket of `rate` (tc syntax, e.g. `40mbit`).
    pub fn shape(&self, rate: &str) -> Result<(), String> {
        self.qdisc(&["tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"])
    }

    /// Replaces the root qdisc of this host's veth end (its egress):
    /// `args` follow `root`, e.g. `["netem", "loss", "3%", "delay", "2ms"]`.
    pub fn qdisc(&self, args: &[&str]) -> Result<(), String> {
        let mut a: Vec<&str> = vec!["qdisc", "replace", "dev", &self.dev, "root"];
        a.extend_from_slice(args);
        self.tc(&a)
    }

    /// Runs `tc` with `args` inside this namespace.
    pub fn tc(&self, args: &[&str]) -> Result<(), String> {
        let out = Command::new("ip").args(["netns", "exec", &self.name, "tc"]).args(args).output().map_err(|e| format!("tc: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("tc {} on {}: {}", args.join(" "), self.name, String::from_utf8_lossy(&out.stderr).trim()))
        }
    }

    /// Sets this host's veth end up or down; down drops the carrier on
    /// both ends until it is set up again.
    pub fn set_link(&self, up: bool) -> Result<(), String> {
        self.link_set(&[if up { "up" } else { "down" }])
    }

    /// `ip link set` on this host's veth end with `args` (e.g. `["gso_max_segs", "1"]`).
    pub fn link_set(&self, args: &[&str]) -> Result<(), String> {
        let mut a: Vec<&str> = vec!["-n", &self.name, "link", "set", "dev", &self.dev];
        a.extend_from_slice(args);
        ip(&a)
    }
}

/// Two hosts on one link.
#[derive(Debug)]
pub struct Link {
    /// First host (`.1`).
    pub a: Host,
    /// Second host (`.2`).
    pub b: Host,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Whether namespaces can be made here (root and iproute2).
pub fn available() -> bool {
    nix::unistd::geteuid().is_root() && Command::new("ip").arg("-V").output().is_ok()
}

impl Link {
    /// Namespaces `kvwe-<tag>-<pid>-{a,b}` on 10.198.<n>.0/24.
    pub fn new(tag: &str) -> Result<Link, String> {
        let id = std::process::id() % 200;
        let (na, nb) = (format!("kvwe-{tag}-{id}-a"), format!("kvwe-{tag}-{id}-b"));
        let (va, vb) = (format!("ke{id}{}a", &tag[..1]), format!("ke{id}{}b", &tag[..1]));
        for n in [&na, &nb] {
            let _ = ip(&["netns", "del", n]);
            ip(&["netns", "add", n])?;
        }
        let link = Link {
            a: Host { name: na.clone(), ip: format!("10.198.{id}.1"), dev: va.clone() },
            b: Host { name: nb.clone(), ip: format!("10.198.{id}.2"), dev: vb.clone() },
        };
        ip(&["link", "add", &va, "netns", &na, "type", "veth", "peer", "name", &vb, "netns", &nb])?;
        for (n, v, addr) in [(&na, &va, &link.a.ip), (&nb, &vb, &link.b.ip)] {
            ip(&["-n", n, "addr", "add", &format!("{addr}/24"), "dev", v])?;
            ip(&["-n", n, "link", "set", v, "up"])?;
            ip(&["-n", n, "link", "set", "lo", "up"])?;
        }
        Ok(link)
    }

    /// A second veth pair between the same two hosts, on 10.199.<n>.0/24:
    /// another rail. Returns each host as seen on it (same namespace, the
    /// new device and address); it goes when the namespaces do.
    pub fn second_pair(&self) -> Result<(Host, Host), String> {
        let id = std::process::id() % 200;
        let (va, vb) = (format!("{}2", self.a.dev), format!("{}2", self.b.dev));
        let a = Host { name: self.a.name.clone(), ip: format!("10.199.{id}.1"), dev: va.clone() };
        let b = Host { name: self.b.name.clone(), ip: format!("10.199.{id}.2"), dev: vb.clone() };
        ip(&["link", "add", &va, "netns", &a.name, "type", "veth", "peer", "name", &vb, "netns", &b.name])?;
        for h in [&a, &b] {
            ip(&["-n", &h.name, "addr", "add", &format!("{}/24", h.ip), "dev", &h.dev])?;
            ip(&["-n", &h.name, "link", "set", &h.dev, "up"])?;
        }
        Ok((a, b))
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        for h in [&self.a, &self.b] {
            let _ = ip(&["netns", "del", &h.name]);
        }
    }
}
