"""Zero-copy views of kvwire memory, engine-owned shareable memory, and the
description of an engine's tensors for ``Client.register_tensors``.

numpy and torch are imported only when a view of that kind is asked for.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

# kv= presets and their order words (core/src/tensors.rs).
PRESETS = {
    "vllm_nhd": "kbthd",
    "vllm_hnd": "kbhtd",
    "flashinfer": "bkthd",
    "flashinfer_hnd": "bkhtd",
    "vllm_cpu": "bhtkd",
    "vllm_cross": "blkthd",
}

# kvwire dtype names -> (bytes, numpy name or None, torch attribute or None)
_DTYPES = {
    "bf16": (2, None, "bfloat16"),
    "fp16": (2, "float16", "float16"),
    "fp32": (4, "float32", "float32"),
    "fp8_e4m3": (1, None, "float8_e4m3fn"),
    "fp8_e5m2": (1, None, "float8_e5m2"),
    "uint8": (1, "uint8", "uint8"),
}
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "u8": "uint8"}


def dtype_name(dtype: Any) -> str:
    """kvwire's name of a dtype given as text, a numpy dtype or a torch dtype."""
    text = str(dtype)
    for prefix in ("torch.", "numpy."):
        if text.startswith(prefix):
            text = text[len(prefix):]
    text = _ALIASES.get(text, text)
    if text not in _DTYPES:
        raise TypeError("dtype %r: kvwire knows %s" % (dtype, ", ".join(sorted(_DTYPES))))
    return text


def preset_shape(preset: str, num_blocks: int, block_size: int, heads: int, head_dim: int, layers: int = 1) -> Tuple[Tuple[int, ...], str]:
    """The engine tensor shape of ``preset`` and the role to register it with,
    for a rank holding ``heads`` KV heads (``layers`` layers for ``vllm_cross``)."""
    sizes = {"l": layers, "k": 2, "b": num_blocks, "t": block_size, "h": heads, "d": head_dim}
    word = PRESETS.get(preset, preset)
    if preset == "vllm_cpu":
        return (num_blocks, heads, block_size, 2 * head_dim), "kv_packed"
    return tuple(sizes[c] for c in word), ("kv" if "k" in word else "k")


def layout_pad(preset: str, shape: Sequence[int], strides: Sequence[int], num_blocks: int, block_size: int, heads: int, head_dim: int, layers: int = 1, role: str = "") -> str:
    """The layout's ``pad=`` value under which a tensor of ``shape`` and
    ``strides`` (in elements) is ``preset``'s tensor for a rank holding
    ``heads`` KV heads: ``""`` when it is dense. The tensor may be a
    permuted view (vLLM's HND cache is an NHD-shaped view); what counts is
    its layout in memory: each axis's step is the inner axes' extent plus
    the padding. Raises ValueError, naming what differs, when no padding
    explains the strides."""
    word = PRESETS.get(preset, preset)
    if role == "latent":
        word = "".join(c for c in word if c not in "kl")
    sizes = {"l": layers, "k": 2, "b": num_blocks, "t": block_size, "h": heads, "d": head_dim}
    shape, strides = list(shape), list(strides)
    if len(shape) != len(strides):
        raise ValueError("%d sizes but %d strides" % (len(shape), len(strides)))
    if role == "kv_packed" or (preset == "vllm_cpu" and role != "latent"):
        # K then V in the last dimension: seen as the order's (2, head_dim).
        if not shape or shape[-1] != 2 * head_dim or strides[-1] != 1:
            raise ValueError("shape %r: the last dimension must hold K then V (2 * %d elements, stride 1)" % (tuple(shape), head_dim))
        shape[-1:], strides[-1:] = [2, head_dim], [head_dim, 1]
    axes = [c for c in word if sizes[c] != 1]
    dims = sorted(((n, s) for n, s in zip(shape, strides) if n != 1), key=lambda d: -d[1])
    if [n for n, _ in dims] != [sizes[c] for c in axes]:
        raise ValueError("shape %r (strides %r): in memory order its sizes are %r, but kv=%s's are %r (%s)" % (tuple(shape), tuple(strides), [n for n, _ in dims], preset, [sizes[c] for c in axes], "".join(axes)))
    if dims and dims[-1][1] != 1:
        raise ValueError("strides %r: a row's elements must be contiguous (stride 1)" % (tuple(strides),))
    pads = {}
    for (n, s), (n2, s2), c in zip(dims, dims[1:], axes):
        if s < n2 * s2:
            raise ValueError("strides %r: axis %s (stride %d) overlaps the %d elements inside it" % (tuple(strides), c, s, n2 * s2))
        if s > n2 * s2:
            pads[c] = s - n2 * s2
    return ":".join("%s%d" % (c, pads[c]) for c in word if c in pads)


def vllm_layout(shape: Sequence[int], strides: Sequence[int], block_size: int, heads: int, head_size: int) -> Tuple[str, str, str, int]:
    """kvwire's ``(preset, pad, role, num_blocks)`` for one of vLLM's
    per-layer KV cache tensors, from its shape and strides (in elements):

    * ``(num_blocks, heads, block, 2 * head_size)``: vLLM's CPU layout,
      ``vllm_cpu``, K and V in the last dimension (role ``kv_packed``);
    * ``(2, num_blocks, block, heads, head_size)``: FlashAttention and the
      other GPU backends that share its shape, ``vllm_nhd``; vLLM's HND
      layout is this shape with the block and head strides swapped,
      ``vllm_hnd``;
    * ``(num_blocks, 2, block, heads, head_size)``: FlashInfer,
      ``flashinfer`` or, with those strides swapped, ``flashinfer_hnd``.

    ``pad`` is the layout's ``pad=`` for a padded view (:func:`layout_pad`).
    Raises ValueError naming what was seen when the tensor is none of these."""
    shape, strides = tuple(shape), tuple(strides)
    rows = (block_size, heads, head_size)
    if len(shape) == 4 and shape[1:] == (heads, block_size, 2 * head_size):
        preset, role, nb = "vllm_cpu", "kv_packed", shape[0]
    elif len(shape) == 5 and shape[2:] == rows and 2 in shape[:2]:
        if shape[0] == shape[1]:
            raise ValueError("shape %r: with 2 blocks, K/V-first (FlashAttention) and block-first (FlashInfer) are the same shape" % (shape,))
        # The logical order is NHD in every one; an HND cache permutes its strides.
        hnd = strides[3] > strides[2]
        if shape[1] == 2:
            preset, nb = ("flashinfer_hnd" if hnd else "flashinfer"), shape[0]
        else:
            preset, nb = ("vllm_hnd" if hnd else "vllm_nhd"), shape[1]
        role = "kv"
    else:
        raise ValueError(
            "shape %r: kvwire maps vLLM's (num_blocks, %d, %d, %d) CPU cache, (2, num_blocks, %d, %d, %d) "
            "FlashAttention-shaped caches and (num_blocks, 2, %d, %d, %d) FlashInfer caches (block size, KV heads, head size)"
            % ((shape, heads, block_size, 2 * head_size) + rows + rows)
        )
    return preset, layout_pad(preset, shape, strides, nb, block_size, heads, head_size, role=role), role, nb


CUDA_IPC_HANDLE_SIZE = 64


def cuda_ipc_handle(shared: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t inside the handle torch shares a CUDA
    storage by. torch's caching allocator writes a version byte, a type byte
    (``c``: a cudaMalloc segment; ``e``: an expandable segment, which has no
    such handle) and then the raw handle; torch before versioned handles
    gave the raw 64 bytes."""
    shared = bytes(shared)
    if len(shared) == CUDA_IPC_HANDLE_SIZE:
        return shared
    if len(shared) == CUDA_IPC_HANDLE_SIZE + 2 and shared[1:2] == b"c":
        return shared[2:]
    if len(shared) >= 2 and shared[1:2] == b"e":
        raise ValueError(
            "the CUDA tensor is in an expandable segment, which has no CUDA IPC handle: "
            "run the engine with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
        )
    raise ValueError("a CUDA storage handle of %d bytes (type byte %r) is not one kvwire reads" % (len(shared), shared[1:2]))


def cuda_share(tensor: Any) -> Tuple[int, bytes, int, int, int]:
    """What :func:`device_memories` takes for one torch CUDA tensor: its
    device, its allocation's IPC handle, its storage's byte offset in that
    allocation and size, and the tensor's byte offset in its storage."""
    # torch's order: device, handle, storage bytes, storage offset in the allocation, ...
    device, handle, size, base = tensor.untyped_storage()._share_cuda_()[:4]
    return int(device), cuda_ipc_handle(handle), int(base), int(size), tensor.storage_offset() * tensor.element_size()


def device_memories(shared: Sequence[Tuple[int, bytes, int, int, int]]) -> Tuple[list, list]:
    """Groups device tensors by the allocation their CUDA IPC handle names.
    ``shared`` holds per tensor ``(device, ipc handle, storage offset in the
    allocation, storage bytes, tensor offset in the storage)``, as
    :func:`cuda_share` gives them.
    Returns the allocations (:class:`DeviceMemory`, each reaching the end of
    the last storage in it: a handle is opened once however many tensors it
    holds) and per tensor ``(allocation index, byte offset in it)``."""
    keys: list = []
    ends: list = []
    where = []
    for device, handle, base, size, off in shared:
        key = (int(device), bytes(handle))
        if key not in keys:
            keys.append(key)
            ends.append(0)
        i = keys.index(key)
        ends[i] = max(ends[i], base + size)
        where.append((i, base + off))
    return [DeviceMemory(ordinal=k[0], length=e, ipc=k[1]) for k, e in zip(keys, ends)], where


def _check_span(nbytes: int, offset: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> None:
    if any(n <= 0 for n in shape):
        raise ValueError("shape %r: every size must be > 0" % (tuple(shape),))
    last = offset + (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * itemsize
    if offset < 0 or last > nbytes:
        raise IndexError("a view of shape %r at byte %d reaches byte %d, past the memory's %d" % (tuple(shape), offset, last, nbytes))


def _row_major(shape: Sequence[int]) -> Tuple[int, ...]:
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return tuple(out)


def _array(ptr: int, nbytes: int, owner: Any) -> Any:
    arr = (ctypes.c_uint8 * nbytes).from_address(ptr)
    arr._kvwire_owner = owner  # the view keeps the memory mapped
    return arr


def numpy_view(ptr: int, nbytes: int, owner: Any, dtype: Any = "uint8", shape: Optional[Sequence[int]] = None, offset: int = 0, strides: Optional[Sequence[int]] = None) -> Any:
    import numpy as np

    name = dtype_name(dtype)
    size, np_name, _ = _DTYPES[name]
    if np_name is None:
        raise TypeError("numpy has no %s: take a torch() view, or numpy() with a same-size integer dtype" % name)
    shape = tuple(shape) if shape is not None else ((nbytes - offset) // size,)
    strides = tuple(strides) if strides is not None else _row_major(shape)
    _check_span(nbytes, offset, shape, strides, size)
    return np.ndarray(shape, dtype=np.dtype(np_name), buffer=_array(ptr, nbytes, owner), offset=offset, strides=tuple(s * size for s in strides))


def torch_view(ptr: int, nbytes: int, owner: Any, dtype: Any, shape: Sequence[int], offset: int = 0, strides: Optional[Sequence[int]] = None) -> Any:
    import torch

    name = dtype_name(dtype)
    size, _, attr = _DTYPES[name]
    shape = tuple(shape)
    strides = tuple(strides) if strides is not None else _row_major(shape)
    _check_span(nbytes, offset, shape, strides, size)
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    flat = torch.frombuffer(_array(ptr, nbytes, owner), dtype=getattr(torch, attr), count=span, offset=offset)
    return flat.as_strided(shape, strides)


_MAP_FIXED = 0x10  # <sys/mman.h>, the same on every Linux architecture kvwire builds for


def _libc_mmap(addr: int, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    f = libc.mmap
    f.restype = ctypes.c_void_p
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    r = f(addr, length, prot, flags, fd, offset)
    return -1 if r is None or r == ctypes.c_void_p(-1).value else r


class SharedMemory:
    """Engine-owned, shareable host memory: a memfd mapped into this process.
    Tensors made over it (:meth:`numpy`, :meth:`torch`) are the engine's
    cache; :meth:`kvwire.Client.register_tensors` hands the memfd to the
    daemon, which maps the same pages, so nothing is copied."""

    def __init__(self, nbytes: int, name: str = "kvwire-engine") -> None:
        if nbytes <= 0:
            raise ValueError("cannot make shared memory of %d bytes" % nbytes)
        # The daemon seals it against shrinking before it maps it.
        self.fd: int = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            self._map: Optional[mmap.mmap] = mmap.mmap(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self._arr = (ctypes.c_uint8 * nbytes).from_buffer(self._map)
        self.ptr: int = ctypes.addressof(self._arr)
        self._len = nbytes

    @classmethod
    def adopt(cls, address: int, nbytes: int, name: str = "kvwire-adopted") -> "SharedMemory":
        """Moves memory the engine already allocated into a memfd, in place:
        the pages covering ``[address, address + nbytes)`` are copied into a
        new memfd, which is then mapped over them at the same address
        (``MAP_FIXED | MAP_SHARED``). Every pointer, tensor and view into
        them stays valid and now reads and writes the shareable pages, so
        :meth:`kvwire.Client.register_tensors` can hand them to the daemon
        with no copy after this one.

        The range is widened to whole pages; what shares its first and last
        page moves too, with its content. No other thread may write the
        range while it moves (an engine adopts its cache once, before its
        first forward). Linux only. The returned memory's :attr:`ptr` is the
        first page, and the mapping stays for the life of the process
        (whoever frees the original allocation unmaps it)."""
        if nbytes <= 0:
            raise ValueError("cannot adopt %d bytes" % nbytes)
        page = mmap.PAGESIZE
        lo = address - address % page
        hi = -(-(address + nbytes) // page) * page
        size = hi - lo
        self = cls.__new__(cls)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            staging = mmap.mmap(self.fd, size)
            try:
                dst = (ctypes.c_uint8 * size).from_buffer(staging)
                ctypes.memmove(ctypes.addressof(dst), lo, size)
                del dst
            finally:
                staging.close()
            got = _libc_mmap(lo, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, self.fd, 0)
            if got != lo:
                err = ctypes.get_errno()
                raise OSError(err, "mmap of the memfd over %#x..%#x: %s" % (lo, hi, os.strerror(err)))
        except BaseException:
            os.close(self.fd)
            raise
        self._map = None
        self._arr = (ctypes.c_uint8 * size).from_address(lo)
        self.ptr = lo
        self._len = size
        return self

    def __len__(self) -> int:
        return self._len

    def numpy(self, dtype: Any = "uint8", shape: Optional[Sequence[int]] = None, offset: int = 0, strides: Optional[Sequence[int]] = None) -> Any:
        """A zero-copy numpy view (``offset`` in bytes, ``strides`` in elements)."""
        return numpy_view(self.ptr, self._len, self, dtype, shape, offset, strides)

    def torch(self, dtype: Any, shape: Sequence[int], offset: int = 0, strides: Optional[Sequence[int]] = None) -> Any:
        """A zero-copy torch view (``offset`` in bytes, ``strides`` in elements)."""
        return torch_view(self.ptr, self._len, self, dtype, shape, offset, strides)

    def read(self, offset: int = 0, length: Optional[int] = None) -> bytes:
        length = self._len - offset if length is None else length
        return ctypes.string_at(self.ptr + offset, length)

    def write(self, offset: int, data: bytes) -> None:
        if offset < 0 or offset + len(data) > self._len:
            raise IndexError("write of %d bytes at %d past %d" % (len(data), offset, self._len))
        ctypes.memmove(self.ptr + offset, data, len(data))

    def close(self) -> None:
        """Closes the fd; the mapping goes with the last view of it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "SharedMemory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(frozen=True, eq=False)
class DeviceMemory:
    """One device allocation an engine's tensors live in: ``length`` bytes
    on device ``ordinal``, named by its CUDA IPC handle ``ipc`` (64 bytes)
    and, where there is one, an ``fd`` that travels with it (a CUDA dmabuf
    fd, or the memfd that plays device memory for the daemon's stand-in
    ``host`` backend). A :class:`TensorSpec` in it gives its ``offset``
    from the allocation's start."""

    ordinal: int
    length: int
    fd: int = -1
    ipc: bytes = b""

    def describe(self) -> dict:
        return {"ordinal": self.ordinal, "len": self.length, "ipc": list(self.ipc) if self.ipc else None}


@dataclass
class TensorSpec:
    """One engine tensor: where it lives (``memory`` at byte ``offset``), its
    dtype, shape and strides (in elements), its role (``k``, ``v``, ``kv``,
    ``kv_packed``, or ``latent`` for an MLA layer) and the half-open layer
    range it holds."""

    memory: SharedMemory
    offset: int
    dtype: str
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    role: str
    layers: Tuple[int, int]

    @classmethod
    def of(cls, view: Any, memory: SharedMemory, role: str, layers: Tuple[int, int]) -> "TensorSpec":
        """The description of a numpy array or torch tensor that lives in ``memory``."""
        if hasattr(view, "data_ptr"):  # torch
            addr, shape, strides = view.data_ptr(), tuple(view.shape), tuple(view.stride())
        else:  # numpy
            item = view.dtype.itemsize
            addr, shape = view.ctypes.data, tuple(view.shape)
            if any(s % item for s in view.strides):
                raise ValueError("strides %r are not whole elements" % (view.strides,))
            strides = tuple(s // item for s in view.strides)
        offset = addr - memory.ptr
        if offset < 0 or offset >= len(memory):
            raise ValueError("the tensor does not live in this SharedMemory (it is at %#x, the memory at %#x..%#x)" % (addr, memory.ptr, memory.ptr + len(memory)))
        return cls(memory, offset, dtype_name(view.dtype), shape, strides, role, (int(layers[0]), int(layers[1])))

    def describe(self, memory_index: int) -> dict:
        return {
            "memory": memory_index,
            "offset": self.offset,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "strides": list(self.strides),
            "role": self.role,
            "layers": list(self.layers),
        }

    @property
    def nbytes(self) -> int:
        """Bytes from its first element to the end of its last (a padded view skips bytes in between)."""
        return (sum((n - 1) * s for n, s in zip(self.shape, self.strides)) + 1) * _DTYPES[dtype_name(self.dtype)][0]
