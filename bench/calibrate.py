"""``omnireduce-calibrate``: measures the cost model's parameters on this machine.

What it times, each on the real code path:

- alpha and beta: ZeroMQ round trips (DEALER to a ROUTER echo in a child process, TCP
  loopback) over message sizes from 1 KiB to a few MiB; a line fitted to one-way time
  against size gives alpha (intercept) and beta (slope);
- the block mask (``omnireduce.blocks.block_mask``) on zero and on nonzero data, the
  gather/scatter of random blocks, first touch of fresh memory and a NumPy sum, per byte;
- the protocol's cost per message: an in-process ``aggregator.Aggregator`` and worker
  processes running ops whose every round carries one tiny block per stream, so that
  the time per round is all message handling.

The parameters go to a JSON file (``~/.cache/omnireduce/costs.json`` by default) that
:meth:`omnireduce.model.CostParams.load` reads.
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from omnireduce import config
from omnireduce.model import DEFAULT_COSTS_PATH, CostParams

logger = logging.getLogger(__name__)

__all__ = ["main", "fit_alpha_beta", "calibrate"]

_PAGE = 4096
_ECHO = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    f = s.recv_multipart(copy=False)
    if len(f) == 2 and f[1].bytes == b"quit":
        break
    s.send_multipart(f, copy=False)
"""


def fit_alpha_beta(sizes: Sequence[float], one_way_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares line ``t = alpha + size * beta`` through one-way message times.

    Args:
        sizes: message sizes in bytes.
        one_way_s: the matching one-way times (half a round trip).

    Returns:
        ``(alpha, beta)``, each clipped to a tiny positive value: a negative intercept is
        noise, not a faster-than-free message.

    Residuals are weighted by ``1 / t`` (relative error), so the small messages that set
    alpha count as much as the large ones that set beta.
    """
    t = np.asarray(one_way_s, dtype=float)
    beta, alpha = np.polyfit(np.asarray(sizes, dtype=float), t, 1, w=1.0 / t)
    return max(float(alpha), 1e-7), max(float(beta), 1e-13)


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up (median: robust to a busy neighbour)."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _kernels(nbytes: int, repeats: int) -> dict[str, float]:
    """Per-byte costs of the mask, block copies, fresh pages and sums on ``nbytes`` of float32."""
    from omnireduce import blocks
    from omnireduce.layout import Layout

    n = nbytes // 4
    b = 256
    zeros = np.empty(n, dtype=np.float32)
    zeros.fill(0.0)  # written, so the pages are real (not the shared zero page)
    ones = np.ones(n, dtype=np.float32)
    mask_zero = _median_seconds(lambda: blocks.block_mask(zeros, b), repeats) / nbytes
    mask_dense = _median_seconds(lambda: blocks.block_mask(ones, b), repeats) / nbytes
    layout = Layout(n, b, 256, 4)
    rng = np.random.default_rng(0)
    # A quarter of the blocks, at random: fancy-indexed copies as in a sparse round.
    ids = np.sort(rng.choice(layout.num_blocks, size=layout.num_blocks // 4, replace=False)).astype(np.int64)
    moved = len(ids) * b * 4
    gather = _median_seconds(lambda: blocks.gather(ones, ids, layout), repeats) / moved
    payload = blocks.gather(ones, ids, layout)
    out = np.zeros(n, dtype=np.float32)
    scatter = _median_seconds(lambda: blocks.scatter(out, ids, payload, layout), repeats) / moved

    def fresh() -> None:
        # A result as the worker makes it: fresh zeroed memory whose pages fault in when written.
        a = np.zeros(n, dtype=np.float32)
        a[:] = ones

    def warm() -> None:
        out[:] = ones

    # First touch alone: writing into fresh memory minus writing into memory already mapped,
    # measured in pairs so that a busy neighbour slows both sides of a difference alike; a cost
    # is never below the floor the fitted ones get (a busy machine can make the difference vanish).
    fresh()
    diffs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fresh()
        t1 = time.perf_counter()
        warm()
        diffs.append((t1 - t0) - (time.perf_counter() - t1))
    zero = max(statistics.median(diffs) / nbytes, 1e-13)

    def faults() -> None:
        # A sparse result: an anonymous mapping of 4 KiB pages, one write per page.
        a = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.float32)
        a[:: _PAGE // 4] = 1.0

    fault = _median_seconds(faults, repeats) / (nbytes // _PAGE)
    add = _median_seconds(lambda: np.add(ones, zeros, out=out), repeats) / nbytes
    return {
        "mask_s_per_byte": mask_zero, "mask_dense_s_per_byte": mask_dense,
        "copy_s_per_byte": (gather + scatter) / 2, "zero_s_per_byte": zero, "add_s_per_byte": add,
        "page_fault_s": fault,
    }


def _ping_pong(sizes: Sequence[int], repeats: int, timeout: float) -> list[float]:
    """Median one-way seconds of a ZeroMQ message of each size (half of a DEALER/ROUTER round trip)."""
    import zmq

    proc = subprocess.Popen([sys.executable, "-c", _ECHO], stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        sock.connect(f"tcp://127.0.0.1:{port}")
        out = []
        for size in sizes:
            buf = np.ones(size, dtype=np.uint8)
            ts = []
            for i in range(repeats + 2):
                t0 = time.perf_counter()
                sock.send(buf, copy=size < zmq.COPY_THRESHOLD)
                sock.recv(copy=False)
                if i >= 2:  # the first two set up the connection and the buffers
                    ts.append(time.perf_counter() - t0)
            out.append(statistics.median(ts) / 2)
        sock.send(b"quit")
        return out
    finally:
        sock.close()
        ctx.term()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _worker_main() -> None:
    """Child process: runs the protocol cases given as JSON on argv and prints rank 0's times."""
    from worker import Worker

    address, rank, world, cases_json = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    results = []
    for case in json.loads(cases_json):
        x = np.ones(case["length"], dtype=np.float32)
        if "density" in case:
            # Random blocks per rank, as in the benchmarks: the protocol's scattered paths.
            b = case["block_size"]
            nb = -(-case["length"] // b)
            rng = np.random.default_rng([rank, nb])
            keep = np.repeat(rng.random(nb) < case["density"], b)[: case["length"]]
            x = np.where(keep, x, np.float32(0))
        # The sparse path always (the variable OMNIREDUCE_MODE must not make it time another).
        with Worker(address, rank=rank, world_size=world, job=case["job"], block_size=case["block_size"],
                    message_blocks=case["message_blocks"], streams=case["streams"], timeout=30.0,
                    mode="sparse") as w:
            ts = []
            for i in range(case["repeats"] + 1):
                t0 = time.perf_counter()
                w.allreduce(x)
                if i:
                    ts.append(time.perf_counter() - t0)
            results.append({"rounds": w.stats.last.rounds if w.stats.last else 0, "s": statistics.median(ts)})
    if rank == 0:
        print(json.dumps(results), flush=True)


def _run_cases(world: int, cases: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """Runs protocol cases in ``world`` worker processes through an in-process aggregator; rank 0's results."""
    from aggregator import Aggregator

    agg = Aggregator(listen="tcp://127.0.0.1:0", timeout=timeout).start()
    procs: list[subprocess.Popen] = []
    try:
        code = "from bench.calibrate import _worker_main; _worker_main()"
        for rank in range(world):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", code, agg.address, str(rank), str(world), json.dumps(cases)],
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, text=True,
            ))
        out, _ = procs[0].communicate(timeout=timeout)
        for p in procs[1:]:
            p.wait(timeout=timeout)
        if procs[0].returncode != 0:
            raise RuntimeError(f"calibration worker exited with {procs[0].returncode}")
        return json.loads(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        agg.close()


def _scattered(params: CostParams, world: int, length: int, density: float, repeats: int, timeout: float) -> float:
    """Seconds per union byte that real ops of random blocks take beyond the rest of the model."""
    from omnireduce import config
    from omnireduce.model import sparse_estimate

    case = {"job": "calibrate-scattered", "length": length, "block_size": config.DEFAULT_BLOCK_SIZE,
            "message_blocks": config.DEFAULT_MESSAGE_BLOCKS, "streams": config.DEFAULT_STREAMS,
            "repeats": repeats, "density": density}
    measured = float(_run_cases(world, [case], timeout)[0]["s"])
    est = sparse_estimate(length, world, params, density, block_size=config.DEFAULT_BLOCK_SIZE,
                          message_blocks=config.DEFAULT_MESSAGE_BLOCKS, streams=config.DEFAULT_STREAMS)
    return max(measured - est.total, 0.0) / max(est.union * length * 4, 1.0)


def _protocol(
    world: int, rows: Sequence[int], streams: int, columns: int, repeats: int, timeout: float
) -> list[tuple[float, float]]:
    """``(stream-rounds, seconds)`` of ops of ``streams`` streams of ``columns`` columns, ``rows`` dense rows.

    Blocks of one element: every round of every stream is a message in and out per worker
    whose payload is negligible, but whose per-column arrays (instructions, pointers,
    match tables) are as long as a real op's, so the time is the protocol's per-message handling.
    """
    cases = [{"job": f"calibrate-{r}", "length": r * streams * columns, "block_size": 1,
              "message_blocks": columns, "streams": streams, "repeats": repeats} for r in rows]
    res = _run_cases(world, cases, timeout)
    return [(float(streams * c["rounds"]), float(c["s"])) for c in res]


def calibrate(quick: bool = False, world: int = 2, timeout: float = 50.0) -> CostParams:
    """Measures every parameter of :class:`~omnireduce.model.CostParams` on this machine.

    Args:
        quick: smaller sizes and fewer repeats (a few seconds; for tests).
        world: worker processes of the protocol measurement.
        timeout: seconds any one measurement may take.
    """
    t_start = time.monotonic()
    load = os.getloadavg()
    # Large enough to be memory-bound, as the large tensors whose choice matters are.
    kern = _kernels((4 << 20) if quick else (64 << 20), 3 if quick else 5)
    sizes = [1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20] + ([] if quick else [2 << 20, 4 << 20])
    one_way = _ping_pong(sizes, 5 if quick else 15, timeout)
    alpha, beta = fit_alpha_beta(sizes, one_way)
    from omnireduce import config

    streams, columns = config.DEFAULT_STREAMS, config.DEFAULT_MESSAGE_BLOCKS
    pts = _protocol(world, [4, 16] if quick else [8, 24, 48, 96], streams, columns, 2 if quick else 5, timeout)
    # Each stream-round is `world` messages in and `world` out at the aggregator, one of each at a worker.
    slope = float(np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)[0]) if len(pts) > 1 else pts[0][1] / pts[0][0]
    per_message = max(slope / (2 * world), 1e-7)
    params = CostParams(
        alpha=alpha, beta=beta, per_message_s=per_message, cores=config.usable_cores(), full_duplex=False,
        meta={"host": os.uname().nodename, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_before": load,
              "load_after": os.getloadavg(), "seconds": round(time.monotonic() - t_start, 2), "quick": quick,
              "ping_pong": {"sizes": sizes, "one_way_s": one_way}, "protocol_points": pts},
        **kern,
    )
    # Last: the residual of real scattered ops under every other parameter.
    params.scattered_s_per_byte = _scattered(params, world, (1 << 20) if quick else (4 << 20), 0.2,
                                             2 if quick else 5, timeout)
    return params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnireduce-calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help=f"JSON file to write (default $OMNIREDUCE_COSTS, where auto mode "
                    f"reads it first, else {DEFAULT_COSTS_PATH})")
    ap.add_argument("--quick", action="store_true", help="a few seconds: smaller sizes, fewer repeats")
    ap.add_argument("--workers", type=int, default=2, help="worker processes of the protocol measurement")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error("--workers must be at least 1")
    out = args.out or os.environ.get(config.OMNIREDUCE_COSTS) or DEFAULT_COSTS_PATH
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    params = calibrate(quick=args.quick, world=args.workers)
    # Shown before the file is written: a file that cannot be written loses no measurement.
    show = {k: v for k, v in json.loads(params.to_json()).items() if k != "meta"}
    for k, v in show.items():
        print(f"{k:>22} = {v:.4g}" if isinstance(v, float) else f"{k:>22} = {v}")
    print(f"load average {params.meta['load_before']} -> {params.meta['load_after']}, {params.meta['seconds']} s")
    try:
        path = params.save(out)
    except OSError as e:
        print(f"cannot write {out}: {e}; the parameters are above (--out names another file)", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
