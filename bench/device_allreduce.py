"""End-to-end allreduce of device tensors (the GPU check): omnireduce against gloo, from the tensor to its sum.

Every rank holds a torch tensor on ``--device`` (``cuda`` on a GPU machine; ``cpu``
runs the same code anywhere, which is how the tests run it) whose nonzero
256-element blocks are placed at random (:func:`bench.common.make_tensor`: small
integers, so every sum is exact). Each rank times ``worker.allreduce`` of the tensor
(the device path: block mask and compaction on the device, see :mod:`worker.cuda`;
the sum comes back as a tensor on the same device) and gloo's ``all_reduce`` of a
copy, after a barrier, and checks both sums bit for bit against the sum of every
rank's tensor. The aggregator runs in the launching process; the ranks share the
device. Rank 0 prints one JSON line per case and ``--json`` writes them all.

Example::

    python -m bench.device_allreduce --device cuda --sizes 100MB --densities 0.01 0.1 1.0 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from typing import Any

import numpy as np

from bench.common import free_port, make_tensor, parse_size

logger = logging.getLogger(__name__)

__all__ = ["run_rank", "main"]

BLOCK = 256


def _tensors(n: int, density: float, world: int, seed: int) -> list[np.ndarray]:
    """Every rank's tensor (each rank rebuilds all of them to know the exact sum)."""
    return [make_tensor(n, density, BLOCK, np.random.default_rng([seed, r, n, round(density * 1e6)]))
            for r in range(world)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _timed(fn: Any, device: str) -> tuple[float, Any]:
    import torch.distributed as dist

    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def run_rank(rank: int, world: int, cfg: dict[str, Any], results: Any) -> None:
    """One rank: every (size, density) case, omnireduce then gloo, ``cfg["repeats"]`` times each.

    Args:
        rank: this rank.
        world: number of ranks.
        cfg: address (the aggregator), master_port, device, sizes, densities, repeats, warmup, seed.
        results: a queue for rank 0's case results (dicts).
    """
    import torch
    import torch.distributed as dist

    import worker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["master_port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    device = cfg["device"]
    w = worker.connect(cfg["address"], rank=rank, world_size=world, job="device-allreduce", timeout=120.0)
    try:
        for n in cfg["sizes"]:
            for density in cfg["densities"]:
                xs = _tensors(n, density, world, cfg["seed"])
                expected = np.sum(xs, axis=0, dtype=np.float32)
                x = torch.from_numpy(xs[rank]).to(device)
                times: dict[str, list[float]] = {"omnireduce": [], "gloo": []}
                ok = {"omnireduce": True, "gloo": True}
                for i in range(cfg["warmup"] + cfg["repeats"]):
                    dt, out = _timed(lambda t=x: w.allreduce(t), device)
                    if i >= cfg["warmup"]:
                        times["omnireduce"].append(dt)
                    ok["omnireduce"] &= out.device == x.device and np.array_equal(out.cpu().numpy(), expected)
                    buf = x.clone()
                    dt, _ = _timed(lambda b=buf: dist.all_reduce(b), device)
                    if i >= cfg["warmup"]:
                        times["gloo"].append(dt)
                    ok["gloo"] &= np.array_equal(buf.cpu().numpy(), expected)
                # The slowest rank's time of each repetition: the op's real time.
                t = torch.tensor([times["omnireduce"], times["gloo"]], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                flags = torch.tensor([int(ok["omnireduce"]), int(ok["gloo"])], dtype=torch.int32)
                dist.all_reduce(flags, op=dist.ReduceOp.MIN)
                if rank == 0:
                    row = {"device": device, "workers": world, "elements": n, "mb": n * 4 / 1e6, "density": density,
                           "omnireduce_ms": 1e3 * statistics.median(t[0].tolist()),
                           "gloo_ms": 1e3 * statistics.median(t[1].tolist()),
                           "omnireduce_ok": bool(flags[0]), "gloo_ok": bool(flags[1])}
                    row["x_gloo"] = row["gloo_ms"] / row["omnireduce_ms"]
                    results.put(row)
    finally:
        w.close()
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.device_allreduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="torch device of the tensors: cuda, cuda:1, cpu")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[parse_size("100MB")],
                   help="elements, or bytes of float32 with KB/MB/GB")
    p.add_argument("--densities", nargs="+", type=float, default=[0.01, 0.1, 1.0])
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.workers < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--workers and --repeats must be >= 1 and --warmup >= 0")
    if any(not 0.0 <= d <= 1.0 for d in args.densities):
        p.error("densities lie in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns 0 when every sum was exact, 1 otherwise."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from aggregator.server import Aggregator

    agg = Aggregator(listen="tcp://127.0.0.1:0")
    agg.start()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    cfg = {"address": agg.address, "master_port": free_port(), "device": args.device, "sizes": args.sizes,
           "densities": args.densities, "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed}
    procs = [ctx.Process(target=run_rank, args=(r, args.workers, cfg, results)) for r in range(args.workers)]
    rows: list[dict[str, Any]] = []
    try:
        for p in procs:
            p.start()
        while len(rows) < len(args.sizes) * len(args.densities):
            try:
                row = results.get(timeout=1.0)
            except queue.Empty:
                # A rank that died leaves the others waiting in a collective: stop at once.
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            rows.append(row)
            print(json.dumps(row), flush=True)
        for p in procs:
            p.join(timeout=120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        agg.close()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    missing = len(args.sizes) * len(args.densities) - len(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "rank_exit_codes": [p.exitcode for p in procs]}, f, indent=1)
    if failed or missing:
        print(f"rank processes failed (exit codes {failed}); {missing} cases without a result", file=sys.stderr)
        return 1
    return 0 if all(r["omnireduce_ok"] and r["gloo_ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
