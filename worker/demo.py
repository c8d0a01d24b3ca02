"""``omnireduce-demo``: an aggregator daemon and a few worker processes reduce a sparse tensor.

Each worker makes its own sparse input from its rank, so every worker can also
build all inputs and check the result against a dense NumPy sum.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import re
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

BLOCK = 256


def sparse_input(rank: int, elements: int, density: float, block_size: int = BLOCK) -> np.ndarray:
    """A float32 tensor whose nonzero blocks (a ``density`` fraction) are chosen at random per rank."""
    rng = np.random.default_rng(1000 + rank)
    nb = -(-elements // block_size)
    x = np.zeros(nb * block_size, dtype=np.float32)
    chosen = rng.choice(nb, size=max(1, round(density * nb)), replace=False)
    x.reshape(nb, block_size)[chosen] = rng.integers(-8, 9, size=(len(chosen), block_size)).astype(np.float32)
    return x[:elements]


def _worker(address: str, rank: int, world: int, elements: int, density: float, ops: int, out: Any) -> None:
    from worker import Worker

    x = sparse_input(rank, elements, density)
    expected = sum(sparse_input(r, elements, density) for r in range(world))
    with Worker(address, rank=rank, world_size=world, job="demo", timeout=60) as w:
        times = []
        ok = True
        for _ in range(ops):
            t = time.perf_counter()
            y = w.allreduce(x)
            times.append(time.perf_counter() - t)
            ok &= bool(np.array_equal(y, expected))
        out.put((rank, ok, float(np.median(times)), w.stats.last.as_dict()))


def _collect(results: Any, procs: list[Any], timeout: float = 300.0) -> list[Any]:
    """Every worker's row, sorted by rank; raises as soon as a worker died without one."""
    rows = []
    deadline = time.monotonic() + timeout
    while len(rows) < len(procs):
        try:
            rows.append(results.get(timeout=0.5))
            continue
        except queue.Empty:
            pass
        # A worker that raised has printed its traceback and exited: say so now, not at the deadline.
        dead = [r for r, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
        if dead:
            raise SystemExit(f"FAILED: worker(s) {dead} exited with an error (see above)")
        if time.monotonic() > deadline:
            raise SystemExit(f"FAILED: no result from {len(procs) - len(rows)} worker(s) within {timeout:g} s")
    return sorted(rows)


def _forward(stream: Any) -> None:
    for line in stream:
        sys.stderr.write(line)


def start_daemon(timeout: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Starts ``python -m aggregator`` on a free loopback port; returns it and its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "aggregator", "--listen", "tcp://127.0.0.1:0", "--timeout", str(timeout)],
        stderr=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        m = re.search(r"listening on (tcp://\S+)", line)
        if m:
            # Keep draining the daemon's log so a full pipe never blocks it.
            threading.Thread(target=_forward, args=(proc.stderr,), daemon=True).start()
            return proc, m.group(1)
    raise RuntimeError(f"aggregator exited with {proc.wait()} before listening")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="omnireduce-demo", description=__doc__)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--elements", type=int, default=4_000_000)
    p.add_argument("--density", type=float, default=0.01, help="fraction of nonzero 256-element blocks per worker")
    p.add_argument("--ops", type=int, default=3)
    args = p.parse_args(argv)
    if args.workers < 1 or args.elements < 1 or args.ops < 1 or not 0.0 < args.density <= 1.0:
        p.error("--workers, --elements and --ops must be at least 1, and --density in (0, 1]")
    daemon, address = start_daemon()
    print(f"aggregator daemon pid {daemon.pid} at {address}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(address, r, args.workers, args.elements, args.density, args.ops, results))
        for r in range(args.workers)
    ]
    try:
        for pr in procs:
            pr.start()
        rows = _collect(results, procs)
        for pr in procs:
            pr.join()
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.kill()
        daemon.terminate()
        daemon.wait()
    dense = args.elements * 4
    print(f"{args.workers} workers, {args.elements:,} float32 ({dense / 1e6:.1f} MB), "
          f"{args.density:.1%} nonzero blocks per worker, {args.ops} ops")
    all_ok = True
    for rank, ok, seconds, st in rows:
        all_ok &= ok
        print(f"  rank {rank}: result {'matches' if ok else 'DIFFERS FROM'} the dense sum; "
              f"sent {st['bytes_sent'] / 1e3:.1f} kB = {st['bytes_sent'] / dense:.2%} of dense "
              f"({st['blocks_sent']} blocks, {st['messages_sent']} messages, {st['rounds']} rounds); "
              f"median op {seconds * 1e3:.1f} ms")
    print("OK: every worker got the exact sum" if all_ok else "FAILED: a worker's result differs")
    return 0 if all_ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
