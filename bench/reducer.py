"""Training steps without DDP: gloo, ``GradientReducer`` and ``GradientReducer(embedding_rows=True)``.

``python -m bench.reducer --workers 2 --rows 102400 --width 256 --lookups 1024`` starts
that many rank processes on loopback. Each holds the same model, a dense
``nn.Embedding(rows, width)`` (``sparse=False``: the gradient Adam and most optimizers
want, zero outside the rows a step looked up) and a small linear head, and runs training
steps on ids drawn from a Zipf law (``--zipf 0``: uniform), each system in turn:

* ``gloo``: every gradient summed by gloo's ``all_reduce`` after ``backward()`` and
  divided by the world size (a plain loop's own reduction);
* ``reducer``: :class:`worker.reducer.GradientReducer` on a co-located worker, the table
  (a bucket of its own) summed in place after its mask pass;
* ``reducer-rows``: the same with ``embedding_rows=True``, the table sent as the rows it
  looked up, in place.

With ``--sparse`` the table is ``nn.Embedding(sparse=True)``: ``gloo`` is then torch's own
sparse allreduce of its COO gradient (an allgather of every rank's rows), and ``reducer``
sends the rows through the aggregator (``reducer-rows`` is refused: there is no dense
table to track).

A step's time is ``backward()`` and the reduction (``synchronize()`` for the reducer),
the slowest rank's, and its CPU (``time.process_time``: every thread of the process).
The systems alternate in blocks, ``--rounds`` times. Timings only: the gradients of
every system are compared with gloo's once, before timing, and a mismatch fails.
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

from bench.common import run_local_ranks

__all__ = ["main"]

SYSTEMS = ("gloo", "reducer", "reducer-rows")
_RANK_ENV = "OMNIREDUCE_REDUCER_BENCH_RANK"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.reducer", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="rank processes (default 2)")
    p.add_argument("--rows", type=int, default=102_400, help="rows of the embedding table (default 102,400)")
    p.add_argument("--width", type=int, default=256, help="floats per row (default 256: a 100 MB table)")
    p.add_argument("--lookups", type=int, default=1024, help="ids looked up per rank per step (default 1,024)")
    p.add_argument("--zipf", type=float, default=0.0, help="Zipf exponent of the ids (default 0: uniform)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per block (default 10)")
    p.add_argument("--rounds", type=int, default=2, help="blocks per system, alternating (default 2)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=None,
                   help="default: all (without reducer-rows with --sparse)")
    p.add_argument("--sparse", action="store_true", help="nn.Embedding(sparse=True): COO gradients")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    args = p.parse_args(argv)
    for name in ("workers", "rows", "width", "lookups", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.zipf < 0:
        p.error("--zipf must be non-negative")
    if args.systems is None:
        args.systems = [s for s in SYSTEMS if not (args.sparse and s == "reducer-rows")]
    if args.sparse and "reducer-rows" in args.systems:
        p.error("--sparse has no dense table for reducer-rows to track")
    return args


def _ids(args: argparse.Namespace, rng: np.random.Generator) -> Any:
    import torch

    if args.zipf == 0:
        return torch.from_numpy(rng.integers(0, args.rows, args.lookups))
    weights = 1.0 / np.arange(1, args.rows + 1, dtype=np.float64) ** args.zipf
    return torch.from_numpy(rng.choice(args.rows, size=args.lookups, p=weights / weights.sum()))


class _Steps:
    """One rank's model, reduced by one system at a time (:meth:`use`)."""

    def __init__(self, args: argparse.Namespace, rank: int, worker: Any) -> None:
        import torch
        from torch import nn

        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Embedding(args.rows, args.width, sparse=args.sparse), nn.Linear(args.width, 1))
        self.worker = worker
        self.world = args.workers
        self.rng = np.random.default_rng([11, rank])
        self.reducer: Any = None

    def use(self, system: str) -> None:
        """Reduces with ``system`` from now on (a reducer's hooks are only there while it is used)."""
        from worker.reducer import GradientReducer

        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        if system != "gloo":
            self.reducer = GradientReducer(self.model, self.worker, embedding_rows=system == "reducer-rows")

    def step(self, ids: Any) -> tuple[float, float]:
        """One step's backward and reduction: (seconds, CPU seconds)."""
        import torch.distributed as dist

        self.model.zero_grad(set_to_none=True)
        loss = self.model(ids).sum()
        t0, c0 = time.perf_counter(), time.process_time()
        loss.backward()
        if self.reducer is not None:
            self.reducer.synchronize()
        else:
            for p in self.model.parameters():
                # A sparse gradient: gloo's sparse allreduce (its sum is coalesced).
                dist.all_reduce(p.grad)
                p.grad.div_(self.world)  # in place, as the reducer divides (no new tensor in the timed step)
        return time.perf_counter() - t0, time.process_time() - c0

    def grads(self, ids: Any) -> list[Any]:
        self.step(ids)
        return [p.grad.detach().to_dense() if p.grad.is_sparse else p.grad.detach().clone()
                for p in self.model.parameters()]


def _rank(args: argparse.Namespace, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from worker.colocated import ColocatedWorker, torch_exchange

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.workers)
    worker = ColocatedWorker(torch_exchange(), rank=rank, world_size=args.workers, listen="tcp://127.0.0.1:0")
    try:
        steps = _Steps(args, rank, worker)
        ids = _ids(args, steps.rng)
        steps.use("gloo")
        expected = steps.grads(ids)
        for system in args.systems:
            steps.use(system)
            torch.testing.assert_close(steps.grads(ids), expected, msg=lambda m, s=system: f"{s}: {m}")
        blocks = []
        for _ in range(args.rounds):
            for system in args.systems:
                steps.use(system)
                for _ in range(2):
                    steps.step(_ids(args, steps.rng))
                dist.barrier()
                times = [steps.step(_ids(args, steps.rng)) for _ in range(args.steps)]
                blocks.append((system, statistics.median(t for t, _ in times) * 1e3,
                               statistics.median(c for _, c in times) * 1e3))
        gathered: list[Any] = [None] * args.workers
        dist.all_gather_object(gathered, blocks)
    finally:
        worker.close()
    if rank == 0:
        for i, (system, _, _) in enumerate(blocks):
            print(json.dumps({
                "system": system, "block": i, "ms_per_step": round(max(g[i][1] for g in gathered), 3),
                "cpu_ms_per_rank": [round(g[i][2], 3) for g in gathered],
            }), flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    if os.environ.get(_RANK_ENV) is not None:
        _rank(parse_args(argv), int(os.environ[_RANK_ENV]))
        return 0
    args = parse_args(argv)
    events = run_local_ranks("bench.reducer", argv, args.workers, _RANK_ENV, args.timeout)
    if events is None:
        return 1
    print(f"\n{args.workers} workers, {args.lookups} lookups (Zipf {args.zipf:g}) in a {args.rows:,} x {args.width} "
          f"float32 table{' (sparse=True)' if args.sparse else ''}, {args.steps} steps per block; load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| system | backward + reduction, ms (median of blocks) | CPU per rank, ms |")
    print("|---|---|---|")
    for system in args.systems:
        mine = [e for e in events if e["system"] == system]
        ms = statistics.median(e["ms_per_step"] for e in mine)
        cpu = statistics.median(statistics.mean(e["cpu_ms_per_rank"]) for e in mine)
        print(f"| {system} | {ms:.1f} | {cpu:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
