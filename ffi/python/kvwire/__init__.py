"""kvwire's Python client: ctypes over the C ABI (libkvwire_ffi.so).

No third-party packages are needed; ``numpy()`` views need numpy and
``torch()`` views torch, imported only when asked for. The library is found,
in order, at ``$KVWIRE_FFI_LIB``, beside this package (an installed wheel
carries it), in the workspace's ``target/debug`` or ``target/release``
(relative to this file), or by the system loader.

Ownership follows the C API (ffi/include/kvwire.h): a :class:`Client` or
:class:`Mem` owns its handle and frees it on :meth:`close` (or at the end of
a ``with`` block); keep a :class:`Mem` alive until its cache is released.
Every failure raises :class:`KvwireError`, carrying the numbered code and,
for daemon errors, the daemon's message.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
from typing import Any, Dict, Optional, Sequence, Tuple, Union

# A model: {"builtin": NAME}, {"hf_config": TEXT or PATH}, {"toml": TEXT or PATH}, or its JSON.
Model = Union[Dict[str, str], str]
# A cache identity (model_digest, adapter_digest, format, tenant, rope, position_offset), or its JSON.
Identity = Union[Dict[str, Any], str]
Text = Union[str, bytes]

__all__ = [
    "KvwireError",
    "Client",
    "Mem",
    "SharedMemory",
    "TensorSpec",
    "DeviceMemory",
    "preset_shape",
    "layout_pad",
    "vllm_layout",
    "cuda_ipc_handle",
    "cuda_share",
    "device_memories",
    "PRESETS",
    "cache_size",
    "strerror",
    "RESULTS",
    "LAYER_READY",
    "DECODER_USABLE",
    "SOURCE_RELEASED",
    "STATES",
]

# kvw_result: numbered by family, the daemon's codes where they exist.
RESULTS = {
    0: "KVW_OK",
    1: "KVW_PANIC",
    2: "KVW_NULL_ARGUMENT",
    3: "KVW_INVALID_UTF8",
    4: "KVW_IO",
    5: "KVW_BUFFER_TOO_SMALL",
    6: "KVW_INVALID_JSON",
    7: "KVW_INVALID_ARGUMENT",
    8: "KVW_UNEXPECTED_REPLY",
    9: "KVW_UNKNOWN_DAEMON_ERROR",
    100: "KVW_MALFORMED",
    101: "KVW_BAD_MODEL",
    102: "KVW_BAD_LAYOUT",
    103: "KVW_BAD_REGION",
    104: "KVW_UNKNOWN_GROUP",
    105: "KVW_UNKNOWN_SLOT",
    106: "KVW_INCOMPLETE_GROUP",
    107: "KVW_MISMATCH",
    108: "KVW_LIMIT",
    109: "KVW_NOT_PREPARED",
    110: "KVW_BAD_REQUEST",
    200: "KVW_UNKNOWN_PEER",
    201: "KVW_PEER_UNREACHABLE",
    202: "KVW_AUTH_FAILED",
    203: "KVW_PEER_REFUSED",
    300: "KVW_TRANSFER_FAILED",
    301: "KVW_TIMEOUT",
    302: "KVW_CANCELLED",
    400: "KVW_PERMISSION_DENIED",
}
globals().update({name: code for code, name in RESULTS.items()})

# kvw_flag
LAYER_READY = 0
DECODER_USABLE = 1
SOURCE_RELEASED = 2

# kvw_state
STATES = {0: "prepared", 1: "running", 2: "done", 3: "failed", 4: "cancelled"}

MESSAGE_MAX = 1024  # KVW_MESSAGE_MAX


def _find_library() -> str:
    env = os.environ.get("KVWIRE_FFI_LIB")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    bundled = os.path.join(here, "libkvwire_ffi.so")
    if os.path.exists(bundled):
        return bundled
    for profile in ("debug", "release"):
        p = os.path.join(here, "..", "..", "..", "target", profile, "libkvwire_ffi.so")
        if os.path.exists(p):
            return os.path.normpath(p)
    found = ctypes.util.find_library("kvwire_ffi")
    if found:
        return found
    raise OSError("libkvwire_ffi.so not found: build it (cargo build -p kvwire-ffi) or set KVWIRE_FFI_LIB")


_lib = ctypes.CDLL(_find_library())

_c = ctypes.c_char_p
_u16, _u32, _u64, _sz = ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_size_t
_vp = ctypes.c_void_p
_P = ctypes.POINTER


def _sig(name, res, *args):
    f = getattr(_lib, name)
    f.restype = res
    f.argtypes = list(args)
    return f


_strerror = _sig("kvw_strerror", _u32, _u32, ctypes.c_char_p, _sz, _P(_sz))
_last_error = _sig("kvw_last_error", _u32, ctypes.c_char_p, _sz, _P(_sz))
_client_last_error = _sig("kvw_client_last_error", _u32, _vp, ctypes.c_char_p, _sz, _P(_sz))
_mem_new = _sig("kvw_mem_new", _u32, _sz, _P(_vp))
_mem_ptr = _sig("kvw_mem_ptr", _vp, _vp)
_mem_len = _sig("kvw_mem_len", _sz, _vp)
_mem_free = _sig("kvw_mem_free", None, _vp)
_cache_size = _sig("kvw_cache_size", _u32, _c, _c, _c, _u32, _u32, _P(_u32), _P(_u64))
_connect = _sig("kvw_client_connect", _u32, _c, _c, _P(_vp))
_client_free = _sig("kvw_client_free", None, _vp)
_client_node = _sig("kvw_client_node", _u32, _vp, ctypes.c_char_p, _sz, _P(_sz))
_set_wait_spin = _sig("kvw_client_set_wait_spin", _u32, _vp, _u32)
_register = _sig(
    "kvw_register_cache", _u32, _vp, _c, _c, _c, _c, _u32, _u32, _c, _vp, _P(_u32), _P(_u64), _P(ctypes.c_bool)
)
_register_device = _sig(
    "kvw_register_device_cache",
    _u32, _vp, _c, _c, _c, _c, _u32, _u32, _c, _u32, _u64, ctypes.c_int, _P(ctypes.c_uint8), _sz,
    _P(_u32), _P(_u64), _P(ctypes.c_bool),
)
_register_tensors = _sig(
    "kvw_register_tensors",
    _u32, _vp, _c, _c, _c, _c, _u32, _u32, _c, _c, _P(ctypes.c_int), _sz, _P(_u32), _P(_u64), _P(ctypes.c_bool),
)
_register_device_tensors = _sig(
    "kvw_register_device_tensors",
    _u32, _vp, _c, _c, _c, _c, _u32, _u32, _c, _c, _c, _P(ctypes.c_int), _sz, _P(_u32), _P(_u64), _P(ctypes.c_bool),
)
_prepare = _sig("kvw_prepare_receive_from", _u32, _vp, _c, _c, _P(_u32), _sz, _u64, _u64, _c, _P(_u16), _P(ctypes.c_int))
_submit = _sig("kvw_submit", _u32, _vp, _c, _c, _P(_u32), _sz, _u64, _c, _c, _c, _P(_u16), _P(_u16))
_submit_streamed = _sig("kvw_submit_streamed", _u32, _vp, _c, _c, _P(_u32), _sz, _u64, _c, _c, _c, _P(_u16), _P(_u16))
_produced = _sig("kvw_produced", _u32, _vp, _c, _c, _u32, _u16)
_wait = _sig("kvw_wait", _u32, _vp, _u16, _u32, _u32, _u64, _P(_u64))
_is_ready = _sig("kvw_is_ready", _u32, _vp, _u16, _u32, _u32, _P(ctypes.c_bool))
_status = _sig("kvw_status", _u32, _vp, _u16, _P(_u32))
_status_json = _sig("kvw_status_json", _u32, _vp, _u16, ctypes.c_char_p, _sz, _P(_sz))
_cancel = _sig("kvw_cancel", _u32, _vp, _u16)
_release = _sig("kvw_release_cache", _u32, _vp, _c, _u32)
_share = _sig("kvw_share_group", _u32, _vp, _c, _c)


def _tensor_list(tensors: Sequence["TensorSpec"]) -> Tuple[list, list]:
    """The distinct memories ``tensors`` live in, in order of first use,
    and each tensor's description naming its memory by that index."""
    mems: list = []
    for t in tensors:
        if not any(t.memory is m for m in mems):
            mems.append(t.memory)
    return mems, [t.describe(next(i for i, m in enumerate(mems) if m is t.memory)) for t in tensors]


def _text(fn, *args):
    buf = ctypes.create_string_buffer(MESSAGE_MAX)
    n = _sz(0)
    rc = fn(*args, buf, MESSAGE_MAX, ctypes.byref(n))
    if rc != 0:
        return ""
    return buf.raw[: n.value].decode("utf-8", "replace")


def strerror(code: int) -> str:
    """The text naming result ``code``."""
    return _text(_strerror, code)


class KvwireError(Exception):
    """A kvwire call failed: ``code`` (int), ``name`` (``KVW_…``) and
    ``message`` (the daemon's or the library's own)."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.name = RESULTS.get(code, "KVW_%d" % code)
        self.message = message
        super().__init__("%s (%d): %s%s" % (self.name, code, strerror(code), ": " + message if message else ""))


def _b(s):
    if isinstance(s, bytes):
        return s
    return s.encode("utf-8")


def _json(v):
    return _b(v if isinstance(v, (str, bytes)) else json.dumps(v))


def _table(ids):
    arr = (_u32 * len(ids))(*ids)
    return arr, len(ids)


def _check(rc, client=None):
    if rc != 0:
        msg = _text(_client_last_error, client) if client else _text(_last_error)
        raise KvwireError(rc, msg)


def cache_size(model: Model, fmt: str, layout: str, rank: int, num_blocks: int) -> Tuple[int, int]:
    """(regions, bytes) rank ``rank`` of ``layout`` holds: the size of the
    :class:`Mem` to register for it. ``model`` is a dict such as
    ``{"builtin": "llama-3.1-8b"}`` or ``{"toml": TEXT}``, or its JSON."""
    regions, nbytes = _u32(0), _u64(0)
    _check(_cache_size(_json(model), _b(fmt), _b(layout), rank, num_blocks, ctypes.byref(regions), ctypes.byref(nbytes)))
    return regions.value, nbytes.value


class _Handle:
    """Owns one C handle: freed once, by close(), `with`, or collection."""
    _h = None

    @property
    def handle(self) -> int:
        if self._h is None:
            raise ValueError("%s is closed" % type(self).__name__)
        return self._h

    def close(self) -> None:
        if self._h is not None:
            type(self)._free(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Mem(_Handle):
    """A memfd-backed, shared host buffer holding one rank's cache."""

    def __init__(self, length: int) -> None:
        h = _vp()
        _check(_mem_new(length, ctypes.byref(h)))
        self._h = h.value

    @property
    def ptr(self) -> int:
        """Address of the first byte (valid until close)."""
        return _mem_ptr(self.handle)

    def __len__(self) -> int:
        return _mem_len(self.handle)

    def write(self, offset: int, data: bytes) -> None:
        if offset < 0 or offset + len(data) > len(self):
            raise IndexError("write of %d bytes at %d past %d" % (len(data), offset, len(self)))
        ctypes.memmove(self.ptr + offset, data, len(data))

    def read(self, offset: int = 0, length: Optional[int] = None) -> bytes:
        length = len(self) - offset if length is None else length
        if offset < 0 or offset + length > len(self):
            raise IndexError("read of %d bytes at %d past %d" % (length, offset, len(self)))
        return ctypes.string_at(self.ptr + offset, length)

    def fill(self, byte: int) -> None:
        ctypes.memset(self.ptr, byte, len(self))

    def numpy(self, dtype: Any = "uint8", shape: Optional[Sequence[int]] = None, offset: int = 0, strides: Optional[Sequence[int]] = None) -> Any:
        """A zero-copy numpy view of the buffer (``strides`` in elements);
        it keeps this Mem alive, and must not be used after :meth:`close`."""
        return _views.numpy_view(self.ptr, len(self), self, dtype, shape, offset, strides)

    def torch(self, dtype: Any, shape: Sequence[int], offset: int = 0, strides: Optional[Sequence[int]] = None) -> Any:
        """A zero-copy torch view of the buffer (torch imported on first use)."""
        return _views.torch_view(self.ptr, len(self), self, dtype, shape, offset, strides)

    _free = staticmethod(lambda h: _mem_free(h))


class Client(_Handle):
    """A connection to the local kvwired (its flag page mapped)."""

    def __init__(self, socket_path: Text, name: Text = "python") -> None:
        h = _vp()
        _check(_connect(_b(socket_path), _b(name), ctypes.byref(h)))
        self._h = h.value

    def _call(self, fn, *args):
        _check(fn(self.handle, *args), self.handle)

    @property
    def node(self) -> str:
        """The daemon's node name (what a source names as ``peer``)."""
        buf = ctypes.create_string_buffer(MESSAGE_MAX)
        n = _sz(0)
        self._call(_client_node, buf, MESSAGE_MAX, ctypes.byref(n))
        return buf.raw[: n.value].decode()

    def last_error(self) -> str:
        return _text(_client_last_error, self.handle)

    def set_wait_spin(self, micros: int) -> None:
        """The longest a wait polls the flag page, and a call polls for the
        daemon's reply, before it sleeps, in microseconds (0: every wait
        sleeps at once; 200 unless set). Each polls only while this client's
        waits of its kind have been that short, yielding the core to any
        thread that wants it. A thread asleep on an idle core wakes only once
        that core leaves its halt, tens of microseconds on a virtual machine;
        an engine whose own threads want every core may prefer 0."""
        if isinstance(micros, bool) or not isinstance(micros, int) or not 0 <= micros < 1 << 32:
            raise ValueError("wait spin: %r is not a whole number of microseconds from 0 to 2^32 - 1" % (micros,))
        self._call(_set_wait_spin, micros)

    def register_cache(self, group: str, model: Model, fmt: str, layout: str, rank: int, num_blocks: int, identity: Identity, mem: Mem) -> Tuple[int, int, bool]:
        """Registers one rank's cache held in ``mem``; returns
        ``(regions, bytes, complete)``."""
        regions, nbytes, complete = _u32(0), _u64(0), ctypes.c_bool(False)
        self._call(
            _register,
            _b(group),
            _json(model),
            _b(fmt),
            _b(layout),
            rank,
            num_blocks,
            _json(identity),
            mem.handle,
            ctypes.byref(regions),
            ctypes.byref(nbytes),
            ctypes.byref(complete),
        )
        return regions.value, nbytes.value, complete.value

    def register_device_cache(self, group: str, model: Model, fmt: str, layout: str, rank: int, num_blocks: int, identity: Identity, ordinal: int, length: int, fd: int = -1, ipc: bytes = b"") -> Tuple[int, int, bool]:
        """Registers one rank's cache held in device memory: ``length`` bytes
        on device ``ordinal``, by CUDA IPC handle ``ipc`` (64 bytes) and,
        when there is one, dmabuf ``fd``; returns ``(regions, bytes,
        complete)``. The daemon needs a ``[device]`` backend."""
        regions, nbytes, complete = _u32(0), _u64(0), ctypes.c_bool(False)
        handle = (ctypes.c_uint8 * len(ipc)).from_buffer_copy(ipc) if ipc else None
        self._call(
            _register_device,
            _b(group),
            _json(model),
            _b(fmt),
            _b(layout),
            rank,
            num_blocks,
            _json(identity),
            ordinal,
            length,
            fd,
            handle,
            len(ipc),
            ctypes.byref(regions),
            ctypes.byref(nbytes),
            ctypes.byref(complete),
        )
        return regions.value, nbytes.value, complete.value

    def register_tensors(self, group: str, model: Model, fmt: str, layout: str, rank: int, num_blocks: int, identity: Identity, tensors: Sequence["TensorSpec"]) -> Tuple[int, int, bool]:
        """Registers one rank's cache as the engine's own tensors, living in
        :class:`SharedMemory` (memfds), with no copy. ``layout`` names their
        order with ``kv=`` (a preset such as ``vllm_nhd`` or ``flashinfer``);
        each :class:`TensorSpec` says where a tensor is and what it holds.
        Returns ``(regions, bytes, complete)``."""
        mems, listed = _tensor_list(tensors)
        args = (group, model, fmt, layout, rank, num_blocks, identity)
        return self._register_engine(_register_tensors, args, listed, [], [m.fd for m in mems])

    def register_device_tensors(self, group: str, model: Model, fmt: str, layout: str, rank: int, num_blocks: int, identity: Identity, tensors: Sequence["TensorSpec"]) -> Tuple[int, int, bool]:
        """Registers one rank's cache as the engine's own tensors in device
        memory, each in a device allocation of its own (vLLM's per-layer
        GPU tensors): as :meth:`register_tensors`, with each tensor's
        ``memory`` a :class:`DeviceMemory`. The daemon needs a ``[device]``
        backend and stages each allocation through a host mirror of its
        own. Returns ``(regions, bytes, complete)``."""
        mems, listed = _tensor_list(tensors)
        with_fd = [m.fd >= 0 for m in mems]
        if any(with_fd) and not all(with_fd):
            raise ValueError("device memories: every one carries an fd, or none does")
        args = (group, model, fmt, layout, rank, num_blocks, identity)
        fds = [m.fd for m in mems] if all(with_fd) else []
        return self._register_engine(_register_device_tensors, args, listed, [_json([m.describe() for m in mems])], fds)

    def _register_engine(self, fn, args, listed: list, extra: list, fds: list) -> Tuple[int, int, bool]:
        """One engine-tensor registration through ``fn``: the cache's
        arguments, the tensors' descriptions, ``extra`` (the device
        memories' JSON, for device tensors) and the fds that travel."""
        group, model, fmt, layout, rank, num_blocks, identity = args
        arr = (ctypes.c_int * max(len(fds), 1))(*fds)
        regions, nbytes, complete = _u32(0), _u64(0), ctypes.c_bool(False)
        self._call(
            fn,
            _b(group),
            _json(model),
            _b(fmt),
            _b(layout),
            rank,
            num_blocks,
            _json(identity),
            _json(listed),
            *extra,
            arr,
            len(fds),
            ctypes.byref(regions),
            ctypes.byref(nbytes),
            ctypes.byref(complete),
        )
        return regions.value, nbytes.value, complete.value

    def prepare_receive(self, group: str, request: str, block_table: Sequence[int], tokens: int, prefix_tokens: int = 0, source: Optional[str] = None) -> int:
        """Prepares to receive ``request``; returns the slot to wait on.
        Naming the ``source`` node that will fill it lets this daemon
        announce the receive to it ahead (see :meth:`prepare_announced`)."""
        return self.prepare_announced(group, request, block_table, tokens, prefix_tokens, source)[0]

    def prepare_announced(self, group: str, request: str, block_table: Sequence[int], tokens: int, prefix_tokens: int = 0, source: Optional[str] = None) -> Tuple[int, bool]:
        """As :meth:`prepare_receive`; returns ``(slot, announced)``.
        ``announced``: the ``source`` node was told ahead, so its submit
        starts writing with no round trip. Best effort: when False (no
        connection from it yet, a request above the daemon's
        ``transport.announce_max_bytes``) the source offers, as without one."""
        arr, n = _table(block_table)
        slot, told = _u16(0), ctypes.c_int(0)
        src = _b(source) if source is not None else None
        self._call(_prepare, _b(group), _b(request), arr, n, tokens, prefix_tokens, src, ctypes.byref(slot), ctypes.byref(told))
        return slot.value, bool(told.value)

    def submit(self, request: str, group: str, block_table: Sequence[int], tokens: int, peer: str, dst_group: str, dst_request: str, stream: bool = False) -> Tuple[int, int]:
        """Starts a transfer; returns ``(slot, peer_slot)``. With ``stream``,
        the engine is still writing the layers: the call returns once the
        destination accepted, and each layer moves once every source rank
        holding part of it said so with :meth:`produced`."""
        arr, n = _table(block_table)
        slot, peer_slot = _u16(0), _u16(0)
        self._call(
            _submit_streamed if stream else _submit,
            _b(request),
            _b(group),
            arr,
            n,
            tokens,
            _b(peer),
            _b(dst_group),
            _b(dst_request),
            ctypes.byref(slot),
            ctypes.byref(peer_slot),
        )
        return slot.value, peer_slot.value

    def produced(self, group: str, request: str, rank: int, layers: int) -> None:
        """Layers ``0..layers`` of ``request`` (as its submit names it) are
        written on ``rank`` of ``group``: a streamed submit moves them. Only
        the client that registered the rank may say so."""
        self._call(_produced, _b(group), _b(request), rank, layers)

    def wait(self, slot: int, flag: int, layer: int = 0, timeout_ms: int = 30000) -> int:
        """Blocks until the flag is published (reading the mapped page; the
        GIL is released meanwhile); returns the notify hop in ns."""
        ns = _u64(0)
        self._call(_wait, slot, flag, layer, timeout_ms, ctypes.byref(ns))
        return ns.value

    def layer_ready(self, slot: int, layer: int, timeout_ms: int = 30000) -> int:
        return self.wait(slot, LAYER_READY, layer, timeout_ms)

    def decoder_usable(self, slot: int, timeout_ms: int = 30000) -> int:
        return self.wait(slot, DECODER_USABLE, 0, timeout_ms)

    def source_released(self, slot: int, timeout_ms: int = 30000) -> int:
        return self.wait(slot, SOURCE_RELEASED, 0, timeout_ms)

    def is_ready(self, slot: int, flag: int, layer: int = 0) -> bool:
        r = ctypes.c_bool(False)
        self._call(_is_ready, slot, flag, layer, ctypes.byref(r))
        return r.value

    def status(self, slot: int) -> str:
        """The transfer's state: ``prepared``, ``running``, ``done``, ``failed`` or ``cancelled``."""
        s = _u32(0)
        self._call(_status, slot, ctypes.byref(s))
        return STATES.get(s.value, str(s.value))

    def transfer_status(self, slot: int) -> Dict[str, Any]:
        """The daemon's full status of the transfer in ``slot``: ``state``,
        ``error`` (why it failed), ``layers``, ``bytes``, ``reused_bytes``,
        ``hops`` and ``marks`` (``[{"name": "layer_ready(0)", "at_ns": …},
        …]``, ns since this side started the transfer)."""
        size = 1 << 16
        while True:
            buf = ctypes.create_string_buffer(size)
            n = _sz(0)
            rc = _status_json(self.handle, slot, buf, size, ctypes.byref(n))
            if rc == KVW_BUFFER_TOO_SMALL and size < (1 << 26):  # noqa: F821 (set from RESULTS)
                size *= 4
                continue
            _check(rc, self.handle)
            return json.loads(buf.raw[: n.value].decode("utf-8"))

    def cancel(self, slot: int) -> None:
        self._call(_cancel, slot)

    def release_cache(self, group: str, rank: int) -> None:
        self._call(_release, _b(group), rank)

    def share_group(self, group: str, token: str) -> None:
        """Shares ``group`` with the clients that present ``token`` (16 bytes
        at least): each process registering ranks of one group calls this
        with the same token first. A group nobody shared belongs to the
        client that registered its first rank."""
        self._call(_share, _b(group), _b(token))

    _free = staticmethod(lambda h: _client_free(h))


from . import _views  # noqa: E402  (after the ABI: the views use nothing of it)
from ._views import PRESETS, DeviceMemory, SharedMemory, TensorSpec, cuda_ipc_handle, cuda_share, device_memories, layout_pad, preset_shape, vllm_layout  # noqa: E402
