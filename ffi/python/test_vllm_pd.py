"""Prefill/decode disaggregation with two real vLLM engines through two kvwired.

Run by scripts/vllm-pd (scripts/test runs it; scripts/demo --vllm shows it)
with the python of target/vllm-venv (vLLM's CPU build):

    python test_vllm_pd.py [--demo] [--keep] [--mp]

(--mp: vLLM's own process layout, an engine core and a worker process per
engine; by default each engine is one process, a minute less on 2 cores.)

It makes a tiny Llama with random weights (transformers, no hub), starts
two daemons on loopback (decode-host's data port behind a proxy that can
flip one byte of one write in transit), and two vLLM engines, each in its
own process with kvwire's connector (kvwire.vllm): a producer
(kv_role="kv_producer", prefix caching off) that prefills and a consumer
(kv_role="kv_consumer", kv_load_failure_policy="recompute") that decodes.

Checked (exit 1 on the first failure):
  1. greedy tokens and every logprob of the pair equal a plain run of the
     same prompts (the producer engine, no transfer), bitwise, for prompts
     of 13, 128, 131 and 200 tokens (vLLM's CPU block is 128 tokens), each
     loaded through kvwire (the consumer's trace says so), with the same
     block digests on both sides; one request at a time, and vLLM's CPU
     attention unsplit (VLLM_CPU_ATTN_SPLIT_KV=0; see main for why);
  2. a prompt sharing a full block with an earlier one hits the consumer's
     prefix cache: the daemon skips that block (reused_bytes) and moves the
     rest, and the output is still bitwise that of the plain run;
  3. negative control: one byte flipped in transit fails the layer's
     checksum, the consumer reports a failed load, vLLM recomputes, and the
     output equals the plain run; the refused transfer is never used, and
     the producer hears the destination's refusal (its verdict);
  5. a TP=2 producer (one KV head per rank) into the TP=1 consumer: each
     head's bytes arrive as the producer's rank held them (per-head
     digests), and the greedy tokens equal a TP=1 plain run (logprobs
     within 1e-3: TP=2's all-reduce sums in another order).
Then it measures the consumer's time to first token with kvwire against
recomputing the prompt locally, with kvwire's own marks, and prints the
order in which vLLM called the connector's hooks.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
BLOCK = 128  # vLLM's CPU block size (checked against the connector's trace)
MAX_MODEL_LEN = 256
MAX_TOKENS = 8
LOGPROBS = 5
SECRET = "kvwire-vllm-pd-shared-secret\n"
MP = os.environ.get("KVWIRE_VLLM_MP") == "1"


def log(msg: str) -> None:
    print(msg, flush=True)


def fail(msg: str) -> None:
    print("FAILED: " + msg, flush=True)
    raise SystemExit(1)


# --------------------------------------------------------------------------
# One engine, in its own process (this file run with --engine).


def engine_main(argv) -> None:
    role, model, sock, group, trace, reply_fd, tp = argv
    tp = int(tp)
    out = os.fdopen(int(reply_fd), "w", buffering=1)

    def reply(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {"socket": sock, "group": group, "trace": trace, "digest": True, "stream": os.environ.get("KVWIRE_TEST_STREAM", "1") == "1"}
    if role == "kv_producer":
        extra.update(peer="decode-host", dst_group="decode")
    else:
        # Each receive is announced to the producer's daemon: its submits claim them with no round trip.
        extra.update(source="prefill-host")
    ktc = KVTransferConfig(
        kv_connector="KvwireConnector",
        kv_connector_module_path="kvwire.vllm",
        kv_role=role,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    llm = LLM(
        model=model,
        enforce_eager=True,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=0.2,
        num_gpu_blocks_override=48,
        skip_tokenizer_init=True,
        enable_prefix_caching=(role == "kv_consumer"),
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=ktc,
        # One process per engine (scheduler and worker together; vLLM's
        # default spawns two more, each importing torch and vLLM again: a
        # minute more on 2 cores). --mp keeps vLLM's default.
        **({"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {} if MP else {"distributed_executor_backend": "uni"}),
    )
    reply({"ready": True, "startup_s": time.monotonic() - t0})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        sps = [
            SamplingParams(
                max_tokens=cmd["max_tokens"],
                temperature=0.0,
                logprobs=LOGPROBS,
                detokenize=False,
                extra_args={"kv_transfer_params": p} if p else None,
            )
            for p in cmd["params"]
        ]
        t = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in cmd["prompts"]], sps, use_tqdm=False)
        wall = time.monotonic() - t
        res = []
        for o in outs:
            c = o.outputs[0]
            lps = [sorted([tok, lp.logprob.hex(), lp.rank] for tok, lp in step.items()) for step in (c.logprobs or [])]
            m = o.metrics
            res.append(
                {
                    "token_ids": list(c.token_ids),
                    "logprobs": lps,
                    "finish_reason": c.finish_reason,
                    "num_cached_tokens": o.num_cached_tokens,
                    "kv_transfer_params": o.kv_transfer_params,
                    "ttft": getattr(m, "first_token_latency", None),
                    "queued_ts": getattr(m, "queued_ts", None),
                    "first_token_ts": getattr(m, "first_token_ts", None),
                }
            )
        reply({"outputs": res, "wall": wall})
    reply({"bye": True})


class Engine:
    """An engine process: commands on its stdin, replies on a pipe of its own (vLLM logs to stdout)."""

    def __init__(self, name, role, model, sock, group, trace, logdir, env, tp=1):
        self.name = name
        r, w = os.pipe()
        self.log_path = os.path.join(logdir, name + ".log")
        self.logf = open(self.log_path, "w")
        self.p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--engine", role, model, sock, group, trace, str(w), str(tp)],
            stdin=subprocess.PIPE,
            stdout=self.logf,
            stderr=subprocess.STDOUT,
            pass_fds=[w],
            env=env,
            text=True,
        )
        os.close(w)
        self.replies = os.fdopen(r)

    def recv(self):
        line = self.replies.readline()
        if not line:
            self.p.wait(timeout=30)
            tail = open(self.log_path).read()[-3000:]
            fail("engine %s exited (%s); its log ends:\n%s" % (self.name, self.p.returncode, tail))
        return json.loads(line)

    def send(self, prompts, params, max_tokens):
        self.p.stdin.write(json.dumps({"op": "generate", "prompts": prompts, "params": params, "max_tokens": max_tokens}) + "\n")
        self.p.stdin.flush()

    def generate(self, prompts, params, max_tokens):
        self.send(prompts, params, max_tokens)
        return self.recv()

    def stop(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.p.stdin.flush()
                self.p.wait(timeout=60)
            except Exception:
                self.p.kill()
                self.p.wait()
        self.logf.close()


def pair(consumer, producer, prompts, names, max_tokens=MAX_TOKENS):
    """One disaggregated batch: both engines get the prompts at once."""
    consumer.send(prompts, [{"kvwire_recv": {"request": n}} for n in names], max_tokens)
    producer.send(prompts, [{"kvwire_send": {"request": n}} for n in names], 1)
    c = consumer.recv()
    p = producer.recv()
    return c, p


# --------------------------------------------------------------------------
# The daemons, and a proxy in front of decode-host's data port.


class Proxy:
    """Forwards TCP connections to `upstream`; when armed, flips the first
    data byte of the next write frame from the source (kind 2, or a strided
    write, kind 6, after its 16-byte prefix). Frames: a 40-byte header
    (kind u16 at 4, payload length u64 at 32), then the payload
    (core/src/protocol.rs)."""

    def __init__(self, upstream):
        self.upstream = upstream
        self.armed = threading.Event()
        self.flipped = 0
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(16)
        self.addr = "127.0.0.1:%d" % self.srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                down, _ = self.srv.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(up, down), daemon=True).start()
            threading.Thread(target=self._frames, args=(down, up), daemon=True).start()

    @staticmethod
    def _pipe(src, dst):
        try:
            while True:
                b = src.recv(1 << 16)
                if not b:
                    break
                dst.sendall(b)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @staticmethod
    def _read(s, n):
        buf = bytearray()
        while len(buf) < n:
            b = s.recv(n - len(buf))
            if not b:
                raise EOFError
            buf += b
        return buf

    def _frames(self, down, up):
        try:
            while True:
                h = self._read(down, 40)
                (kind,) = struct.unpack_from("<H", h, 4)
                (n,) = struct.unpack_from("<Q", h, 32)
                payload = self._read(down, n) if n else bytearray()
                # A write's first data byte: a plain write's payload starts
                # with it, a strided write's (kind 6) after its 16-byte prefix.
                at = {2: 0, 6: 16}.get(kind)
                if at is not None and n > at and self.armed.is_set():
                    self.armed.clear()
                    payload[at] ^= 0x40
                    self.flipped += 1
                up.sendall(bytes(h) + bytes(payload))
        except (OSError, EOFError):
            pass
        for s in (down, up):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Daemons:
    def __init__(self, work):
        self.work = work
        self.procs = []
        exe = os.environ.get("KVWIRED", os.path.join(ROOT, "target", "debug", "kvwired"))
        if not os.access(exe, os.X_OK):
            fail("%s not found: cargo build -p kvwired" % exe)
        secret = os.path.join(work, "secret")
        with open(secret, "w") as f:
            f.write(SECRET)
        os.chmod(secret, 0o600)
        port = free_port()
        self.proxy = Proxy(("127.0.0.1", port))
        transport = '[transport]\nkind = "tcp"\ntcp_listen = "127.0.0.1:%d"\ntcp_advertise = "%s"\n' % (port, self.proxy.addr)
        self.sock_d, addr_d = self._start(exe, "decode-host", transport, secret)
        transport = '[transport]\nkind = "tcp"\ntcp_listen = "127.0.0.1:0"\n[[peers]]\nname = "decode-host"\naddress = "%s"\n' % addr_d
        self.sock_p, _ = self._start(exe, "prefill-host", transport, secret)

    def starts(self):
        """Each daemon's kvwire_starts_total (receives announced, transfers claimed or offered), from `kvwire stats`."""
        cli = os.path.join(os.path.dirname(os.environ.get("KVWIRED", os.path.join(ROOT, "target", "debug", "kvwired"))), "kvwire")
        out = []
        for node, sock in (("prefill-host", self.sock_p), ("decode-host", self.sock_d)):
            try:
                st = json.loads(subprocess.run([cli, "stats", "--socket", sock, "--json"], capture_output=True, text=True, timeout=30).stdout)
                out.append("%s %s" % (node, ", ".join("%s %d" % (h["how"], h["count"]) for h in st.get("starts", []))))
            except (OSError, ValueError, subprocess.SubprocessError) as e:
                out.append("%s: no stats (%s)" % (node, e))
        return "; ".join(out)

    def _start(self, exe, node, transport, secret):
        sock = os.path.join(self.work, node + ".sock")
        cfg = 'node = "%s"\ncontrol_socket = "%s"\npeer_listen = "127.0.0.1:0"\nsecret_file = "%s"\n%s' % (node, sock, secret, transport)
        path = os.path.join(self.work, node + ".toml")
        with open(path, "w") as f:
            f.write(cfg)
        err = open(os.path.join(self.work, node + ".err"), "w")
        p = subprocess.Popen([exe, "--config", path], stdout=subprocess.PIPE, stderr=err, text=True)
        self.procs.append(p)
        line = p.stdout.readline()
        if not line.startswith("kvwired ready"):
            fail("daemon %s did not start: %r (%s)" % (node, line, open(err.name).read()[-2000:]))
        return sock, next(w[len("peer="):] for w in line.split() if w.startswith("peer="))

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# --------------------------------------------------------------------------
# Checks and reports.


def read_trace(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        if g["token_ids"] != w["token_ids"]:
            fail("%s, prompt %d: tokens %s, the plain run %s" % (what, i, g["token_ids"], w["token_ids"]))
        if g["logprobs"] != w["logprobs"]:
            for step, (a, b) in enumerate(zip(g["logprobs"], w["logprobs"])):
                if a != b:
                    fail("%s, prompt %d, token %d: logprobs %s, the plain run %s" % (what, i, step, a, b))
            fail("%s, prompt %d: logprobs differ in length" % (what, i))
    if len(got) != len(want):
        fail("%s: %d outputs for %d prompts" % (what, len(got), len(want)))


def events(trace, name, **match):
    return [e for e in trace if e["event"] == name and all(e.get(k) == v for k, v in match.items())]


def await_events(path, name, requests, timeout=30.0):
    """`name` events for every one of `requests`, read from the trace at
    `path`, waiting for them up to `timeout` s. The producer traces `sent`
    from its own send thread once the daemon released the source, which may
    be after its generate() and the consumer's have both returned."""
    deadline = time.monotonic() + timeout
    while True:
        got = {e["request"]: e for e in events(read_trace(path), name) if e.get("request") in requests}
        if set(requests) <= set(got) or time.monotonic() >= deadline:
            return got
        time.sleep(0.05)


HOOKS = {
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
    "register_kv_caches", "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
    "wait_for_save", "get_finished",
}


def hook_order(trace, name):
    """The hooks in the order vLLM called them for kvwire request `name`:
    from the first event naming its vLLM request id through its
    request_finished, steps without kvwire work left out (the connector
    traces only steps with work), runs of one hook collapsed (`xN`); then
    the step whose get_finished reported it in finished_sending, if any."""
    req = next((e["req"] for e in trace if e["event"] in ("prepared", "sent") and e.get("request") == name), None)
    if req is None:
        return "(no trace of %s)" % name
    start = next(i for i, e in enumerate(trace) if req in json.dumps(e))
    seq = []
    end = len(trace)
    for i, e in enumerate(trace[start:], start):
        if e["event"] not in HOOKS:
            continue
        label = "%s:%s" % (e["role"], e["event"])
        if e["event"] in ("wait_for_layer_load", "save_kv_layer"):
            label += "(%s)" % e.get("layer")
        seq.append(label)
        if e["event"] == "request_finished" and e.get("req") == req:
            end = i
            break
    out = []
    for s in seq:
        if out and out[-1][0] == s:
            out[-1][1] += 1
        else:
            out.append([s, 1])
    text = " -> ".join(s if n == 1 else "%s x%d" % (s, n) for s, n in out)
    if any(e["event"] == "get_finished" and req in e.get("sending", []) for e in trace[end:]):
        text += " -> ... -> W:get_finished (finished_sending: the blocks are freed)"
    return text


def prompt(rng, n):
    return [rng.randrange(1, 500) for _ in range(n)]


def ms(x):
    return "%.1f" % (x * 1e3) if x is not None else "-"


def main(argv) -> int:
    demo = "--demo" in argv
    keep = "--keep" in argv
    if "--mp" in argv:
        os.environ["KVWIRE_VLLM_MP"] = "1"
    t_start = time.monotonic()
    work = tempfile.mkdtemp(prefix="kvwire-vllm-pd.")
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CACHE_ROOT=os.path.join(work, "vllm-cache"),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONPATH=HERE + os.pathsep + env.get("PYTHONPATH", ""),
        # vLLM's CPU attention splits one query's keys across threads by
        # default, so a token computed alone (the consumer's last prompt
        # token, over the loaded cache) sums in another order than the same
        # token inside a prefill: the logprobs then differ in the last bits
        # (measured with the 128-token prompt). Both engines run unsplit.
        VLLM_CPU_ATTN_SPLIT_KV=os.environ.get("VLLM_CPU_ATTN_SPLIT_KV", "0"),
    )
    if not MP and "--mp" not in argv:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.update(env)
    daemons = engines = None
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        model = os.path.join(work, "tiny-llama")
        torch.manual_seed(1234)
        cfg = LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=MAX_MODEL_LEN, initializer_range=0.2,
            tie_word_embeddings=False, torch_dtype="float32",
        )
        LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(model, safe_serialization=True)
        log("model: a tiny Llama (4 layers, 4 heads, 2 KV heads, head 32, random weights) in %s" % model)

        daemons = Daemons(work)
        log("daemons: prefill-host and decode-host on loopback (tcp; decode-host's data port behind a byte-flipping proxy, disarmed)")
        ptrace, ctrace = os.path.join(work, "producer.trace"), os.path.join(work, "consumer.trace")
        # One core each when there are two: both engines busy-loop while they wait, and vLLM's
        # OpenMP threads of one engine spinning on the other's core stall both (measured: TTFT
        # outliers of 200+ ms with both engines on both cores).
        cores = len(os.sched_getaffinity(0))
        pin = (lambda c: {"VLLM_CPU_OMP_THREADS_BIND": str(c)}) if cores >= 2 else (lambda c: {})
        producer = Engine("producer", "kv_producer", model, daemons.sock_p, "prefill", ptrace, work, dict(env, **pin(0)))
        consumer = Engine("consumer", "kv_consumer", model, daemons.sock_d, "decode", ctrace, work, dict(env, **pin(1)))
        engines = [producer, consumer]
        for e in engines:
            r = e.recv()
            log("engine %s ready in %.1f s" % (e.name, r["startup_s"]))
        reg = events(read_trace(ctrace), "register_kv_caches")
        if not reg:
            fail("the consumer registered no KV cache")
        log("consumer registered vLLM's tensors: %s" % json.dumps({k: reg[0][k] for k in ("layout", "fmt", "num_blocks", "layers", "shape", "strides", "memfds", "regions", "bytes")}))
        if reg[0]["shape"][2] != BLOCK:
            fail("vLLM's CPU block is %d tokens, not %d" % (reg[0]["shape"][2], BLOCK))

        rng = random.Random(7)
        lengths = [13, 128, 131, 200]
        prompts = [prompt(rng, n) for n in lengths]

        # 1. The plain run, then the pair, one request at a time: vLLM's CPU
        # attention splits its reductions by the shape of the batch, so two
        # runs agree bitwise only when their batches do (a batch of four
        # requests, loaded two and two, decodes its last tokens in batches the
        # plain run never had: the logprobs then differ in the last bits).
        base = [producer.generate([q], [None], MAX_TOKENS)["outputs"][0] for q in prompts]
        names = ["pd-%d" % n for n in lengths]
        c = {"outputs": []}
        p = {"outputs": []}
        for q, n in zip(prompts, names):
            ci, pi = pair(consumer, producer, [q], [n])
            c["outputs"] += ci["outputs"]
            p["outputs"] += pi["outputs"]
        ct = read_trace(ctrace)
        done = {e["request"]: e for e in events(ct, "recv_done")}
        for n in names:
            if n not in done:
                fail("request %s was not loaded through kvwire (consumer trace: %s)" % (n, [e for e in ct if n in json.dumps(e)][-3:]))
        same(c["outputs"], base, "pair")
        sd = {e["request"]: e["heads"] for e in events(read_trace(ptrace), "send_digest")}
        rd = {e["request"]: e["heads"] for e in events(ct, "recv_digest")}
        for n in names:
            if sd.get(n) is None or sd.get(n) != rd.get(n):
                fail("request %s: the producer's blocks hash to %s, the consumer's to %s" % (n, sd.get(n), rd.get(n)))
        sent = await_events(ptrace, "sent", names)
        if set(names) - set(sent):
            fail("the producer did not send %s" % sorted(set(names) - set(sent)))
        # Streamed: the source daemon moved each layer once the producer's forward announced it.
        for n in names:
            marks = [m["name"] for m in sent[n]["marks"]]
            if not all("produced(%d)" % l in marks for l in range(4)):
                fail("request %s was not streamed layer by layer: the source's marks are %s" % (n, marks))
        for o in p["outputs"]:
            if not (o["kv_transfer_params"] or {}).get("kvwire_sent"):
                fail("the producer's output carries no kvwire_sent: %s" % o["kv_transfer_params"])
        log("check 1 passed: %d prompts of %s tokens, prefilled by the producer and streamed by kvwire layer by layer as its forward wrote them; the consumer's %d tokens and %d logprobs each are bitwise those of the plain run"
            % (len(prompts), lengths, MAX_TOKENS, LOGPROBS))
        for n, L in zip(names, lengths):
            d = done[n]
            log("  %-7s %3d tokens: %7d bytes moved, %d blocks, submit attempts %d" % (n, L, d["bytes"], len(events(ct, "prepared", request=n)[0]["blocks"]), sent[n]["attempts"]))

        # 2. A prefix-cache hit on the consumer: the first block of the 131-token prompt, then new tokens.
        px = prompts[2][:BLOCK] + prompt(rng, 190 - BLOCK)
        basex = producer.generate([px], [None], MAX_TOKENS)["outputs"]
        c, _ = pair(consumer, producer, [px], ["pd-prefix"])
        ct = read_trace(ctrace)
        prep = events(ct, "prepared", request="pd-prefix")
        d = events(ct, "recv_done", request="pd-prefix")
        if not prep or not d:
            fail("the prefix request was not loaded through kvwire")
        if prep[0]["prefix_tokens"] != BLOCK or not d[0]["reused_bytes"]:
            fail("no prefix hit: prepared %s, done %s" % (prep[0], d[0]))
        same(c["outputs"], basex, "prefix hit")
        log("check 2 passed: the consumer's prefix cache held the first %d tokens; the daemon skipped %d bytes, moved %d, and the output is bitwise the plain run's"
            % (BLOCK, d[0]["reused_bytes"], d[0]["bytes"]))

        # 3. Negative control: one byte flipped in transit.
        pf = prompt(rng, 150)
        basef = producer.generate([pf], [None], MAX_TOKENS)["outputs"]
        daemons.proxy.armed.set()
        c, _ = pair(consumer, producer, [pf], ["pd-corrupt"])
        if daemons.proxy.flipped != 1:
            fail("the proxy flipped %d bytes" % daemons.proxy.flipped)
        ct = read_trace(ctrace)
        bad = events(ct, "recv_failed", request="pd-corrupt")
        if events(ct, "recv_done", request="pd-corrupt"):
            fail("the corrupted transfer was reported usable")
        if not bad or "checksum mismatch" not in (bad[0].get("error") or "") + bad[0].get("why", ""):
            fail("the corrupted transfer did not fail its checksum: %s" % bad)
        if c["outputs"][0]["num_cached_tokens"] != 0:
            fail("after the failed load the consumer still counted %d cached tokens" % c["outputs"][0]["num_cached_tokens"])
        same(c["outputs"], basef, "negative control")
        # One verdict: the producer hears that the consumer refused the data, with the reason:
        # as the transfer's own failure when the consumer refused a layer while later ones were
        # still being written (their writes are refused then), else as the verdict after the
        # source was released.
        def heard(pt):
            return [e for e in events(pt, "verdict", request="pd-corrupt") if e["verdict"] == "failed"] + events(pt, "send_failed", request="pd-corrupt")
        deadline = time.monotonic() + 30
        while not heard(read_trace(ptrace)) and time.monotonic() < deadline:
            time.sleep(0.1)
        v = heard(read_trace(ptrace))
        if not v or "checksum mismatch" not in v[0]["why"]:
            fail("the producer did not hear the consumer's checksum refusal: %s" % v)
        if any(e["verdict"] != "usable" for e in events(read_trace(ptrace), "verdict") if e["request"] != "pd-corrupt"):
            fail("a transfer other than the corrupted one has a failed verdict")
        log("check 3 passed: a byte flipped in transit was refused (%s); vLLM recomputed the prompt and decoded the plain run's tokens; the producer heard the refusal"
            % (bad[0].get("error") or bad[0]["why"])[:160])

        # The plain run of the prompts the TP=2 producer sends later (check 5), on this TP=1 engine.
        tp_lengths = [13, 131]
        tp_prompts = [prompt(rng, n) for n in tp_lengths]
        base_tp1 = [producer.generate([q], [None], MAX_TOKENS)["outputs"][0] for q in tp_prompts]

        # 4. Time to first token on the consumer: kvwire against recomputing the prompt.
        reps = 3 if demo else 1

        def ttft_table(producer, ptrace, how):
            table = []
            for L in (32, 128, 250):
                rows = []
                for rep in range(reps + 1):  # the first of each is a warm-up
                    pk, pr = prompt(rng, L), prompt(rng, L)
                    n = "ttft-%s-%d-%d" % (how, L, rep)
                    c, _ = pair(consumer, producer, [pk], [n], max_tokens=1)
                    r = consumer.generate([pr], [None], 1)
                    if not rep:
                        continue
                    ct = read_trace(ctrace)
                    d = events(ct, "recv_done", request=n)[0]
                    sd = await_events(ptrace, "sent", [n]).get(n)
                    if sd is None:
                        fail("the producer traced no sent for %s within 30 s" % n)
                    o = c["outputs"][0]
                    m = {x["name"]: x["at_ns"] / 1e6 for x in d["marks"]}
                    sm = {x["name"]: x["at_ns"] / 1e6 for x in sd["marks"]}
                    # Streamed: from the last layer's announcement; whole: from the submit, made once the forward ended.
                    written = sm.get("produced(3)", sm.get("enqueued", 0.0))
                    rows.append({
                        "kvwire": o["ttft"] * 1e3,
                        "recompute": r["outputs"][0]["ttft"] * 1e3,
                        # One clock (CLOCK_MONOTONIC) across the engines' processes.
                        "queued->prepare": (d["t_prepared"] - o["queued_ts"]) * 1e3,
                        "prepare->submit": (sd["t_first_submit"] - d["t_prepared"]) * 1e3,
                        "submit->seen": (d["t_seen"] - sd["t_first_submit"]) * 1e3,
                        "seen->first token": (o["first_token_ts"] - d["t_seen"]) * 1e3,
                        "layers": [m.get("layer_ready(%d)" % l) for l in range(4)],
                        "decoder_usable": m.get("decoder_usable"),
                        "written->released": sm["source_released"] - written,
                        "attempts": sd["attempts"],
                    })
                row = {k: statistics.median([x[k] for x in rows]) for k in rows[0] if k not in ("layers", "attempts")}
                row["layers"] = [statistics.median([x["layers"][l] for x in rows]) for l in range(4)]
                row["attempts"] = max(x["attempts"] for x in rows)
                table.append((L, row))
            log("")
            log("time to first token on the consumer, %s, ms (each column the median of %d; TTFT is vLLM's first_token_latency), and where the kvwire one went:" % (how, reps))
            log("| prompt | TTFT kvwire | TTFT recompute | queued -> prepared | prepared -> producer submits | submit -> decoder_usable seen | seen -> first token | daemon: layer_ready(0..3) | daemon: decoder_usable | source: last layer written -> source_released | submit attempts |")
            log("|---|---|---|---|---|---|---|---|---|---|---|")
            for L, m in table:
                log("| %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %s | %.2f | %.2f | %d |" % (
                    L, m["kvwire"], m["recompute"], m["queued->prepare"], m["prepare->submit"], m["submit->seen"], m["seen->first token"],
                    " / ".join("%.2f" % x for x in m["layers"]), m["decoder_usable"], m["written->released"], m["attempts"]))

        ttft_table(producer, ptrace, "layers streamed as the producer writes them")
        log("(kvwire: both engines get the prompt at once; the producer prefills it while the consumer allocates and prepares. "
            "daemon marks: ms since decode-host accepted the offer, layer_ready(L) after layer L's checksum passed; a streamed "
            "submit is accepted before the producer's forward, so they include it. source: from produced(3), or from the submit "
            "when the request moves whole after the forward.)")
        producer.stop()
        engines.remove(producer)
        if demo:
            # The same prompts' lengths with the request moved whole, after the producer's forward.
            ptrace_w = os.path.join(work, "producer-whole.trace")
            whole = Engine("producer-whole", "kv_producer", model, daemons.sock_p, "prefill-whole", ptrace_w, work, dict(env, KVWIRE_TEST_STREAM="0"))
            engines.append(whole)
            log("")
            log("engine producer-whole (\"stream\": false, the connector's default on CPU engines) ready in %.1f s" % whole.recv()["startup_s"])
            ttft_table(whole, ptrace_w, "the request moved whole after the producer's forward")
            whole.stop()
            engines.remove(whole)

        # 5. A TP=2 producer into the TP=1 consumer: each producer rank holds one KV head.
        log("")
        ptrace2 = os.path.join(work, "producer-tp2.trace")
        env2 = dict(env, VLLM_CPU_OMP_THREADS_BIND="0|1")  # one core per rank: vLLM's auto binding wants a NUMA node per rank
        producer2 = Engine("producer-tp2", "kv_producer", model, daemons.sock_p, "prefill-tp2", ptrace2, work, env2, tp=2)
        engines.append(producer2)
        log("engine producer-tp2 (tensor_parallel_size=2) ready in %.1f s" % producer2.recv()["startup_s"])
        base_tp2 = [producer2.generate([q], [None], MAX_TOKENS)["outputs"][0] for q in tp_prompts]
        got = []
        for q, L in zip(tp_prompts, tp_lengths):
            ci, _ = pair(consumer, producer2, [q], ["tp-%d" % L])
            got += ci["outputs"]
        ct, pt2 = read_trace(ctrace), read_trace(ptrace2)
        for L in tp_lengths:
            n = "tp-%d" % L
            if not events(ct, "recv_done", request=n):
                fail("request %s was not loaded through kvwire" % n)
            ranks = {e["rank"]: e["heads"] for e in events(pt2, "send_digest", request=n)}
            src = [d for r in sorted(ranks) for d in ranks[r]]
            dst = events(ct, "recv_digest", request=n)[0]["heads"]
            if sorted(ranks) != [0, 1] or src != dst:
                fail("request %s: the producer's heads by rank %s, the consumer's %s" % (n, ranks, dst))

        def maxdiff(a, b):
            return max(abs(float.fromhex(x[1]) - float.fromhex(y[1])) for oa, ob in zip(a, b) for sa, sb in zip(oa["logprobs"], ob["logprobs"]) for x, y in zip(sa, sb))

        for g, b1 in zip(got, base_tp1):
            if g["token_ids"] != b1["token_ids"]:
                fail("TP=2 into TP=1: tokens %s, the TP=1 plain run %s" % (g["token_ids"], b1["token_ids"]))
        d1, d2 = maxdiff(got, base_tp1), maxdiff(base_tp2, base_tp1)
        if d1 > 1e-3:
            fail("TP=2 into TP=1: logprobs differ from the TP=1 plain run by up to %g" % d1)
        log("check 5 passed: a TP=2 producer (one KV head per rank) into the TP=1 consumer, prompts of %s tokens: every head's "
            "bytes arrived as the producer's rank held them (per-head block digests), and the greedy tokens are those of a "
            "TP=1 plain run; logprobs within %.2g of it (the TP=2 plain run itself differs from TP=1 by %.2g: its all-reduce "
            "sums in another order, so its KV is not TP=1's to the last bit)" % (tp_lengths, d1, d2))

        log("")
        log("hooks, in the order vLLM called them for request pd-13 (S: the scheduler-side connector, W: the worker-side one):")
        log("  consumer: " + hook_order(read_trace(ctrace), "pd-13"))
        log("  producer: " + hook_order(read_trace(ptrace), "pd-13"))
        log("")
        log("how the transfers began: " + daemons.starts())
        log("vllm pd: all checks passed in %.0f s" % (time.monotonic() - t_start))
        return 0
    finally:
        for e in engines or []:
            e.stop()
        if daemons:
            daemons.stop()
        if keep:
            log("kept %s" % work)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine_main(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
