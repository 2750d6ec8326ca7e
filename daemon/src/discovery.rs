//! Discovery through etcd. Each daemon registers one entry under a lease
//! that it keeps alive; a submit naming a peer that is not in the static
//! `[[peers]]` list looks the name up here. The entry goes away when the
//! daemon shuts down (its lease is revoked) or, when it dies, once the lease
//! expires (`discovery.lease_ttl_secs`).
//!
//! Key `{prefix}/nodes/{node}`; value: an [`Entry`] as JSON, e.g.
//! `{"name":"b","peer":"10.0.0.2:7400","transport":"tcp","data":["10.0.0.2:7401"],
//! "version":2,"serves":{"models":["toy-digest"],"tenants":["t1"]}}`.
//!
//! One live daemon holds a name: registration creates the key only if it is
//! absent, and otherwise retries until the holder's lease expires. The
//! exception is an entry that advertises this daemon's own peer address:
//! only a dead earlier run of this daemon can have written it (this run has
//! the port bound), so it is taken over at once.
//!
//! etcd-client is async and kvwired is plain threads: one thread,
//! `kvwired-etcd`, owns a current-thread tokio runtime and drives its I/O.
//! One task on it keeps the lease alive and re-puts the entry, under the
//! same lease, when what the daemon serves changes ([`Discovery::changed`]).
//! Other threads call in with `Handle::block_on`, every call bounded by
//! [`CALL_TIMEOUT`]. etcd being away never stops the daemon: it keeps
//! serving, logs a warning, and registers again when etcd answers.

use crate::config::{self, Config, DiscoveryConfig};
use etcd_client::{Client, Compare, CompareOp, ConnectOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use kvwire_core::reuse::CacheIdentity;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::runtime::Handle;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

/// Longest any one etcd call may take, connecting included: a lookup for a
/// submit fails after this, never hangs.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Pause before trying again after a failed registration or keep-alive.
const RETRY: Duration = Duration::from_millis(500);

/// What a daemon tells etcd about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Node name (its `node` setting).
    pub name: String,
    /// Peer-control address other daemons connect to.
    pub peer: String,
    /// Data-plane transport: `tcp`, `shm` or `verbs`.
    pub transport: String,
    /// Data-plane endpoints, one per rail (peers learn the ones to use in
    /// the handshake; these are for people and tools).
    pub data: Vec<String>,
    /// Peer protocol version ([`crate::peer::PEER_VERSION`]).
    pub version: u32,
    /// What its registered cache groups hold.
    pub serves: Serves,
}

impl Entry {
    /// This daemon's entry, serving nothing yet: its peer address is
    /// `discovery.advertise_peer` when set, else `bound_peer`, the address
    /// the peer listener bound.
    pub fn for_daemon(cfg: &Config, bound_peer: &str, transport: kvwire_core::protocol::TransportKind, data: Vec<String>) -> Entry {
        Entry {
            name: cfg.node.clone(),
            peer: cfg.discovery.advertise_peer.clone().unwrap_or_else(|| bound_peer.to_string()),
            transport: transport.as_str().to_string(),
            data,
            version: crate::peer::PEER_VERSION,
            serves: Serves::default(),
        }
    }
}

/// What the cache groups registered on a daemon hold: each list sorted,
/// without duplicates or empty values.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Serves {
    /// Model digests ([`CacheIdentity::model_digest`]).
    pub models: Vec<String>,
    /// Tenants ([`CacheIdentity::tenant`]).
    pub tenants: Vec<String>,
}

impl Serves {
    /// The summary of these groups' identities.
    pub fn of<'a>(ids: impl IntoIterator<Item = &'a CacheIdentity>) -> Serves {
        let (mut models, mut tenants) = (BTreeSet::new(), BTreeSet::new());
        for id in ids {
            models.insert(id.model_digest.as_str());
            tenants.insert(id.tenant.as_str());
        }
        let list = |s: BTreeSet<&str>| s.into_iter().filter(|v| !v.is_empty()).map(String::from).collect();
        Serves { models: list(models), tenants: list(tenants) }
    }
}

/// The etcd key of node `name`'s entry.
pub fn key(prefix: &str, name: &str) -> String {
    format!("{prefix}/nodes/{name}")
}

/// Why a discovery call failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum DiscoveryError {
    /// An etcd call failed, or did not answer within [`CALL_TIMEOUT`].
    #[error("etcd at {endpoints}: {op}: {reason}")]
    Etcd {
        /// Configured endpoints, comma-separated.
        endpoints: String,
        /// What was being done.
        op: String,
        /// The client's error, or the timeout.
        reason: String,
    },
    /// A key under the prefix holds something that is not a node entry.
    #[error("etcd at {endpoints}: {key} is not a kvwire node entry: {reason}")]
    BadEntry {
        /// Configured endpoints, comma-separated.
        endpoints: String,
        /// The key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A name that cannot be a node name, so no entry can have it.
    #[error("`{name}` is not a node name (1-64 characters of [A-Za-z0-9-_.])")]
    BadName {
        /// The name asked for.
        name: String,
    },
    /// Another daemon's entry holds this daemon's name.
    #[error("node `{name}` is registered in etcd at {endpoints} by another daemon at {holder}; if that daemon is dead, its entry expires with its lease")]
    Held {
        /// The name.
        name: String,
        /// Configured endpoints, comma-separated.
        endpoints: String,
        /// The holder's peer address, as its entry says.
        holder: String,
    },
    /// Discovery has been shut down.
    #[error("discovery through etcd at {endpoints} is shut down")]
    Stopped {
        /// Configured endpoints, comma-separated.
        endpoints: String,
    },
    /// The runtime or its thread could not start.
    #[error("cannot start the etcd client thread: {reason}")]
    Thread {
        /// OS error.
        reason: String,
    },
}

/// This daemon's registration in etcd, and lookups of other daemons.
/// Shuts down (revoking the lease) on [`Discovery::shutdown`] or drop.
pub struct Discovery {
    rt: Handle,
    ctx: Arc<Ctx>,
    running: Mutex<Option<Running>>,
}

impl std::fmt::Debug for Discovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Discovery").field("etcd", &self.ctx.endpoints).field("key", &self.ctx.key).finish()
    }
}

/// What shutdown stops: the task keeping the lease, then the runtime's thread.
struct Running {
    task: tokio::task::JoinHandle<()>,
    stop: oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

struct Ctx {
    client: Client,
    endpoints: String,
    prefix: String,
    key: String,
    ttl_secs: i64,
    /// The entry as registered; `serves` is refilled from `serves()` at each put.
    me: Entry,
    serves: Box<dyn Fn() -> Serves + Send + Sync>,
    /// The lease the entry is under; 0 when none is held.
    lease: AtomicI64,
    changed: Notify,
}

/// Why keeping the lease stopped.
enum Ended {
    /// etcd says the lease is gone (expired, or etcd lost it): register anew.
    Lost(String),
    /// A call failed; the lease may still be alive: keep it again.
    Failed(DiscoveryError),
}

impl Discovery {
    /// Connects to `cfg.etcd` and registers `me`, whose `serves` is then
    /// kept equal to what `serves()` returns. A first registration is tried
    /// before this returns (so a daemon that says it is ready is normally
    /// findable); if etcd does not answer, it is retried in the background.
    /// Fails only when the client or its thread cannot be set up.
    pub fn start(cfg: &DiscoveryConfig, me: Entry, serves: impl Fn() -> Serves + Send + Sync + 'static) -> Result<Discovery, DiscoveryError> {
        let endpoints = cfg.etcd.join(",");
        let thread_err = |e: std::io::Error| DiscoveryError::Thread { reason: e.to_string() };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(thread_err)?;
        let handle = rt.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("kvwired-etcd".into())
            .spawn(move || {
                rt.block_on(async {
                    let _ = stopped.await;
                });
            })
            .map_err(thread_err)?;
        let opts = ConnectOptions::new().with_connect_timeout(CALL_TIMEOUT).with_keep_alive(CALL_TIMEOUT, CALL_TIMEOUT);
        let etcd = cfg.etcd.clone();
        // The channel connects lazily: this fails only on a malformed endpoint.
        let client = match handle.block_on(async move { Client::connect(etcd, Some(opts)).await }) {
            Ok(c) => c,
            Err(e) => {
                let _ = stop.send(());
                let _ = thread.join();
                return Err(DiscoveryError::Etcd { endpoints, op: "connect".into(), reason: e.to_string() });
            }
        };
        let ctx = Arc::new(Ctx {
            client,
            key: key(&cfg.prefix, &me.name),
            prefix: cfg.prefix.clone(),
            endpoints,
            ttl_secs: cfg.lease_ttl_secs as i64,
            me,
            serves: Box::new(serves),
            lease: AtomicI64::new(0),
            changed: Notify::new(),
        });
        let first = handle.block_on(ctx.register());
        let registered = match first {
            Ok(e) => Some(e),
            Err(e) => {
                tracing::warn!(error = %e, "not registered in etcd yet; retrying in the background");
                None
            }
        };
        let task = handle.spawn(ctx.clone().maintain(registered));
        Ok(Discovery { rt: handle, ctx, running: Mutex::new(Some(Running { task, stop, thread })) })
    }

    /// What this daemon serves changed: its entry is put again, under the
    /// same lease, in the background. Cheap; changes in a burst coalesce.
    pub fn changed(&self) {
        self.ctx.changed.notify_one();
    }

    /// The configured etcd endpoints, comma-separated (for messages).
    pub fn endpoints(&self) -> &str {
        &self.ctx.endpoints
    }

    /// Node `name`'s entry, or `None` when no live daemon registered it.
    /// Takes at most [`CALL_TIMEOUT`]. Call it from a plain thread.
    pub fn lookup(&self, name: &str) -> Result<Option<Entry>, DiscoveryError> {
        if !config::is_node_name(name) {
            return Err(DiscoveryError::BadName { name: name.into() });
        }
        if self.running.lock().expect("discovery lock").is_none() {
            return Err(DiscoveryError::Stopped { endpoints: self.ctx.endpoints.clone() });
        }
        let key = key(&self.ctx.prefix, name);
        let ctx = self.ctx.clone();
        let k = key.clone();
        let got = self.rt.block_on(async move { ctx.call("get", ctx.client.clone().get(k, None)).await })?;
        let Some(kv) = got.kvs().first() else { return Ok(None) };
        let bad = |reason: String| DiscoveryError::BadEntry { endpoints: self.ctx.endpoints.clone(), key: key.clone(), reason };
        let e: Entry = serde_json::from_slice(kv.value()).map_err(|e| bad(e.to_string()))?;
        if e.name != name {
            return Err(bad(format!("it names node `{}`", e.name)));
        }
        Ok(Some(e))
    }

    /// Stops keeping the lease and revokes it, so the entry goes at once
    /// (bounded by [`CALL_TIMEOUT`]; if etcd does not answer, the entry
    /// expires with the lease). Idempotent.
    pub fn shutdown(&self) {
        let Some(r) = self.running.lock().expect("discovery lock").take() else { return };
        r.task.abort();
        // Dropped on the etcd thread itself, there is no blocking on it.
        if std::thread::current().id() == r.thread.thread().id() {
            let _ = r.stop.send(());
            return;
        }
        let ctx = self.ctx.clone();
        let task = r.task;
        let revoked = self.rt.block_on(async move {
            // The task is gone before the lease is read: it cannot grant another.
            let _ = task.await;
            match ctx.lease.swap(0, Ordering::AcqRel) {
                0 => Ok(None),
                id => ctx.call("revoke the lease", ctx.client.clone().lease_revoke(id)).await.map(|_| Some(id)),
            }
        });
        match revoked {
            Ok(Some(id)) => tracing::info!(key = self.ctx.key, lease = id, "lease revoked: entry removed from etcd"),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "lease not revoked: the entry stays until it expires"),
        }
        let _ = r.stop.send(());
        let _ = r.thread.join();
    }
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Ctx {
    /// One etcd call, bounded by [`CALL_TIMEOUT`].
    async fn call<T>(&self, op: &str, f: impl Future<Output = Result<T, etcd_client::Error>>) -> Result<T, DiscoveryError> {
        let reason = match tokio::time::timeout(CALL_TIMEOUT, f).await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {}s", CALL_TIMEOUT.as_secs()),
        };
        Err(self.etcd_err(op, reason))
    }

    fn etcd_err(&self, op: &str, reason: impl std::fmt::Display) -> DiscoveryError {
        DiscoveryError::Etcd { endpoints: self.endpoints.clone(), op: op.into(), reason: reason.to_string() }
    }

    fn entry(&self) -> Entry {
        Entry { serves: (self.serves)(), ..self.me.clone() }
    }

    fn put_op(&self, e: &Entry, lease: i64) -> TxnOp {
        let value = serde_json::to_string(e).expect("an entry serializes");
        TxnOp::put(self.key.clone(), value, Some(PutOptions::new().with_lease(lease)))
    }

    /// Grants a lease and creates the entry under it, unless another live
    /// daemon holds the name. Returns what was put.
    async fn register(&self) -> Result<Entry, DiscoveryError> {
        let me = self.entry();
        let id = self.call("grant a lease", self.client.clone().lease_grant(self.ttl_secs, None)).await?.id();
        self.lease.store(id, Ordering::Release);
        let give_up = |e: DiscoveryError| {
            // Unrevoked, the lease holds no key and expires by itself.
            self.lease.store(0, Ordering::Release);
            e
        };
        let create = Txn::new()
            .when([Compare::create_revision(self.key.clone(), CompareOp::Equal, 0)])
            .and_then([self.put_op(&me, id)])
            .or_else([TxnOp::get(self.key.clone(), None)]);
        let r = self.call("create the entry", self.client.clone().txn(create)).await.map_err(give_up)?;
        if r.succeeded() {
            tracing::info!(key = self.key, lease = id, ttl = self.ttl_secs, "registered in etcd");
            return Ok(me);
        }
        let held = r.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(g) => g.kvs().first().cloned(),
            _ => None,
        });
        let holder = held.as_ref().and_then(|kv| serde_json::from_slice::<Entry>(kv.value()).ok());
        if let (Some(kv), Some(h)) = (&held, &holder) {
            if h.peer == me.peer {
                let take = Txn::new().when([Compare::mod_revision(self.key.clone(), CompareOp::Equal, kv.mod_revision())]).and_then([self.put_op(&me, id)]);
                if self.call("take over the entry", self.client.clone().txn(take)).await.map_err(give_up)?.succeeded() {
                    tracing::info!(key = self.key, lease = id, "registered in etcd, over the entry of an earlier run at this address");
                    return Ok(me);
                }
            }
        }
        let _ = self.call("revoke the lease", self.client.clone().lease_revoke(id)).await;
        Err(give_up(DiscoveryError::Held {
            name: me.name.clone(),
            endpoints: self.endpoints.clone(),
            holder: holder.map_or_else(|| "(an unreadable entry)".into(), |h| h.peer),
        }))
    }

    /// Registers, keeps the lease alive and re-puts the entry on changes,
    /// until aborted. `registered` is what [`Ctx::register`] put, if it did.
    async fn maintain(self: Arc<Self>, mut registered: Option<Entry>) {
        // Keep-alives three times per TTL: the lease has two thirds of its
        // time left whenever one is due.
        let beat = Duration::from_millis(self.ttl_secs as u64 * 1000 / 3).max(RETRY);
        // The failure last logged: a failure repeating while etcd is away
        // is logged once.
        let mut failing: Option<String> = None;
        loop {
            let Some(mut held) = registered.take() else {
                match self.register().await {
                    Ok(e) => {
                        failing = None;
                        registered = Some(e);
                    }
                    Err(e) => {
                        warn_once(&mut failing, &e);
                        tokio::time::sleep(RETRY).await;
                    }
                }
                continue;
            };
            match self.keep(&mut held, beat, &mut failing).await {
                Ended::Lost(why) => {
                    warn_once(&mut failing, &why);
                    self.lease.store(0, Ordering::Release);
                }
                Ended::Failed(e) => {
                    warn_once(&mut failing, &e);
                    tokio::time::sleep(RETRY).await;
                    registered = Some(held);
                }
            }
        }
    }

    /// Keeps the current lease alive every `beat`, and puts the entry again
    /// when `changed` fires and it differs from `held`. A kept beat clears
    /// `failing`.
    async fn keep(&self, held: &mut Entry, beat: Duration, failing: &mut Option<String>) -> Ended {
        let id = self.lease.load(Ordering::Acquire);
        let op = "keep the lease alive";
        let opened = tokio::time::timeout(CALL_TIMEOUT, self.client.clone().lease_keep_alive(id)).await;
        let (mut keeper, mut stream) = match opened {
            Ok(Ok(x)) => x,
            // Opening sends one keep-alive; the client reports a TTL of 0
            // (lease unknown: expired, or a fresh etcd) as this error.
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(why))) => {
                return Ended::Lost(format!("lease {id:x} of {} in etcd at {}: {why}: registering again", self.key, self.endpoints))
            }
            Ok(Err(e)) => return Ended::Failed(self.etcd_err(op, e)),
            Err(_) => return Ended::Failed(self.etcd_err(op, format_args!("no answer within {}s", CALL_TIMEOUT.as_secs()))),
        };
        let mut next = Instant::now() + beat;
        loop {
            if tokio::time::timeout_at(next, self.changed.notified()).await.is_ok() {
                let now = self.entry();
                if now != *held {
                    let value = serde_json::to_string(&now).expect("an entry serializes");
                    let mut c = self.client.clone();
                    if let Err(e) = self.call("put the entry", c.put(self.key.clone(), value, Some(PutOptions::new().with_lease(id)))).await {
                        // Put it again once the lease is kept (or re-granted).
                        self.changed.notify_one();
                        return Ended::Failed(e);
                    }
                    tracing::debug!(key = self.key, serves = ?now.serves, "entry updated");
                    *held = now;
                }
                continue;
            }
            next = Instant::now() + beat;
            if let Err(e) = keeper.keep_alive().await {
                return Ended::Failed(self.etcd_err(op, e));
            }
            match self.call(op, stream.message()).await {
                Ok(Some(r)) if r.ttl() > 0 => *failing = None,
                Ok(Some(_)) => return Ended::Lost(format!("lease {id:x} of {} is gone from etcd at {}: registering again", self.key, self.endpoints)),
                Ok(None) => return Ended::Failed(self.etcd_err(op, "stream closed")),
                Err(e) => return Ended::Failed(e),
            }
        }
    }
}

fn warn_once(failing: &mut Option<String>, e: &dyn std::fmt::Display) {
    let e = e.to_string();
    if failing.as_deref() != Some(e.as_str()) {
        tracing::warn!(error = e, "etcd discovery");
        *failing = Some(e);
    }
}
