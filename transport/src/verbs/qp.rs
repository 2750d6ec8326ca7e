//! RC queue pairs: creation, the RESET → INIT → RTR → RTS steps (errors
//! name the attribute that was refused), receives, and completions.

use super::shared::Shared;
use super::notes::NoteRing;
use super::{chain, mtu_bytes, os_code, verbs_err, NOTE_BUF};
use crate::flags::monotonic_ns;
use crate::TransportError;
use kvwire_core::protocol::VerbsAddr;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, CompletionChannel, CompletionQueue as _, PollCompletionQueueError, WorkCompletionOperationType,
    WorkCompletionStatus,
};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairState, SetScatterGatherEntry,
};
use sideway::ibverbs::AccessFlags;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::time::Duration;

/// One RC queue pair with its own CQ (send and receive share it).
pub(super) struct Qp {
    // Field order is drop order: destroy the QP (which stops the NIC's work
    // on it) before its CQ; the QP also holds the CQ and PD alive itself.
    pub(super) qp: BasicQueuePair,
    pub(super) cq: Arc<BasicCompletionQueue>,
    // Raises an event on the CQ's next completion once armed: an idle
    // side sleeps on it rather than polling (see `rest`).
    channel: Arc<CompletionChannel>,
    // The CQ was armed and its event not taken yet.
    armed: bool,
    pub(super) psn: u32,
}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qp").field("qpn", &self.qp.qp_number()).field("psn", &self.psn).finish()
    }
}

impl Qp {
    /// A new RC QP in INIT, whose writes gather up to `send_sge` SGEs.
    pub(super) fn new(shared: &Shared, send_depth: u32, recv_depth: u32, send_sge: u32) -> Result<Qp, TransportError> {
        let dev = &shared.info.device;
        let channel = CompletionChannel::new(&shared.ctx).map_err(|e| verbs_err("ibv_create_comp_channel", format!("{dev}: {}", chain(&e))))?;
        channel.set_nonblocking(true).map_err(|e| verbs_err("ibv_create_comp_channel", format!("{dev}: its fd cannot be made nonblocking: {e}")))?;
        let cq = shared
            .ctx
            .create_cq_builder()
            .setup_cqe(send_depth + recv_depth + 1)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|e| verbs_err("ibv_create_cq", format!("{dev}, {} entries: {}", send_depth + recv_depth + 1, chain(&e))))?;
        let qp = shared
            .pd
            .create_qp_builder()
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone())
            .setup_max_send_wr(send_depth.max(1))
            .setup_max_recv_wr(recv_depth.max(1))
            .setup_max_send_sge(send_sge.max(1))
            .setup_max_recv_sge(1)
            .build()
            .map_err(|e| {
                verbs_err(
                    "ibv_create_qp",
                    format!("{dev}: RC QP with {send_depth} send / {recv_depth} receive entries: {} (lower send_depth/recv_depth?)", chain(&e)),
                )
            })?;
        let psn = (monotonic_ns() as u32 ^ (monotonic_ns() >> 20) as u32) & 0x00FF_FFFF;
        let mut q = Qp { qp, cq, channel, armed: false, psn };
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(shared.info.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        q.modify(&attr, "RESET→INIT", format!("port {} / pkey index 0 / access LOCAL_WRITE|REMOTE_WRITE", shared.info.port))?;
        Ok(q)
    }

    fn modify(&mut self, attr: &QueuePairAttribute, step: &str, attrs: String) -> Result<(), TransportError> {
        self.qp.modify(attr).map_err(|e| {
            let hint = match os_code(&e) {
                Some(c) if c == nix::errno::Errno::ETIMEDOUT as i32 || c == nix::errno::Errno::ENETUNREACH as i32 => {
                    "; the destination GID has no route: check both sides use a GID of an interface that is up and addressed (soft-RoCE: the IPv4-mapped GID, index 1)"
                }
                Some(c) if c == nix::errno::Errno::EINVAL as i32 => {
                    "; the device rejected one of these attributes for this state (a GID index missing from the table, an MTU above the port's, or a wrong state)"
                }
                _ => "",
            };
            verbs_err("ibv_modify_qp", format!("QP {:#x} {step} with {attrs}: {}{hint}", self.qp.qp_number(), chain(&e)))
        })
    }

    /// INIT → RTR → RTS against the peer's address.
    pub(super) fn connect(&mut self, shared: &Shared, peer: &VerbsAddr) -> Result<(), TransportError> {
        let info = &shared.info;
        let mtu = info.mtu.min(peer.mtu);
        let gid = Gid { raw: peer.gid };
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(Mtu::from(u32::from(mtu)))
            .setup_dest_qp_num(peer.qpn)
            .setup_rq_psn(peer.psn)
            .setup_max_dest_read_atomic(0)
            .setup_min_rnr_timer(1);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(peer.lid)
            .setup_port(info.port)
            .setup_service_level(0)
            .setup_grh_src_gid_index(info.gid_index as u8)
            .setup_grh_dest_gid(&gid)
            .setup_grh_hop_limit(64);
        attr.setup_address_vector(&ah);
        self.modify(
            &attr,
            "INIT→RTR",
            format!(
                "path MTU {} / dest QPN {:#x} / rq PSN {:#x} / port {} / source GID index {} / dest GID {gid} / dest LID {}",
                mtu_bytes(mtu),
                peer.qpn,
                peer.psn,
                info.port,
                info.gid_index,
                peer.lid
            ),
        )?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(0);
        self.modify(&attr, "RTR→RTS", format!("sq PSN {:#x} / timeout 14 / retry 7 / rnr retry 7", self.psn))
    }

    /// Posts a receive into each of `slots` of `ring` (`wr_id` = slot).
    pub(super) fn post_recvs(&mut self, ring: &NoteRing, slots: impl Iterator<Item = u32>) -> Result<(), TransportError> {
        let mut guard = self.qp.start_post_recv();
        let mut n = 0;
        for slot in slots {
            // SAFETY: the slot lies inside the ring's MR; `serve` declares
            // the ring before the QP, so it is dropped after the QP and the
            // NIC never writes into freed memory.
            unsafe { guard.construct_wr(u64::from(slot)).setup_sge(ring.mr.lkey(), ring.addr(slot), NOTE_BUF as u32) };
            n += 1;
        }
        guard.post().map_err(|e| verbs_err("ibv_post_recv", format!("{n} receives: {}", chain(&e))))
    }

    /// One step of an idle wait, once spinning found nothing: the first
    /// call arms the CQ for an event on its next completion and returns,
    /// so the caller drains it once more (a completion that came before
    /// arming raises none); later calls sleep until that event, `also`
    /// turns readable, or `timeout` passes.
    pub(super) fn rest(&mut self, also: Option<BorrowedFd<'_>>, timeout: Duration) -> Result<(), TransportError> {
        if !self.armed {
            // SAFETY: the CQ lives as long as `self`.
            let rc = unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
            if rc != 0 {
                return Err(verbs_err("ibv_req_notify_cq", std::io::Error::from_raw_os_error(rc.abs()).to_string()));
            }
            self.armed = true;
        } else if self.wait(also, timeout)? {
            self.armed = false;
        }
        Ok(())
    }

    /// Sleeps until the armed CQ raises its event, `also` turns readable,
    /// or `timeout` passes; true when the CQ's event was taken.
    fn wait(&self, also: Option<BorrowedFd<'_>>, timeout: Duration) -> Result<bool, TransportError> {
        use nix::poll::{poll, PollFd, PollFlags};
        // SAFETY: the channel's fd stays open as long as the channel.
        let ch = unsafe { BorrowedFd::borrow_raw(self.channel.as_raw_fd()) };
        let mut fds = vec![PollFd::new(ch, PollFlags::POLLIN)];
        fds.extend(also.map(|fd| PollFd::new(fd, PollFlags::POLLIN)));
        match poll(&mut fds, crate::answers::poll_timeout(timeout)) {
            Ok(n) if n > 0 => {}
            Ok(_) | Err(nix::errno::Errno::EINTR) => return Ok(false),
            Err(e) => return Err(verbs_err("poll", format!("completion channel: {e}"))),
        }
        if !fds[0].revents().is_some_and(|r| r.intersects(PollFlags::POLLIN)) {
            return Ok(false);
        }
        let (mut cq, mut ctx) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: the channel is live; being nonblocking, it answers EAGAIN
        // when another wake took the event first.
        if unsafe { rdma_mummy_sys::ibv_get_cq_event(self.channel.comp_channel().as_ptr(), &mut cq, &mut ctx) } != 0 {
            return Ok(false);
        }
        // Acknowledged at once: destroying the CQ waits for every event taken.
        // SAFETY: `cq` is this QP's CQ, which raised the event.
        unsafe { rdma_mummy_sys::ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }

    /// Completions available now, copied out of the CQ.
    pub(super) fn drain(&self) -> Result<Vec<Wc>, TransportError> {
        match self.cq.start_poll() {
            Ok(poller) => Ok(poller
                .map(|wc| Wc { wr_id: wc.wr_id(), status: wc.status(), opcode: wc.opcode(), vendor_err: wc.vendor_err(), byte_len: wc.byte_len() })
                .collect()),
            Err(PollCompletionQueueError::CompletionQueueEmpty) => Ok(Vec::new()),
            Err(e) => Err(verbs_err("ibv_poll_cq", chain(&e))),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Wc {
    pub(super) wr_id: u64,
    pub(super) status: u32,
    pub(super) opcode: u32,
    pub(super) vendor_err: u32,
    pub(super) byte_len: u32,
}

pub(super) const WC_SUCCESS: u32 = WorkCompletionStatus::Success as u32;
const WC_REM_ACCESS: u32 = WorkCompletionStatus::RemoteAccessError as u32;
pub(super) const WC_FLUSH: u32 = WorkCompletionStatus::WorkRequestFlushedError as u32;
const WC_RETRY_EXC: u32 = WorkCompletionStatus::RetryCounterExceededError as u32;
const WC_RNR_RETRY_EXC: u32 = WorkCompletionStatus::ResponderNotReadyRetryCounterExceededError as u32;
const WC_LOC_QP_OP: u32 = WorkCompletionStatus::LocalQueuePairOperationError as u32;
const WC_LOC_PROT: u32 = WorkCompletionStatus::LocalProtectionError as u32;
const WC_LOC_LEN: u32 = WorkCompletionStatus::LocalLengthError as u32;
const WC_REM_INV_REQ: u32 = WorkCompletionStatus::RemoteInvalidRequestError as u32;
const WC_REM_OP: u32 = WorkCompletionStatus::RemoteOperationError as u32;
pub(super) const WC_RECV: u32 = WorkCompletionOperationType::Receive as u32;

/// What a failed completion means, and what to do about it.
pub(super) fn wc_error(wc: &Wc) -> String {
    let what = match wc.status {
        WC_REM_ACCESS => "remote access error: the destination NIC refused the write — its region was revoked \
                          (MR deregistered), the rkey is stale, or the write falls outside the registered window",
        WC_FLUSH => "flushed: the queue pair had already entered the error state after an earlier failure; reconnect",
        WC_RETRY_EXC => "transport retry counter exceeded: no acknowledgement from the peer (peer gone, its QP \
                         destroyed, or unreachable with this GID/netdev)",
        WC_RNR_RETRY_EXC => "receiver not ready: the destination had no receive posted for a write note",
        WC_LOC_QP_OP => "local QP operation error: the device could not send the work request (its netdev is down, \
                         or has no route to the peer's GID)",
        WC_LOC_PROT => "local protection error: the source range is not covered by a local MR (source region deregistered?)",
        WC_LOC_LEN => "local length error: the work request is longer than the device allows",
        WC_REM_INV_REQ => "remote invalid request: the destination rejected the request (length beyond its limit, or RDMA write not enabled on its QP)",
        WC_REM_OP => "remote operation error: the destination could not complete the write (its receive queue or QP failed)",
        _ => "work request failed",
    };
    format!("{what} (ibv_wc_status {}, vendor error {:#x})", wc.status, wc.vendor_err)
}
