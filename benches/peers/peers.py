#!/usr/bin/env python3
"""Other transfer engines, timed the way `kvwire bench peers` times kvwire.

Runs one engine's one-sided writes between two processes on this host and
prints one JSON line per size: latency percentiles of a synchronous write
(post until the initiator sees it complete) and whether the target's bytes
matched. Used by `kvwire bench peers`; usable alone:

    peers.py --engine mooncake|nixl --sizes 65536,1048576 --reps 50

The target process holds a registered buffer and answers `check SIZE SEED`
on stdin with `ok` or `bad`, so every size's bytes are verified where they
landed. Nothing here is kvwire's: it only drives the engines' own Python APIs.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def pattern(size, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=size, dtype=np.uint8)


def percentiles(samples):
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(round(q * (len(s) - 1))))]
    return {"p50_us": pick(0.50) * 1e6, "p99_us": pick(0.99) * 1e6, "min_us": s[0] * 1e6}


# ------------------------------------------------------------------ mooncake

def mooncake_engine():
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"mooncake initialize returned {rc}")
    return e


def mooncake_target(max_size):
    e = mooncake_engine()
    buf = np.zeros(max_size, dtype=np.uint8)
    if e.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise RuntimeError("mooncake register_memory failed")
    hello = {"session": f"127.0.0.1:{e.get_rpc_port()}", "ptr": buf.ctypes.data}
    print(json.dumps(hello), flush=True)
    serve_checks(buf)


def mooncake_initiator(target, hello, sizes, reps):
    e = mooncake_engine()
    src = np.zeros(max(sizes), dtype=np.uint8)
    if e.register_memory(src.ctypes.data, src.nbytes) != 0:
        raise RuntimeError("mooncake register_memory failed")
    for size in sizes:
        src[:size] = pattern(size, size)

        def write():
            rc = e.transfer_sync_write(hello["session"], src.ctypes.data, hello["ptr"], size)
            if rc != 0:
                raise RuntimeError(f"transfer_sync_write returned {rc}")

        yield size, timed(write, reps), check(target, size)


# ---------------------------------------------------------------------- nixl

def nixl_agent(name, progress_thread):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))


def nixl_target(max_size):
    # The passive side needs a progress thread to answer UCX's wire-up.
    agent = nixl_agent("target", True)
    buf = np.zeros(max_size, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    hello = {"meta": agent.get_agent_metadata().hex(), "ptr": buf.ctypes.data}
    print(json.dumps(hello), flush=True)
    serve_checks(buf)


def nixl_initiator(target, hello, sizes, reps):
    # No progress thread here: on 2 cores it makes the initiator erratic;
    # the initiator polls its transfer instead.
    agent = nixl_agent("initiator", False)
    src = np.zeros(max(sizes), dtype=np.uint8)
    agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(bytes.fromhex(hello["meta"]))
    for size in sizes:
        src[:size] = pattern(size, size)
        local = agent.get_xfer_descs([(src.ctypes.data, size, 0)], "DRAM")
        remote = agent.get_xfer_descs([(hello["ptr"], size, 0)], "DRAM")
        handle = agent.initialize_xfer("WRITE", local, remote, peer)

        def write():
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"nixl transfer ended {state}")

        yield size, timed(write, reps), check(target, size)
        agent.release_xfer_handle(handle)


# -------------------------------------------------------------------- common

def timed(write, reps):
    for _ in range(min(3, reps)):
        write()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        write()
        samples.append(time.perf_counter() - t)
    return samples


def serve_checks(buf):
    for line in sys.stdin:
        parts = line.split()
        if parts[:1] == ["check"]:
            size, seed = int(parts[1]), int(parts[2])
            ok = np.array_equal(buf[:size], pattern(size, seed))
            print("ok" if ok else "bad", flush=True)
        elif parts[:1] == ["quit"]:
            return


def reply(target, want):
    """The target's next line that `want` accepts (engines log to stdout too)."""
    for line in target.stdout:
        line = line.strip()
        if want(line):
            return line
    raise RuntimeError("the target process ended without answering")


def check(target, size):
    target.stdin.write(f"check {size} {size}\n")
    target.stdin.flush()
    return reply(target, lambda l: l in ("ok", "bad")) == "ok"


ENGINES = {
    "mooncake": (mooncake_target, mooncake_initiator),
    "nixl": (nixl_target, nixl_initiator),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=sorted(ENGINES), required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--src-cpus", help="CPU list the initiating process runs on")
    ap.add_argument("--dst-cpus", help="CPU list the target process runs on")
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    target_fn, initiator_fn = ENGINES[a.engine]
    # Before the engine starts its threads: they inherit it.
    cpus = a.dst_cpus if a.target else a.src_cpus
    if cpus:
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
    if a.target:
        target_fn(max(sizes))
        return
    pin = ["--dst-cpus", a.dst_cpus] if a.dst_cpus else []
    target = subprocess.Popen(
        [sys.executable, __file__, "--engine", a.engine, "--sizes", a.sizes, "--target"] + pin,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        hello = json.loads(reply(target, lambda l: l.startswith("{")))
        for size, samples, verified in initiator_fn(target, hello, sizes, a.reps):
            p = percentiles(samples)
            p.update({"engine": a.engine, "size": size, "reps": len(samples), "verified": verified,
                      "gbps_p50": size / (p["p50_us"] * 1e-6) / 1e9})
            print(json.dumps(p), flush=True)
    finally:
        try:
            target.stdin.write("quit\n")
            target.stdin.flush()
        except OSError:
            pass
        try:
            target.wait(timeout=10)
        except subprocess.TimeoutExpired:
            target.kill()


if __name__ == "__main__":
    main()
