"""Embedding gradients summed back to back: time and CPU per op of gloo sparse and omnireduce.

``python -m bench.backtoback --workers 4 --lookups 1664 --width 129`` starts that many
rank processes on loopback. Each rank holds a few sparse COO gradients as
``nn.Embedding(sparse=True)`` makes them (one row per lookup, uncoalesced, ids drawn
from a Zipf law over the table: the shape of ``bench.train``'s lm output table by
default), and sums them over and over with each system in turn: gloo's sparse
``all_reduce`` of the COO tensor, and a co-located omnireduce worker's ``allreduce``.
Nothing else runs between ops (no tensor rebuilt, no barrier), so the figures are
what one op costs when ops follow each other, as a training step's buckets do:
wall time per op (the slowest rank's) and CPU per op of each rank (``time.process_time``:
every thread of the process). The systems alternate in blocks, ``--rounds`` times.

With ``--dense SIZE`` (``1MB``: float32 bytes, or elements) the ranks sum dense float32 tensors of that size instead, a
``--density`` fraction of their 256-element blocks nonzero (each rank its own random
blocks): the fixed cost of a small dense-format op (its mask pass included), against
gloo's dense ``all_reduce`` (system ``gloo``).

It prints one JSON line per block and a table at the end. Timings only: the
results of both systems are compared once, before timing, and a mismatch fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from bench.common import parse_size, run_local_ranks

__all__ = ["main"]

SYSTEMS = ("gloo-sparse", "gloo", "omnireduce-colocated")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.backtoback", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="rank processes (default 4)")
    p.add_argument("--rows", type=int, default=100_000, help="rows of the embedding table (default 100,000)")
    p.add_argument("--width", type=int, default=129, help="floats per row (default 129)")
    p.add_argument("--lookups", type=int, default=1664, help="lookups per rank per op (default 1,664)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the ids (default 1.0)")
    p.add_argument("--ops", type=int, default=300, help="ops per timed block (default 300)")
    p.add_argument("--rounds", type=int, default=2, help="blocks per system, alternating (default 2)")
    p.add_argument("--dense", type=parse_size, default=None, metavar="SIZE",
                   help="sum dense float32 tensors of this size (1MB: float32 bytes; or elements) "
                        "instead of embedding gradients")
    p.add_argument("--density", type=float, default=0.01,
                   help="with --dense: the fraction of 256-element blocks that are nonzero (default 0.01)")
    p.add_argument("--key", action="store_true",
                   help="omnireduce ops pass key= (the tensor's index), so that an op goes to as many shards as "
                        "the last op of its key moved bytes for (as the DDP hook's do), not as its dense size asks")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=None,
                   help="default gloo-sparse and omnireduce-colocated; with --dense, gloo and omnireduce-colocated")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")
    args = p.parse_args(argv)
    for name in ("workers", "rows", "width", "lookups", "ops", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.zipf < 0:
        p.error("--zipf must be non-negative")
    if args.dense is not None and (args.dense < 256 or args.dense % 256):
        p.error("--dense must be a positive multiple of 1 KiB (whole blocks of 256 floats)")
    if not 0 < args.density <= 1:
        p.error("--density must be in (0, 1]")
    if args.systems is None:
        args.systems = ["gloo" if args.dense is not None else "gloo-sparse", "omnireduce-colocated"]
    elif ("gloo-sparse" if args.dense is not None else "gloo") in args.systems:
        p.error("system gloo-sparse sums embedding gradients, gloo the --dense tensors")
    return args


def _gradients(args: argparse.Namespace, rank: int, count: int = 4) -> list[Any]:
    import torch

    rng = np.random.default_rng([7, rank])
    weights = 1.0 / np.arange(1, args.rows + 1, dtype=np.float64) ** args.zipf
    weights /= weights.sum()
    grads = []
    for _ in range(count):
        ids = torch.from_numpy(rng.choice(args.rows, size=args.lookups, p=weights)).view(1, -1)
        values = torch.from_numpy(rng.standard_normal((args.lookups, args.width), dtype=np.float32))
        grads.append(torch.sparse_coo_tensor(ids, values, (args.rows, args.width), check_invariants=False))
    return grads


def _dense(args: argparse.Namespace, rank: int, count: int = 4) -> list[Any]:
    import torch

    rng = np.random.default_rng([11, rank])
    blocks = args.dense // 256
    nonzero = max(1, round(blocks * args.density))
    tensors = []
    for _ in range(count):
        x = np.zeros((blocks, 256), dtype=np.float32)
        x[rng.choice(blocks, size=nonzero, replace=False)] = rng.standard_normal((nonzero, 256), dtype=np.float32)
        tensors.append(torch.from_numpy(x.reshape(-1)))
    return tensors


def _rank(args: argparse.Namespace, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from worker.colocated import ColocatedWorker, torch_exchange

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.workers)
    grads = _gradients(args, rank) if args.dense is None else _dense(args, rank)
    worker = ColocatedWorker(torch_exchange(), rank=rank, world_size=args.workers, listen="tcp://127.0.0.1:0")
    try:
        # gloo's dense all_reduce sums in place: its own copies, so that the other systems'
        # inputs stay as they were (omnireduce returns a new tensor).
        mine = [g.clone() for g in grads]
        run = {
            # gloo's sparse all_reduce replaces its input with the sum: each op sums a fresh
            # copy of the rank's own rows (the copy, timed with it, is about 1% of the op), or
            # every op after the first would sum every rank's rows of the last (both systems'
            # inputs too: they share them).
            "gloo-sparse": lambda i: dist.all_reduce(grads[i].clone()),
            "gloo": lambda i: dist.all_reduce(mine[i]),
            "omnireduce-colocated": lambda i: worker.allreduce(grads[i], key=i if args.key else None),
        }
        expected = grads[0].clone()
        dist.all_reduce(expected)
        got = worker.allreduce(grads[0])
        if args.dense is None:
            got, expected = got.to_dense(), expected.coalesce().to_dense()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        blocks = []
        for _ in range(args.rounds):
            for system in args.systems:
                op = run[system]
                for i in range(10):
                    op(i % len(grads))
                dist.barrier()
                cpu0, t0 = time.process_time(), time.perf_counter()
                for i in range(args.ops):
                    op(i % len(grads))
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                blocks.append((system, wall / args.ops * 1e3, cpu / args.ops * 1e3))
        gathered: list[Any] = [None] * args.workers
        dist.all_gather_object(gathered, blocks)
    finally:
        worker.close()
    if rank == 0:
        for i, (system, _, _) in enumerate(blocks):
            print(json.dumps({
                "system": system, "block": i, "ms_per_op": max(g[i][1] for g in gathered),
                "cpu_ms_per_rank": [round(g[i][2], 3) for g in gathered],
            }), flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("OMNIREDUCE_B2B_RANK") is not None:
        _rank(parse_args(argv), int(os.environ["OMNIREDUCE_B2B_RANK"]))
        return 0
    args = parse_args(argv)
    events = run_local_ranks("bench.backtoback", argv, args.workers, "OMNIREDUCE_B2B_RANK", args.timeout)
    if events is None:
        return 1
    what = (f"{args.lookups} lookups of {args.width} floats from {args.rows:,} rows (Zipf {args.zipf:g})"
            if args.dense is None
            else f"dense float32 tensors of {4 * args.dense:,} bytes, {args.density:g} of blocks nonzero")
    print(f"\n{args.workers} workers, {what}, {args.ops} ops per block; load average {os.getloadavg()[0]:.1f}")
    print("| system | ms per op (blocks) | CPU ms per rank per op (mean of ranks, blocks) |")
    print("|---|---|---|")
    for system in args.systems:
        mine = [e for e in events if e["system"] == system]
        ms = " / ".join(f"{e['ms_per_op']:.2f}" for e in mine)
        cpu = " / ".join(f"{statistics.fmean(e['cpu_ms_per_rank']):.2f}" for e in mine)
        print(f"| {system} | {ms} | {cpu} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
