"""Tests of the Python client over two real kvwired daemons.

Run: python3 test_kvwire.py — exits non-zero on failure and prints
"N passed, M failed". With KVWIRE_TEST_SOCK_A / KVWIRE_TEST_SOCK_B /
KVWIRE_TEST_PEER_B set (scripts/ffi-check sets them) it uses those daemons;
otherwise it starts two itself from target/debug/kvwired (B first, then A
with peer b), on loopback with the tcp transport, and stops them at the end.

The transfer: source tp=2, block 16, nhd; destination tp=4, block 8, hnd;
shuffled block tables and a partial final block. Every destination byte is
checked against offsets computed from the layout definition.

Engine tensors: a source holding vLLM CPU per-layer tensors, one memfd per
layer, sends to FlashInfer per-layer tensors in one memfd (TP 2 -> 1);
offsets come from each engine's tensor shape. numpy views are checked when
numpy is installed, torch views when torch is (each says when skipped).
"""

import ctypes
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import traceback

# KVWIRE_TEST_INSTALLED=1 tests the installed package (a wheel), not the tree's.
_here = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("KVWIRE_TEST_INSTALLED") == "1":
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
else:
    sys.path.insert(0, _here)
import kvwire  # noqa: E402

if os.environ.get("KVWIRE_TEST_INSTALLED") == "1":
    assert not os.path.abspath(kvwire.__file__).startswith(_here), "testing the tree's kvwire, not the installed one: " + kvwire.__file__
    assert os.path.dirname(kvwire._find_library()) == os.path.dirname(kvwire.__file__) or os.environ.get("KVWIRE_FFI_LIB"), kvwire._find_library()

try:
    import numpy  # noqa: F401
except ImportError:
    numpy = None
try:
    import torch
except ImportError:
    torch = None

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))

TOML = (
    'name = "toy"\ndtype = "bf16"\n[[layers]]\nrepeat = 4\nattention = "dense"\n'
    "kv_heads = 4\nhead_dim = 16\n"
)
MODEL = {"toml": TOML}
IDENTITY = {
    "model_digest": "toy-digest",
    "adapter_digest": "",
    "format": "bf16/v1",
    "tenant": "t1",
    "rope": "theta=10000",
    "position_offset": 0,
}
LAYERS, HEADS, ROW, TENSORS = 4, 4, 32, 2
TOKENS = 100
CANARY = 0xA5
M64 = (1 << 64) - 1

SRC = dict(layout="tp=2,block=16,layout=nhd", tp=2, block=16, blocks=10, table=[3, 7, 0, 9, 5, 1, 8], nhd=True)
DST = dict(
    layout="tp=4,block=8,layout=hnd",
    tp=4,
    block=8,
    blocks=16,
    table=[12, 3, 15, 0, 7, 9, 1, 14, 4, 10, 2, 6, 11],
    nhd=False,
)


def code(layer, tensor, head, pos, byte):
    z = (layer << 48) ^ (tensor << 44) ^ (head << 32) ^ (pos << 16) ^ byte
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    c = (z ^ (z >> 31)) & 0xFF
    return (~CANARY & 0xFF) if c == CANARY else c


def row_code(layer, tensor, head, pos):
    return bytes(code(layer, tensor, head, pos, b) for b in range(ROW))


def offset(side, rank, layer, tensor, head, pos):
    """(rank, byte offset in that rank's memory) of a row."""
    lh = HEADS // side["tp"]
    local = head - rank * lh
    block_bytes = side["block"] * lh * ROW
    region = (layer * TENSORS + tensor) * side["blocks"] * block_bytes
    slot = pos % side["block"]
    row = slot * lh + local if side["nhd"] else local * side["block"] + slot
    return region + side["table"][pos // side["block"]] * block_bytes + row * ROW


def rows():
    for layer in range(LAYERS):
        for t in range(TENSORS):
            for h in range(HEADS):
                for pos in range(TOKENS):
                    yield layer, t, h, pos


# --------------------------------------------------------------------------
# Daemons


class Daemons:
    """Two kvwired: `b`, then `a` with peer `b`. ``devices`` is each one's
    ``[device] backend`` (a, b), None for none."""

    def __init__(self, devices=(None, "host")):
        self.procs = []
        self.dir = None
        self.devices = devices
        env = os.environ
        if env.get("KVWIRE_TEST_SOCK_A") and env.get("KVWIRE_TEST_SOCK_B"):
            self.sock_a, self.sock_b = env["KVWIRE_TEST_SOCK_A"], env["KVWIRE_TEST_SOCK_B"]
            self.peer_b = env.get("KVWIRE_TEST_PEER_B", "b")
            return
        exe = os.environ.get("KVWIRED", os.path.join(ROOT, "target", "debug", "kvwired"))
        if not os.access(exe, os.X_OK):
            raise RuntimeError("%s not found: cargo build -p kvwired (or set KVWIRED)" % exe)
        self.dir = tempfile.mkdtemp(prefix="kvwire-py.")
        try:
            self.sock_b, addr_b = self._start(exe, "b", None, devices[1])
            self.sock_a, _ = self._start(exe, "a", ("b", addr_b), devices[0])
        except BaseException:
            self.stop(check=False)
            raise
        self.peer_b = "b"

    def _start(self, exe, node, peer, device):
        secret = os.path.join(self.dir, node + ".secret")
        with open(secret, "w") as f:
            f.write("kvwire-python-test-shared-secret\n")
        os.chmod(secret, 0o600)
        sock = os.path.join(self.dir, node + ".sock")
        cfg = (
            'node = "%s"\ncontrol_socket = "%s"\npeer_listen = "127.0.0.1:0"\nsecret_file = "%s"\n'
            '[transport]\nkind = "tcp"\ntcp_listen = "127.0.0.1:0"\n' % (node, sock, secret)
        )
        if peer:
            cfg += '[[peers]]\nname = "%s"\naddress = "%s"\n' % peer
        if device:
            # "host": the stand-in backend, whose memfds play an engine's GPU allocations.
            cfg += '[device]\nbackend = "%s"\n' % device
        path = os.path.join(self.dir, node + ".toml")
        with open(path, "w") as f:
            f.write(cfg)
        err = os.path.join(self.dir, node + ".err")
        p = subprocess.Popen([exe, "--config", path], stdout=subprocess.PIPE, stderr=open(err, "w"), text=True)
        self.procs.append(p)
        line = p.stdout.readline()
        if not line.startswith("kvwired ready"):
            with open(err) as f:
                raise RuntimeError("daemon %s did not start: %r\n%s" % (node, line, f.read()[-2000:]))
        addr = next(w[len("peer="):] for w in line.split() if w.startswith("peer="))
        return sock, addr

    def stop(self, check=True):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        died = [p.returncode for p in self.procs if p.returncode not in (0, -15)]
        self.procs = []
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        # A daemon that died on its own (a panic, a device fault) fails the run.
        if died and check:
            raise RuntimeError("a kvwired exited with %s" % died[0])


# --------------------------------------------------------------------------
# Tests


def expect_error(code, fn, *args):
    try:
        fn(*args)
    except kvwire.KvwireError as e:
        assert e.code == code, "expected %s, got %s" % (kvwire.RESULTS[code], e)
        return e
    raise AssertionError("expected %s, the call succeeded" % kvwire.RESULTS[code])


def test_result_codes_match_the_header(d):
    with open(os.path.join(HERE, "..", "include", "kvwire.h")) as f:
        header = f.read()
    enum = re.search(r"enum kvw_result[^{]*\{(.*?)\};", header, re.S).group(1)
    codes = {int(v): k for k, v in re.findall(r"^\s*(KVW_\w+) = (\d+),", enum, re.M)}
    assert codes == kvwire.RESULTS, "kvwire.py's RESULTS differ from kvwire.h"
    assert kvwire.strerror(102) == "bad layout or cache format", kvwire.strerror(102)
    assert kvwire.strerror(424242) == "unknown kvwire result code"
    for name, value in (("LAYER_READY", 0), ("DECODER_USABLE", 1), ("SOURCE_RELEASED", 2)):
        assert re.search(r"#define KVW_FLAG_%s %d\b" % (name, value), header), name


def test_connect_errors(d):
    e = expect_error(kvwire.KVW_IO, kvwire.Client, "/nonexistent/kvwired.sock")
    assert "connect" in e.message, e.message
    expect_error(kvwire.KVW_INVALID_UTF8, kvwire.Client, b"\xff\xfe", "x")


def test_mem_and_cache_size(d):
    expect_error(kvwire.KVW_INVALID_ARGUMENT, kvwire.Mem, 0)
    with kvwire.Mem(4096) as m:
        assert len(m) == 4096 and m.read(0, 16) == bytes(16)
        m.write(4090, b"abcdef")
        assert m.read(4090) == b"abcdef"
    regions, nbytes = kvwire.cache_size(MODEL, "bf16", SRC["layout"], 1, SRC["blocks"])
    assert (regions, nbytes) == (8, 8 * SRC["blocks"] * 16 * 2 * ROW), (regions, nbytes)
    e = expect_error(kvwire.KVW_BAD_LAYOUT, kvwire.cache_size, MODEL, "bf16", "tp=3", 0, 4)
    assert "tp=3" in e.message or "3" in e.message, e.message
    expect_error(kvwire.KVW_INVALID_JSON, kvwire.cache_size, '{"toml": 1}', "bf16", "tp=1", 0, 4)


def register_side(client, group, side, fill):
    mems = []
    for rank in range(side["tp"]):
        regions, nbytes = kvwire.cache_size(MODEL, "bf16", side["layout"], rank, side["blocks"])
        m = kvwire.Mem(nbytes)
        if fill is not None:
            m.fill(fill)
        r, b, complete = client.register_cache(
            group, MODEL, "bf16", side["layout"], rank, side["blocks"], IDENTITY, m
        )
        assert (r, b) == (regions, nbytes), (r, b, regions, nbytes)
        assert complete == (rank == side["tp"] - 1), (rank, complete)
        mems.append(m)
    return mems


def test_bad_layout_is_102_with_the_daemons_message(d):
    with kvwire.Client(d.sock_a, "py-bad") as c, kvwire.Mem(1 << 16) as m:
        e = expect_error(
            kvwire.KVW_BAD_LAYOUT, c.register_cache, "py-bad", MODEL, "bf16", "tp=1,layout=diagonal", 0, 4, IDENTITY, m
        )
        assert e.code == 102 and "diagonal" in e.message, e
        assert c.last_error() == e.message
        e = expect_error(kvwire.KVW_BAD_REGION, c.register_cache, "py-bad", MODEL, "bf16", "tp=1", 0, 1000, IDENTITY, m)
        assert "need" in e.message, e.message
        expect_error(kvwire.KVW_INVALID_JSON, c.register_cache, "py-bad", MODEL, "bf16", "tp=1", 0, 4, {"tenant": "x"}, m)
        # Device memory on a daemon without a [device] backend names the setting.
        e = expect_error(
            kvwire.KVW_BAD_REGION, c.register_device_cache, "py-dev", MODEL, "bf16", "tp=1", 0, 4, IDENTITY, 0, 1 << 16, -1, bytes(64)
        )
        assert "[device] backend" in e.message, e.message


def test_transfer_every_layer_and_every_byte(d):
    a = kvwire.Client(d.sock_a, "py-prefill")
    b = kvwire.Client(d.sock_b, "py-decode")
    try:
        assert b.node == d.peer_b, b.node
        src = register_side(a, "py-prefill", SRC, None)
        dst = register_side(b, "py-decode", DST, CANARY)
        want = [bytearray(m.read()) for m in dst]
        for layer, t, h, pos in rows():
            row = row_code(layer, t, h, pos)
            sr = h // (HEADS // SRC["tp"])
            src[sr].write(offset(SRC, sr, layer, t, h, pos), row)
            dr = h // (HEADS // DST["tp"])
            o = offset(DST, dr, layer, t, h, pos)
            want[dr][o : o + ROW] = row

        slot = b.prepare_receive("py-decode", "r1", DST["table"], TOKENS)
        sslot, peer_slot = a.submit("p1", "py-prefill", SRC["table"], TOKENS, d.peer_b, "py-decode", "r1")
        assert peer_slot == slot, (peer_slot, slot)
        # Decode side: wait_for_layer_load(L) is layer_ready(L), layer by layer.
        for layer in range(LAYERS):
            b.layer_ready(slot, layer, timeout_ms=20000)
        b.decoder_usable(slot, timeout_ms=20000)
        # Prefill side: the source blocks are the engine's again.
        a.source_released(sslot, timeout_ms=20000)
        # The source is done once the destination's verdict came back.
        a.decoder_usable(sslot, timeout_ms=20000)
        assert b.is_ready(slot, kvwire.DECODER_USABLE)
        assert b.status(slot) == "done" and a.status(sslot) == "done", (b.status(slot), a.status(sslot))
        # The full status: the destination's marks, one layer_ready per layer, in time order up to decoder_usable.
        st = b.transfer_status(slot)
        assert (st["state"], st["role"], st["layers"], st["request"]) == ("done", "destination", LAYERS, "r1"), st
        names = [m["name"] for m in st["marks"]]
        assert all("layer_ready(%d)" % l in names for l in range(LAYERS)) and "decoder_usable" in names, names
        at = {m["name"]: m["at_ns"] for m in st["marks"]}
        assert max(at["layer_ready(%d)" % l] for l in range(LAYERS)) <= at["decoder_usable"], st["marks"]
        src_st = a.transfer_status(sslot)
        assert (src_st["role"], src_st["request"]) == ("source", "p1") and "source_released" in [m["name"] for m in src_st["marks"]], src_st
        expect_error(kvwire.KVW_UNKNOWN_SLOT, b.transfer_status, 250)
        for rank, m in enumerate(dst):
            got = m.read()
            if got != bytes(want[rank]):
                bad = [i for i in range(len(got)) if got[i] != want[rank][i]]
                raise AssertionError("rank %d: %d bytes differ, first at %d" % (rank, len(bad), bad[0]))

        # Prepared naming its source: A's connection is idle at B now, so the
        # receive is announced and A's submit claims it; the same bytes land.
        # Both clients' waits and calls sleep at once now, woken by the publish.
        for c in (a, b):
            c.set_wait_spin(0)
            for bad in (-1, 1 << 32, 1.5, True, "200"):
                try:
                    c.set_wait_spin(bad)
                except ValueError as e:
                    assert "wait spin" in str(e), e
                else:
                    raise AssertionError("set_wait_spin(%r) was taken" % (bad,))
        for m in dst:
            m.fill(CANARY)
        slot, announced = b.prepare_announced("py-decode", "r1b", DST["table"], TOKENS, source=a.node)
        assert announced, "not announced to %s" % a.node
        sslot, peer_slot = a.submit("p1b", "py-prefill", SRC["table"], TOKENS, d.peer_b, "py-decode", "r1b")
        assert peer_slot == slot, (peer_slot, slot)
        b.decoder_usable(slot, timeout_ms=20000)
        a.decoder_usable(sslot, timeout_ms=20000)
        for rank, m in enumerate(dst):
            assert m.read() == bytes(want[rank]), "rank %d differs after the announced transfer" % rank

        for rank in range(SRC["tp"]):
            a.release_cache("py-prefill", rank)
        for rank in range(DST["tp"]):
            b.release_cache("py-decode", rank)
        expect_error(kvwire.KVW_UNKNOWN_GROUP, b.release_cache, "py-decode", 0)
        for m in src + dst:
            m.close()
    finally:
        a.close()
        b.close()


def test_streamed_submit_moves_each_layer_once_it_is_produced(d):
    a = kvwire.Client(d.sock_a, "py-stream-src")
    b = kvwire.Client(d.sock_b, "py-stream-dst")
    try:
        src = register_side(a, "py-stream-src", SRC, None)
        dst = register_side(b, "py-stream-dst", DST, CANARY)
        want = [bytearray(m.read()) for m in dst]
        slot = b.prepare_receive("py-stream-dst", "s1", DST["table"], TOKENS)
        # The engine has written nothing yet when it submits.
        sslot, peer_slot = a.submit("ps1", "py-stream-src", SRC["table"], TOKENS, d.peer_b, "py-stream-dst", "s1", stream=True)
        assert peer_slot == slot, (peer_slot, slot)
        for layer in range(LAYERS):
            for l, t, h, pos in rows():
                if l != layer:
                    continue
                row = row_code(l, t, h, pos)
                sr = h // (HEADS // SRC["tp"])
                src[sr].write(offset(SRC, sr, l, t, h, pos), row)
                dr = h // (HEADS // DST["tp"])
                o = offset(DST, dr, l, t, h, pos)
                want[dr][o : o + ROW] = row
            assert not b.is_ready(slot, kvwire.LAYER_READY, layer), layer
            for rank in range(SRC["tp"]):
                a.produced("py-stream-src", "ps1", rank, layer + 1)
            b.layer_ready(slot, layer, timeout_ms=20000)
        b.decoder_usable(slot, timeout_ms=20000)
        a.source_released(sslot, timeout_ms=20000)
        a.decoder_usable(sslot, timeout_ms=20000)
        names = [m["name"] for m in a.transfer_status(sslot)["marks"]]
        assert all("produced(%d)" % l in names for l in range(LAYERS)), names
        for rank, m in enumerate(dst):
            assert m.read() == bytes(want[rank]), "rank %d differs" % rank
        # Only the rank's own client may announce it, and only layers the model has.
        with kvwire.Client(d.sock_a, "py-stream-intruder") as x:
            e = expect_error(kvwire.KVW_PERMISSION_DENIED, x.produced, "py-stream-src", "ps2", 0, 1)
            assert "registered by another client" in e.message, e.message
        e = expect_error(kvwire.KVW_BAD_REQUEST, a.produced, "py-stream-src", "ps2", 0, LAYERS + 1)
        assert "has %d" % LAYERS in e.message, e.message
        for rank in range(SRC["tp"]):
            a.release_cache("py-stream-src", rank)
        for rank in range(DST["tp"]):
            b.release_cache("py-stream-dst", rank)
        for m in src + dst:
            m.close()
    finally:
        a.close()
        b.close()


def test_groups_are_shared_only_under_their_token(d):
    with kvwire.Client(d.sock_b, "py-owner") as a, kvwire.Client(d.sock_b, "py-other") as b:
        a.share_group("py-shared", "0123456789abcdef-py")
        expect_error(kvwire.KVW_PERMISSION_DENIED, b.share_group, "py-shared", "another-token-of-16b")
        expect_error(kvwire.KVW_BAD_REQUEST, b.share_group, "py-shared", "short")
        b.share_group("py-shared", "0123456789abcdef-py")


def test_timeout_cancel_and_bad_arguments(d):
    with kvwire.Client(d.sock_b, "py-cancel") as b:
        mems = register_side(b, "py-cancel", DST, None)
        slot = b.prepare_receive("py-cancel", "r2", DST["table"], TOKENS)
        e = expect_error(kvwire.KVW_TIMEOUT, b.layer_ready, slot, 0, 20)
        assert "not ready" in e.message, e.message
        assert not b.is_ready(slot, kvwire.DECODER_USABLE)
        assert b.status(slot) == "prepared"
        expect_error(kvwire.KVW_INVALID_ARGUMENT, b.wait, slot, 42, 0, 10)
        expect_error(kvwire.KVW_INVALID_ARGUMENT, b.wait, slot, kvwire.LAYER_READY, 1 << 20, 10)
        expect_error(kvwire.KVW_BAD_REQUEST, b.prepare_receive, "py-cancel", "r2", DST["table"], TOKENS)
        b.cancel(slot)
        e = expect_error(kvwire.KVW_CANCELLED, b.decoder_usable, slot, 20000)
        assert "cancel" in e.message, e.message
        assert b.status(slot) == "cancelled"
        expect_error(kvwire.KVW_BAD_REQUEST, b.cancel, slot)
        expect_error(kvwire.KVW_UNKNOWN_SLOT, b.status, 251)
        for rank in range(DST["tp"]):
            b.release_cache("py-cancel", rank)
        for m in mems:
            m.close()


# Engine tensors: (preset, tp, block, blocks, table).
ENG_SRC = dict(preset="vllm_cpu", tp=2, block=16, blocks=9, table=[4, 0, 8, 2, 6, 1, 7])
ENG_DST = dict(preset="flashinfer", tp=1, block=32, blocks=5, table=[3, 0, 4, 1])
GAP = 4096


def eng_index(side, kv, b, t, h):
    """Element index of (K/V, block, slot, local head) in a per-layer tensor, from the engine's shape."""
    nt, nh, nd = side["block"], HEADS // side["tp"], ROW // 2
    if side["preset"] == "vllm_cpu":  # (blocks, heads, block, 2*dim)
        return ((b * nh + h) * nt + t) * 2 * nd + kv * nd
    return (((b * 2 + kv) * nt + t) * nh + h) * nd  # flashinfer: (blocks, 2, block, heads, dim)


def eng_shape(side, heads):
    """A rank's per-layer tensor of the side's preset: shape, role, bf16 bytes and dense strides."""
    shape, role = kvwire.preset_shape(side["preset"], side["blocks"], side["block"], heads, ROW // 2)
    nbytes = 2
    for n in shape:
        nbytes *= n
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return shape, role, nbytes, strides


def eng_register(client, group, side, per_layer_memfd):
    """Allocates the engine's tensors in SharedMemory and registers them; returns per rank [(mem, offset)] by layer."""
    shape, role, nbytes, strides = eng_shape(side, HEADS // side["tp"])
    out = []
    for rank in range(side["tp"]):
        if per_layer_memfd:
            places = [(kvwire.SharedMemory(GAP + nbytes, "layer%d" % l), GAP) for l in range(LAYERS)]
        else:
            one = kvwire.SharedMemory(GAP + LAYERS * (nbytes + GAP))
            places = [(one, GAP + l * (nbytes + GAP)) for l in range(LAYERS)]
        specs = []
        for l, (mem, off) in enumerate(places):
            ctypes_fill(mem, CANARY)
            spec = kvwire.TensorSpec(mem, off, "bf16", tuple(shape), tuple(strides), role, (l, l + 1))
            if numpy is not None:
                # The engine's tensor is a numpy view of the shared memory (fp16: numpy has no
                # bfloat16, and only the element size matters here); its description is read off it.
                view = mem.numpy("fp16", shape, off)
                got = kvwire.TensorSpec.of(view, mem, role, (l, l + 1))
                assert (got.offset, got.shape, got.strides) == (off, tuple(shape), tuple(strides)), got
            specs.append(spec)
        layout = "tp=%d,block=%d,kv=%s" % (side["tp"], side["block"], side["preset"])
        r, b, complete = client.register_tensors(group, MODEL, "bf16", layout, rank, side["blocks"], IDENTITY, specs)
        # One region per layer: K and V share each tensor.
        assert (r, b, complete) == (LAYERS, LAYERS * nbytes, rank == side["tp"] - 1), (r, b, complete)
        out.append(places)
    return out


def ctypes_fill(mem, byte):
    mem.write(0, bytes([byte]) * len(mem))


def eng_locate(side, places, layer, kv, head, pos):
    per = HEADS // side["tp"]
    rank = head // per
    b = side["table"][pos // side["block"]]
    mem, off = places[rank][layer]
    return mem, off + eng_index(side, kv, b, pos % side["block"], head % per) * 2


def move_and_compare(a, b, d, groups, name, mem, want):
    """Moves request `name` from ENG_SRC's group into ENG_DST's table of the
    other group, then checks every byte of `mem` (what lies outside the rows too)."""
    slot = b.prepare_receive(groups[1], name, ENG_DST["table"], TOKENS)
    sslot, _ = a.submit("p" + name, groups[0], ENG_SRC["table"], TOKENS, d.peer_b, groups[1], name)
    b.decoder_usable(slot, timeout_ms=20000)
    a.source_released(sslot, timeout_ms=20000)
    got = mem.read()
    if got != bytes(want):
        bad = [i for i in range(len(got)) if got[i] != want[i]]
        raise AssertionError("%d destination bytes differ, first at %d" % (len(bad), bad[0]))


def test_engine_tensors_in_their_own_device_allocations(d):
    a = kvwire.Client(d.sock_a, "py-deveng-prefill")
    b = kvwire.Client(d.sock_b, "py-deveng-decode")
    try:
        src = eng_register(a, "py-deveng-src", ENG_SRC, True)
        # The decode engine's per-layer tensors, each its own device
        # allocation; with the stand-in backend a memfd plays each one.
        side = ENG_DST
        shape, role, nbytes, strides = eng_shape(side, HEADS)
        gpu = [kvwire.SharedMemory(nbytes, "gpu-layer%d" % l) for l in range(LAYERS)]
        for m in gpu:
            ctypes_fill(m, CANARY)
        allocs = [kvwire.DeviceMemory(0, nbytes, m.fd) for m in gpu]
        specs = [kvwire.TensorSpec(allocs[l], 0, "bf16", tuple(shape), tuple(strides), role, (l, l + 1)) for l in range(LAYERS)]
        layout = "tp=1,block=%d,kv=%s" % (side["block"], side["preset"])
        got = b.register_device_tensors("py-deveng-dst", MODEL, "bf16", layout, 0, side["blocks"], IDENTITY, specs)
        assert got == (LAYERS, LAYERS * nbytes, True), got
        dst = [[(m, 0) for m in gpu]]
        want = [bytearray(m.read()) for m in gpu]
        for layer, kv, h, pos in rows():
            row = row_code(layer, kv, h, pos)
            mem, off = eng_locate(ENG_SRC, src, layer, kv, h, pos)
            mem.write(off, row)
            _, o = eng_locate(side, dst, layer, kv, h, pos)
            want[layer][o : o + ROW] = row
        slot = b.prepare_receive("py-deveng-dst", "g1", side["table"], TOKENS)
        sslot, _ = a.submit("pg1", "py-deveng-src", ENG_SRC["table"], TOKENS, d.peer_b, "py-deveng-dst", "g1")
        b.decoder_usable(slot, timeout_ms=20000)
        a.source_released(sslot, timeout_ms=20000)
        for l, m in enumerate(gpu):
            assert m.read() == bytes(want[l]), "layer %d's device allocation differs" % l
        # A daemon without a device backend names the setting.
        e = expect_error(kvwire.KVW_BAD_REGION, a.register_device_tensors, "py-deveng-bad", MODEL, "bf16", layout, 0, side["blocks"], IDENTITY, specs)
        assert "[device] backend" in e.message, e.message
        for rank in range(ENG_SRC["tp"]):
            a.release_cache("py-deveng-src", rank)
        b.release_cache("py-deveng-dst", 0)
    finally:
        a.close()
        b.close()


def test_views_are_zero_copy(d):
    with kvwire.Mem(4096) as m:
        if numpy is None:
            print("     skipped numpy views: numpy is not installed")
        else:
            v = m.numpy("uint8", (16, 256))
            v[3, 5] = 77
            assert m.read(3 * 256 + 5, 1) == b"\x4d"
            m.write(8, struct.pack("<f", 1.5))
            f = m.numpy("float32", (4,), offset=8)
            assert f[0] == 1.5, f
            s = kvwire.SharedMemory(1 << 12)
            s.numpy("uint8")[100:104] = [1, 2, 3, 4]
            assert s.read(100, 4) == bytes([1, 2, 3, 4])
            e = None
            try:
                m.numpy("fp32", (2048,))
            except IndexError as err:
                e = err
            assert e is not None and "past" in str(e), e
        if torch is None:
            print("     skipped torch views: torch is not installed")
        else:
            t = m.torch(torch.bfloat16, (8, 16), offset=64)
            t[1, 2] = 2.0
            assert m.read(64 + (16 + 2) * 2, 2) == bytes([0x00, 0x40]), m.read(64 + 36, 2)


def test_adopted_memory_keeps_its_address_and_content(d):
    # Memory an engine already allocated (here an anonymous mapping), with data in it.
    import mmap as _mmap

    page = _mmap.PAGESIZE
    anon = _mmap.mmap(-1, 4 * page)
    base = ctypes.addressof((ctypes.c_uint8 * (4 * page)).from_buffer(anon))
    pattern = bytes((i * 7 + 3) & 0xFF for i in range(4 * page))
    ctypes.memmove(base, pattern, len(pattern))
    m = kvwire.SharedMemory.adopt(base + page + 100, page)  # spans pages 1 and 2
    assert (m.ptr, len(m)) == (base + page, 2 * page), (hex(m.ptr), len(m))
    # Nothing moved or changed, the untouched pages included.
    assert ctypes.string_at(base, 4 * page) == pattern
    # The engine's writes through its own pointer land in the memfd, and the memfd's writes show at the pointer.
    ctypes.memmove(base + page + 100, b"engine", 6)
    assert os.pread(m.fd, 6, 100) == b"engine"
    os.pwrite(m.fd, b"daemon", page + 8)
    assert ctypes.string_at(base + 2 * page + 8, 6) == b"daemon"
    assert ctypes.string_at(base + 3 * page, 16) == pattern[3 * page : 3 * page + 16]  # page 3 is still the anonymous map
    m.close()


def test_engine_tensors_move_between_two_layouts(d):
    a = kvwire.Client(d.sock_a, "py-engine-prefill")
    b = kvwire.Client(d.sock_b, "py-engine-decode")
    try:
        src = eng_register(a, "py-eng-src", ENG_SRC, True)
        dst = eng_register(b, "py-eng-dst", ENG_DST, False)
        dst_mem = dst[0][0][0]
        want = bytearray(dst_mem.read())
        for layer, kv, h, pos in rows():
            row = row_code(layer, kv, h, pos)
            mem, off = eng_locate(ENG_SRC, src, layer, kv, h, pos)
            mem.write(off, row)
            _, o = eng_locate(ENG_DST, dst, layer, kv, h, pos)
            want[o : o + ROW] = row
        move_and_compare(a, b, d, ("py-eng-src", "py-eng-dst"), "e1", dst_mem, want)
        if numpy is not None:
            # The engine reads its tensor through the same zero-copy view.
            shape, _ = kvwire.preset_shape("flashinfer", ENG_DST["blocks"], ENG_DST["block"], HEADS, ROW // 2)
            view = dst_mem.numpy("fp16", shape, dst[0][1][1])
            blk = ENG_DST["table"][0]
            assert view[blk, 1, 3, 2].tobytes() == row_code(1, 1, 2, 3), "layer 1 V, position 3, head 2"
        # A tensor that reaches past its memfd is refused by name.
        mem = kvwire.SharedMemory(1 << 12)
        bad = kvwire.TensorSpec(mem, 0, "bf16", (2, 2, 16, 4, 16), (2048, 1024, 64, 16, 1), "kv", (0, 1))
        e = expect_error(kvwire.KVW_BAD_REGION, b.register_tensors, "py-eng-bad", MODEL, "bf16", "tp=1,block=16,kv=vllm_nhd", 0, 2, IDENTITY, [bad])
        assert "past memory 0" in e.message, e.message
        # A model given as a path to its config.json is read by the client library.
        cfg = os.path.join(tempfile.mkdtemp(prefix="kvwire-py-cfg."), "config.json")
        with open(cfg, "w") as f:
            f.write('{"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 256, "torch_dtype": "bfloat16"}')
        regions, _ = kvwire.cache_size({"hf_config": cfg}, "bf16", "tp=1,block=16", 0, 4)
        assert regions == 4, regions
        e = expect_error(kvwire.KVW_BAD_MODEL, kvwire.cache_size, {"hf_config": cfg + ".missing"}, "bf16", "tp=1", 0, 4)
        assert "neither" in e.message, e.message
        for rank in range(ENG_SRC["tp"]):
            a.release_cache("py-eng-src", rank)
        b.release_cache("py-eng-dst", 0)
    finally:
        a.close()
        b.close()


def test_padded_engine_views_register_with_the_pad_their_strides_imply(d):
    # The decode engine's per-layer FlashInfer tensors are views: pages padded
    # by 24 elements, and rows of a wider tensor's first HEADS heads (2 more after them).
    a = kvwire.Client(d.sock_a, "py-pad-prefill")
    b = kvwire.Client(d.sock_b, "py-pad-decode")
    side = dict(ENG_DST)
    dim, wide = ROW // 2, HEADS + 2
    sizes = {"b": side["blocks"], "k": 2, "t": side["block"], "h": HEADS, "d": dim}
    st = {"d": 1, "h": dim, "t": wide * dim}
    st["k"] = side["block"] * st["t"]
    st["b"] = 2 * st["k"] + 24
    shape, strides = tuple(sizes[c] for c in "bkthd"), tuple(st[c] for c in "bkthd")
    span = (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * 2
    try:
        pad = kvwire.layout_pad("flashinfer", shape, strides, side["blocks"], side["block"], HEADS, dim)
        assert pad == "b24:t%d" % (2 * dim), pad
        dense_shape, _, _, dense_strides = eng_shape(side, HEADS)
        assert kvwire.layout_pad("flashinfer", dense_shape, dense_strides, side["blocks"], side["block"], HEADS, dim) == ""
        try:
            kvwire.layout_pad("flashinfer", shape, strides[:-2] + (1, dim), side["blocks"], side["block"], HEADS, dim)
            raise AssertionError("heads laid out inside their rows were given a pad")
        except ValueError as e:
            assert "in memory order its sizes are" in str(e), e
        src = eng_register(a, "py-pad-src", ENG_SRC, True)
        mem = kvwire.SharedMemory(GAP + LAYERS * (span + GAP))
        ctypes_fill(mem, CANARY)
        offs = [GAP + l * (span + GAP) for l in range(LAYERS)]
        specs = [kvwire.TensorSpec(mem, o, "bf16", shape, strides, "kv", (l, l + 1)) for l, o in enumerate(offs)]
        if numpy is not None:
            got = kvwire.TensorSpec.of(mem.numpy("fp16", shape, offs[1], strides), mem, "kv", (1, 2))
            assert (got.offset, got.strides, got.nbytes) == (offs[1], strides, span), got
        dense = "tp=1,block=%d,kv=flashinfer" % side["block"]
        e = expect_error(kvwire.KVW_BAD_REGION, b.register_tensors, "py-pad-dst", MODEL, "bf16", dense, 0, side["blocks"], IDENTITY, specs)
        assert "give the layout `pad=%s`" % pad in e.message, e.message
        b.register_tensors("py-pad-dst", MODEL, "bf16", dense + ",pad=" + pad, 0, side["blocks"], IDENTITY, specs)
        want = bytearray(mem.read())
        for layer, kv, h, pos in rows():
            row = row_code(layer, kv, h, pos)
            m, off = eng_locate(ENG_SRC, src, layer, kv, h, pos)
            m.write(off, row)
            blk = side["table"][pos // side["block"]]
            at = offs[layer] + (blk * st["b"] + kv * st["k"] + (pos % side["block"]) * st["t"] + h * st["h"]) * 2
            want[at : at + ROW] = row
        move_and_compare(a, b, d, ("py-pad-src", "py-pad-dst"), "p1", mem, want)
        for rank in range(ENG_SRC["tp"]):
            a.release_cache("py-pad-src", rank)
        b.release_cache("py-pad-dst", 0)
    finally:
        a.close()
        b.close()


def test_vllm_tensors_map_to_presets_and_device_tensors_group_by_allocation(d):
    # vLLM's per-layer caches by shape and strides, as its backends allocate them.
    nb, T, H, D = 7, 4, 4, 16  # block size and heads equal: only the strides tell NHD from HND

    def dense(shape):
        out = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            out[i] = out[i + 1] * shape[i + 1]
        return out

    def permuted(phys, order):
        # A dense tensor laid out as `phys`, viewed with its dims in `order` (vLLM allocates HND this way).
        st = dense(phys)
        return tuple(phys[i] for i in order), tuple(st[i] for i in order)

    fa_hnd = permuted((2, nb, H, T, D), (0, 1, 3, 2, 4))
    fi_hnd = permuted((nb, 2, H, T, D), (0, 1, 3, 2, 4))
    padded = ((2, nb, T, H, D), (nb * (T * H * D + 40), T * H * D + 40, H * D, D, 1))
    cases = [
        (((nb, H, T, 2 * D), dense((nb, H, T, 2 * D))), ("vllm_cpu", "", "kv_packed", nb)),
        (((2, nb, T, H, D), dense((2, nb, T, H, D))), ("vllm_nhd", "", "kv", nb)),
        (fa_hnd, ("vllm_hnd", "", "kv", nb)),
        (((nb, 2, T, H, D), dense((nb, 2, T, H, D))), ("flashinfer", "", "kv", nb)),
        (fi_hnd, ("flashinfer_hnd", "", "kv", nb)),
        (padded, ("vllm_nhd", "b40", "kv", nb)),
    ]
    for (shape, strides), want in cases:
        got = kvwire.vllm_layout(shape, strides, T, H, D)
        assert got == want, (shape, strides, got, want)
    for shape, says in [((nb, 3, T, H, D), "FlashAttention"), ((2, 2, T, H, D), "same shape")]:
        try:
            kvwire.vllm_layout(shape, dense(shape), T, H, D)
            raise AssertionError("%r was mapped" % (shape,))
        except ValueError as e:
            assert says in str(e), e
    # The daemon reads the mapped HND view as vllm_hnd: registered as it is.
    b = kvwire.Client(d.sock_b, "py-vllm-map")
    try:
        shape, strides = fa_hnd
        size = 2 * nb * T * H * D * 2
        mem = kvwire.SharedMemory(LAYERS * size)
        specs = [kvwire.TensorSpec(mem, l * size, "bf16", shape, strides, "kv", (l, l + 1)) for l in range(LAYERS)]
        preset, pad, _, _ = kvwire.vllm_layout(shape, strides, T, H, D)
        b.register_tensors("py-vllm-map", MODEL, "bf16", "tp=1,block=%d,kv=%s" % (T, preset), 0, nb, IDENTITY, specs)
        b.release_cache("py-vllm-map", 0)
    finally:
        b.close()
    # CUDA tensors: two layers in one caching-allocator segment (one IPC handle), one in another.
    h1, h2 = bytes(range(64)), bytes(range(1, 65))
    mems, where = kvwire.device_memories([(0, h1, 0, 4096, 0), (0, h1, 4096, 4096, 256), (0, h2, 512, 1024, 0)])
    assert [(m.ordinal, m.length, m.ipc) for m in mems] == [(0, 8192, h1), (0, 1536, h2)], mems
    assert where == [(0, 0), (0, 4352), (1, 512)], where
    # torch shares a storage by a version byte, a type byte and the raw handle.
    assert kvwire.cuda_ipc_handle(bytes([2]) + b"c" + h1) == h1
    assert kvwire.cuda_ipc_handle(bytes([3]) + b"c" + h2) == h2
    assert kvwire.cuda_ipc_handle(h1) == h1
    for bad, says in [(bytes([2]) + b"e" + bytes(40), "expandable_segments:False"), (bytes([2]) + b"x" + h1, "66 bytes"), (h1[:10], "10 bytes")]:
        try:
            kvwire.cuda_ipc_handle(bad)
            raise AssertionError("%r was read as a handle" % (bad,))
        except ValueError as e:
            assert says in str(e), e


TESTS = [
    test_result_codes_match_the_header,
    test_connect_errors,
    test_mem_and_cache_size,
    test_bad_layout_is_102_with_the_daemons_message,
    test_transfer_every_layer_and_every_byte,
    test_streamed_submit_moves_each_layer_once_it_is_produced,
    test_groups_are_shared_only_under_their_token,
    test_timeout_cancel_and_bad_arguments,
    test_engine_tensors_in_their_own_device_allocations,
    test_views_are_zero_copy,
    test_adopted_memory_keeps_its_address_and_content,
    test_engine_tensors_move_between_two_layouts,
    test_padded_engine_views_register_with_the_pad_their_strides_imply,
    test_vllm_tensors_map_to_presets_and_device_tensors_group_by_allocation,
]


def run(tests, d):
    """Runs ``tests`` against daemons ``d`` and stops them; the exit code."""
    passed = failed = 0
    try:
        for t in tests:
            try:
                t(d)
            except Exception:
                failed += 1
                print("FAIL %s" % t.__name__)
                traceback.print_exc()
            else:
                passed += 1
                print("ok   %s" % t.__name__)
    finally:
        d.stop()
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


def main():
    return run(TESTS, Daemons())


if __name__ == "__main__":
    sys.exit(main())
