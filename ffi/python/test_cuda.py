"""The Python client's CUDA path on a real GPU, through two real kvwired.

Run: KVWIRED=path/to/kvwired python3 test_cuda.py (scripts/gpu-check runs it;
KVWIRE_MARKS=1 adds each side's marks to the hops it prints;
kvwired must be built with --features cuda). Exits non-zero on failure and
prints "N passed, M failed". Without torch or a CUDA device it prints a
line starting with SKIPPED and exits 0; gpu-check fails on that line when
a GPU is present.

Both daemons run `[device] backend = "cuda"`, on loopback over tcp. The
tensors are torch CUDA tensors shaped as vLLM's backends allocate them,
registered the way kvwire.vllm's register_kv_caches does: each tensor by the
IPC handle of the allocation it is in (``untyped_storage()._share_cuda_()``,
grouped by ``device_memories``), its preset read off shape and strides by
``vllm_layout``. The source is TP 2, FlashAttention NHD, block 16, one
allocation per layer; the destination TP 1, FlashInfer HND, block 8, every
layer a view into one allocation. The expected destination is computed on
the GPU by index arithmetic from the layouts' definitions and compared
bitwise, bytes outside the request's rows included.
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kvwire  # noqa: E402
from test_kvwire import Daemons, run  # noqa: E402  (the same two-daemon harness)

try:
    import torch
except ImportError:
    torch = None

LAYERS, HEADS, DIM = 8, 8, 128
TOKENS = 1000
TOML = 'name = "cuda-toy"\ndtype = "bf16"\n[[layers]]\nrepeat = %d\nattention = "dense"\nkv_heads = %d\nhead_dim = %d\n' % (LAYERS, HEADS, DIM)
MODEL = {"toml": TOML}
IDENTITY = {"model_digest": "cuda-toy-digest", "adapter_digest": "", "format": "bf16/v1", "tenant": "t1", "rope": "theta=10000", "position_offset": 0}
CANARY = -23131  # 0xA5A5 as int16

# Shuffled block tables; 1000 tokens leave the last block of each side partial.
SRC = dict(tp=2, block=16, blocks=96)
DST = dict(tp=1, block=8, blocks=160)
SRC["table"] = [(i * 37 + 5) % SRC["blocks"] for i in range(-(-TOKENS // SRC["block"]))]
DST["table"] = [(i * 61 + 11) % DST["blocks"] for i in range(-(-TOKENS // DST["block"]))]


def register(client, group, side, rank, tensors):
    """One rank's per-layer CUDA tensors, registered as kvwire.vllm does."""
    shape, strides = tuple(tensors[0].shape), tuple(tensors[0].stride())
    preset, pad, role, nb = kvwire.vllm_layout(shape, strides, side["block"], HEADS // side["tp"], DIM)
    memories, where = kvwire.device_memories([kvwire.cuda_share(t) for t in tensors])
    specs = [kvwire.TensorSpec(memories[m], off, "bf16", shape, strides, role, (l, l + 1)) for l, (m, off) in enumerate(where)]
    layout = "tp=%d,block=%d,kv=%s" % (side["tp"], side["block"], preset) + (",pad=%s" % pad if pad else "")
    got = client.register_device_tensors(group, MODEL, "bf16", layout, rank, nb, IDENTITY, specs)
    return got, preset, len(memories)


def source_tensors():
    """Per rank, per layer: (2, blocks, block, heads/tp, dim), each layer its own allocation."""
    hl = HEADS // SRC["tp"]
    return [[torch.empty((2, SRC["blocks"], SRC["block"], hl, DIM), dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)] for _ in range(SRC["tp"])]


def dest_tensors():
    """One allocation; per layer a FlashInfer HND view (blocks, 2, block, heads, dim) of (blocks, 2, heads, block, dim)."""
    per = DST["blocks"] * 2 * HEADS * DST["block"] * DIM
    buf = torch.empty(LAYERS * per, dtype=torch.bfloat16, device="cuda")
    views = [buf[l * per : (l + 1) * per].view(DST["blocks"], 2, HEADS, DST["block"], DIM).permute(0, 1, 3, 2, 4) for l in range(LAYERS)]
    return buf, views


def fill_random(tensors, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for t in tensors:
        t.view(torch.int16).copy_(torch.randint(-32768, 32767, t.shape, dtype=torch.int16, device="cuda", generator=g))


def expected(src, buf):
    """The destination after the transfer: canary everywhere but the request's rows."""
    want_buf = torch.full_like(buf.view(torch.int16), CANARY)
    per = buf.numel() // LAYERS
    pos = torch.arange(TOKENS, device="cuda")
    st, dt = torch.tensor(SRC["table"], device="cuda"), torch.tensor(DST["table"], device="cuda")
    sb, ss = st[pos // SRC["block"]], pos % SRC["block"]
    db, ds = dt[pos // DST["block"]], pos % DST["block"]
    hl = HEADS // SRC["tp"]
    for l in range(LAYERS):
        w = want_buf[l * per : (l + 1) * per].view(DST["blocks"], 2, HEADS, DST["block"], DIM).permute(0, 1, 3, 2, 4)
        for r in range(SRC["tp"]):
            s = src[r][l].view(torch.int16)
            for kv in range(2):
                w[db, kv, ds, r * hl : (r + 1) * hl, :] = s[kv, sb, ss, :, :]
    return want_buf


def compare(buf, want_buf, what):
    got = buf.view(torch.int16)
    if not torch.equal(got, want_buf):
        bad = (got != want_buf).nonzero()
        raise AssertionError("%s: %d of %d destination elements differ, first at %s" % (what, bad.shape[0], got.numel(), bad[0].tolist()))


def test_cuda_tensors_remap_through_two_daemons(d):
    a = kvwire.Client(d.sock_a, "cuda-prefill")
    b = kvwire.Client(d.sock_b, "cuda-decode")
    try:
        src = source_tensors()
        buf, views = dest_tensors()
        for r in range(SRC["tp"]):
            fill_random(src[r], 1000 + r)
            got, preset, _ = register(a, "cuda-src", SRC, r, src[r])
            assert preset == "vllm_nhd" and got[0] == LAYERS and got[2] == (r == SRC["tp"] - 1), (preset, got)
        buf.view(torch.int16).fill_(CANARY)
        got, preset, allocations = register(b, "cuda-dst", DST, 0, views)
        assert preset == "flashinfer_hnd" and allocations == 1 and got == (LAYERS, buf.numel() * 2, True), (preset, allocations, got)
        want = expected(src, buf)
        torch.cuda.synchronize()  # the daemons read the tensors from their own processes
        moved = 2 * LAYERS * HEADS * DIM * 2 * TOKENS
        for i in range(3):
            t0 = time.perf_counter()
            slot = b.prepare_receive("cuda-dst", "r%d" % i, DST["table"], TOKENS)
            sslot, _ = a.submit("pr%d" % i, "cuda-src", SRC["table"], TOKENS, "b", "cuda-dst", "r%d" % i)
            b.decoder_usable(slot, timeout_ms=60000)
            a.source_released(sslot, timeout_ms=60000)
            ms = (time.perf_counter() - t0) * 1e3
            compare(buf, want, "transfer %d" % i)
            print("     transfer %d: %.1f MiB remapped TP2 FlashAttention NHD/16 -> TP1 FlashInfer HND/8 in %.2f ms, bitwise" % (i, moved / 2**20, ms))
            buf.view(torch.int16).fill_(CANARY)
            torch.cuda.synchronize()
        # The last (warm) transfer's busy time per hop on each side: where a
        # GPU remap's time goes, without running anything else.
        for side, c, s in (("source", a, sslot), ("destination", b, slot)):
            st = c.transfer_status(s)
            hops = ", ".join("%s %.1f ms" % (h["hop"], h["ns"] / 1e6) for h in st["hops"])
            print("     warm hops, %s: %s" % (side, hops))
            if os.environ.get("KVWIRE_MARKS"):
                print("     marks, %s: %s" % (side, " ".join("%s@%.2f" % (m["name"], m["at_ns"] / 1e6) for m in st["marks"])))
        # Streamed: each layer is written on the GPU after the submit, and the
        # daemon is told only once an event recorded behind the writes completed.
        for r in range(SRC["tp"]):
            fill_random(src[r], 2000 + r)
        want = expected(src, buf)
        fresh = [[t.clone() for t in rank] for rank in src]
        for r in range(SRC["tp"]):
            for t in src[r]:
                t.zero_()
        torch.cuda.synchronize()
        slot = b.prepare_receive("cuda-dst", "s", DST["table"], TOKENS)
        sslot, _ = a.submit("ps", "cuda-src", SRC["table"], TOKENS, "b", "cuda-dst", "s", stream=True)
        for l in range(LAYERS):
            for r in range(SRC["tp"]):
                src[r][l].copy_(fresh[r][l])
            ev = torch.cuda.Event()
            ev.record()
            ev.synchronize()
            for r in range(SRC["tp"]):
                a.produced("cuda-src", "ps", r, l + 1)
            b.layer_ready(slot, l, timeout_ms=60000)
        b.decoder_usable(slot, timeout_ms=60000)
        a.source_released(sslot, timeout_ms=60000)
        compare(buf, want, "streamed transfer")
        print("     streamed transfer: each layer moved after its CUDA event, bitwise")
        for r in range(SRC["tp"]):
            a.release_cache("cuda-src", r)
        b.release_cache("cuda-dst", 0)
    finally:
        a.close()
        b.close()


def test_a_forged_ipc_handle_is_refused_and_the_daemon_serves_on(d):
    b = kvwire.Client(d.sock_b, "cuda-forged")
    try:
        buf, views = dest_tensors()
        shape, strides = tuple(views[0].shape), tuple(views[0].stride())
        per = buf.numel() * 2 // LAYERS
        device, handle, base, size, _ = kvwire.cuda_share(buf)
        for what, memory, at in [
            ("a forged IPC handle", kvwire.DeviceMemory(0, buf.numel() * 2, ipc=bytes(range(7, 71))), 0),
            ("a real handle whose allocation is claimed 1 GiB longer than it is", kvwire.DeviceMemory(device, base + size + (1 << 30), ipc=handle), base),
        ]:
            specs = [kvwire.TensorSpec(memory, at + l * per, "bf16", shape, strides, "kv", (l, l + 1)) for l in range(LAYERS)]
            try:
                b.register_device_tensors("cuda-forged", MODEL, "bf16", "tp=1,block=%d,kv=flashinfer_hnd" % DST["block"], 0, DST["blocks"], IDENTITY, specs)
            except kvwire.KvwireError as e:
                print("     refused: %s" % e)
            else:
                raise AssertionError("%s was accepted" % what)
    finally:
        b.close()


TESTS = [
    test_cuda_tensors_remap_through_two_daemons,
    test_a_forged_ipc_handle_is_refused_and_the_daemon_serves_on,
    # Runs again after the refusals: the daemons still serve.
    test_cuda_tensors_remap_through_two_daemons,
]


def main():
    if torch is None or not torch.cuda.is_available():
        print("SKIPPED python_cuda: %s" % ("torch is not installed" if torch is None else "torch sees no CUDA device"))
        return 0
    print("torch %s on %s" % (torch.__version__, torch.cuda.get_device_name(0)))
    return run(TESTS, Daemons(devices=("cuda", "cuda")))


if __name__ == "__main__":
    sys.exit(main())
