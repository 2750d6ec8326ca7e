//! Test hosts in network namespaces joined by a veth pair. Each namespace
//! runs closures on a thread that entered it, so sockets made there belong
//! to that "host". Namespaces are removed on drop.

use std::fs::File;
use std::process::Command;

pub struct Host {
    pub name: String,
    pub ip: String,
}

impl Host {
    /// Runs `f` on a fresh thread inside this namespace.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/var/run/netns/{}", self.name);
        std::thread::scope(|s| {
            s.spawn(move || {
                let ns = File::open(&path).expect("open netns");
                nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
                f()
            })
            .join()
            .expect("namespace thread")
        })
    }
}

pub struct Pair {
    pub a: Host,
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

impl Pair {
    /// Namespaces `kvw-<tag>-a` (10.199.<n>.1) and `kvw-<tag>-b` (.2), joined by veth.
    pub fn new(tag: &str) -> Result<Pair, String> {
        let id = std::process::id() % 200;
        let (na, nb) = (format!("kvw-{tag}-{id}-a"), format!("kvw-{tag}-{id}-b"));
        let (va, vb) = (format!("kv{id}{}a", &tag[..1]), format!("kv{id}{}b", &tag[..1]));
        for n in [&na, &nb] {
            let _ = ip(&["netns", "del", n]);
            ip(&["netns", "add", n])?;
        }
        let pair = Pair { a: Host { name: na.clone(), ip: format!("10.199.{id}.1") }, b: Host { name: nb.clone(), ip: format!("10.199.{id}.2") } };
        ip(&["link", "add", &va, "netns", &na, "type", "veth", "peer", "name", &vb, "netns", &nb])?;
        for (n, v, addr) in [(&na, &va, &pair.a.ip), (&nb, &vb, &pair.b.ip)] {
            ip(&["-n", n, "addr", "add", &format!("{addr}/24"), "dev", v])?;
            ip(&["-n", n, "link", "set", v, "up"])?;
            ip(&["-n", n, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for h in [&self.a, &self.b] {
            let _ = ip(&["netns", "del", &h.name]);
        }
    }
}
