"""The benchmark's processes: ``python -m bench.procs rank RANK SPEC`` and ``... aggregator LISTEN``.

A rank process times gloo dense, gloo sparse COO and omnireduce (sparse, dense, auto;
and rows: the same COO tensor as gloo sparse) on the same tensors, and rank 0 prints
one JSON line per case on stdout. The
aggregator process prints its bound address as a JSON line and serves until its
stdin is closed. The driver (:mod:`bench.driver`) starts them, on loopback or inside
network namespaces.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

from bench.common import RankSpec, is_colocated, is_known, is_rows, make_tensor, worker_mode

logger = logging.getLogger(__name__)

__all__ = ["main", "run_rank", "serve_aggregator"]

_CLOSE_TIMEOUT_S = 15.0


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Case:
    """One tensor of one rank and the systems that sum it."""

    def __init__(self, spec: RankSpec, rank: int, n: int, density: float) -> None:
        import torch

        self.torch = torch
        b = spec.pattern_block
        rng = np.random.default_rng([spec.seed, rank, n, round(density * 1e6)])
        self.x = make_tensor(n, density, b, rng, skew=spec.skew, order_seed=spec.seed)
        self.n = n
        self.density = density
        # make_tensor's base array is padded to whole blocks: gloo's sparse path uses it as
        # rows of one block each, the layout an embedding gradient has.
        self.rows = torch.from_numpy(self.x.base).view(-1, b)
        self.xt = torch.from_numpy(self.x)
        self.buf = torch.empty_like(self.xt)
        self.sparse_io = spec.sparse_io
        self.new_output = spec.new_output
        self.sparse: Any = None
        self.rows_in: Any = None
        # The knownrows systems' in-place buffer (whole rows) and the rows its caller knows
        # (as an embedding knows the ids it looked up): found once, untimed.
        self.known_buf = torch.empty_like(self.rows)
        self.known = self.rows.ne(0).any(1).nonzero().squeeze(1)

    def reset_dense(self) -> None:
        self.buf.copy_(self.xt)

    def gloo(self) -> Any:
        self.torch.distributed.all_reduce(self.buf)
        return self.buf

    def to_sparse(self) -> Any:
        """The tensor as a coalesced COO tensor with one row per nonzero block."""
        torch = self.torch
        nz = self.rows.ne(0).any(1).nonzero().squeeze(1)
        return torch.sparse_coo_tensor(
            nz.unsqueeze(0), self.rows.index_select(0, nz), self.rows.shape, is_coalesced=True
        )

    def reset_sparse(self) -> None:
        # gloo sums into its input (it replaces the tensor's indices and values), so
        # every repetition starts from a fresh one.
        self.sparse = None if self.sparse_io else self.to_sparse()

    def gloo_sparse(self) -> Any:
        s = self.to_sparse() if self.sparse_io else self.sparse
        self.torch.distributed.all_reduce(s)
        if not self.sparse_io:
            return s
        # The dense sum as omnireduce's dense=True makes it: the summed rows written into
        # lazily zeroed memory (calloc'd pages, zeroed when first touched), not to_dense()'s
        # new tensor filled in full while the timer runs.
        s = s.coalesce()
        out = self.torch.from_numpy(np.zeros(self.rows.shape, np.float32))
        out.index_copy_(0, s.indices()[0], s.values())
        return out.view(-1)[: self.n]

    def reset_rows(self) -> None:
        # The input gloo-sparse gets, built the same way and as fresh (omnireduce leaves
        # its input alone, but a reused tensor would be warmer in the caches than gloo's).
        self.rows_in = None if self.sparse_io else self.to_sparse()

    def omnireduce_rows(self, worker: Any) -> Any:
        """``worker.allreduce`` of gloo-sparse's COO tensor: a coalesced sparse tensor of the union's rows."""
        if self.sparse_io:
            # From the dense tensor to the dense sum: the sum comes dense (no sparse result first).
            return worker.allreduce(self.to_sparse(), dense=True).view(-1)[: self.n]
        return worker.allreduce(self.rows_in)

    def reset_known(self) -> None:
        self.known_buf.copy_(self.rows)

    def omnireduce_known(self, worker: Any) -> Any:
        """``worker.allreduce`` of the dense rows in place, given their nonzero rows: no mask pass."""
        return worker.allreduce(self.known_buf, rows=self.known, inplace=True)

    def result_of(self, system: str, result: Any) -> np.ndarray:
        """A system's result as a flat NumPy array (untimed)."""
        if is_known(system):
            result = result.reshape(-1)[: self.n]
        if (system == "gloo-sparse" or is_rows(system)) and not self.sparse_io:
            result = result.to_dense().view(-1)[: self.n]
        return result.numpy() if isinstance(result, self.torch.Tensor) else result

    def sparse_out(self, system: str, result: Any) -> bool:
        """Whether a rows system's result is what gloo's sparse all_reduce returns: a coalesced
        sparse tensor of the input's shape (always true of the other systems)."""
        if not is_rows(system) or self.sparse_io:
            return True
        return bool(result.is_sparse and result.is_coalesced() and tuple(result.shape) == tuple(self.rows.shape))

    def omnireduce(self, worker: Any) -> Any:
        # A tensor's density is stable from step to step: auto mode keys its history by case.
        if self.new_output:
            return worker.allreduce(self.x, key=(self.n, self.density))
        # As gloo: the sum replaces the buffer's contents (reset_dense refills it, untimed).
        return worker.allreduce(self.buf, key=(self.n, self.density), inplace=True)


def run_rank(spec: RankSpec, rank: int, emit: Callable[[dict[str, Any]], None] = _emit) -> None:
    """Runs every case of ``spec`` as ``rank``; rank 0 emits one result event per case.

    Args:
        spec: the run.
        rank: this process's rank.
        emit: where rank 0's events go (stdout JSON lines by default).
    """
    import torch
    import torch.distributed as dist

    from worker import connect
    from worker.colocated import ColocatedWorker, torch_exchange

    torch.set_num_threads(spec.torch_threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{spec.store}", rank=rank, world_size=spec.world_size,
        timeout=timedelta(seconds=spec.op_timeout),
    )
    # One worker per omnireduce system: "omnireduce" (sparse), "omnireduce-dense",
    # "omnireduce-auto" and "omnireduce-rows" on the dedicated aggregators;
    # "omnireduce-colocated" and "omnireduce-rows-colocated" (sparse) on a shard served
    # by every rank's own process (one shard per such system and rank).
    workers: dict[str, Any] = {}
    colocated = 0
    for system in spec.systems:
        if system.startswith("omnireduce"):
            variant = system.partition("-")[2] or "sparse"
            options: dict[str, Any] = dict(
                rank=rank, world_size=spec.world_size, job=f"bench-{os.path.basename(spec.store)}-{variant}",
                block_size=spec.block_size, message_blocks=spec.message_blocks, streams=spec.streams,
                timeout=spec.op_timeout, mode=worker_mode(system),
            )
            if is_colocated(system):
                listen = spec.colocated_listen[rank]
                # A second shard in this process: an IPC endpoint is a path, so it needs its own.
                if colocated and listen.startswith("ipc://"):
                    listen += f"-{colocated}"
                colocated += 1
                workers[system] = ColocatedWorker(
                    torch_exchange(), listen=listen, aggregator_options={"timeout": spec.op_timeout}, **options,
                )
            else:
                workers[system] = connect(spec.address, **options)
    try:
        for n in spec.sizes:
            for density in spec.densities:
                case = _Case(spec, rank, n, density)
                ref = None
                if spec.check:
                    case.reset_dense()
                    ref = case.gloo().numpy().copy()
                _time_cases(spec, rank, case, ref, emit, workers)
                del case
    finally:
        # Every result is out by now: a close that hangs must not hold up the run.
        closer = threading.Thread(target=_close, args=(list(workers.values()), dist), daemon=True)
        closer.start()
        closer.join(_CLOSE_TIMEOUT_S)
        if closer.is_alive():
            logger.error("rank %d: closing the worker or the process group hung for %g s", rank, _CLOSE_TIMEOUT_S)


def _close(workers: list[Any], dist: Any) -> None:
    # Each one closed whatever the others do: one failed close must not leave the rest open.
    for w in workers:
        try:
            w.close()
        except Exception:
            logger.exception("closing worker %r failed", w)
    try:
        dist.destroy_process_group()
    except Exception:
        logger.exception("destroying the process group failed")


def _runner(case: _Case, system: str, worker: Any) -> tuple[Callable[[], Any], Callable[[], None] | None]:
    """The timed call of a system and what resets its input before each call."""
    if worker is not None and is_known(system):  # gloo's dense input, its rows given
        return (lambda: case.omnireduce_known(worker)), case.reset_known
    if worker is not None and is_rows(system):  # gloo-sparse's input, through omnireduce
        return (lambda: case.omnireduce_rows(worker)), case.reset_rows
    if worker is not None:  # one of the other omnireduce systems
        return (lambda: case.omnireduce(worker)), (None if case.new_output else case.reset_dense)
    return {"gloo": (case.gloo, case.reset_dense), "gloo-sparse": (case.gloo_sparse, case.reset_sparse)}[system]


def _timed(fn: Callable[[], Any], reset: Callable[[], None] | None) -> tuple[float, Any]:
    """One call, started together on every rank."""
    import torch.distributed as dist

    if reset is not None:
        reset()
    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def _time_cases(
    spec: RankSpec,
    rank: int,
    case: _Case,
    ref: np.ndarray | None,
    emit: Callable[[dict[str, Any]], None],
    workers: dict[str, Any],
) -> None:
    """Times every system on one case: one after the other, or round-robin per repetition
    (``spec.interleave``), so that a slow spell of a shared machine hits every system alike."""
    runners = {system: _runner(case, system, workers.get(system)) for system in spec.systems}
    reps = spec.warmup + spec.repeats
    if spec.interleave:
        schedule = [system for _ in range(reps) for system in spec.systems]
    else:
        schedule = [system for system in spec.systems for _ in range(reps)]
    times: dict[str, list[float]] = {system: [] for system in spec.systems}
    for system in schedule:
        dt, result = _timed(*runners[system])
        times[system].append(dt)
        if len(times[system]) == reps:
            # Checked at once: gloo's result lives in a buffer its next call would overwrite.
            _report(spec, rank, case, system, times[system][spec.warmup:], result, ref, emit, workers.get(system))


def _report(
    spec: RankSpec,
    rank: int,
    case: _Case,
    system: str,
    times: list[float],
    result: Any,
    ref: np.ndarray | None,
    emit: Callable[[dict[str, Any]], None],
    worker: Any = None,
) -> None:
    import torch
    import torch.distributed as dist

    ok = True
    if ref is not None:
        ok = case.sparse_out(system, result) and bool(np.array_equal(case.result_of(system, result), ref))
    # A case takes as long as its slowest rank.
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank == 0:
        event: dict[str, Any] = {
            "type": "result", "workers": spec.world_size, "elements": case.n,
            "density": case.density, "system": system, "skew": spec.skew,
            "times": t.tolist(), "ok": bool(flag.item()) if ref is not None else None,
            # Aggregator shards the omnireduce ops were split over: one per rank co-located,
            # else the dedicated ones (a comma-separated address).
            "shards": spec.world_size if is_colocated(system)
            else len([a for a in spec.address.split(",") if a]),
        }
        if worker is not None and worker.stats.last is not None:
            last = worker.stats.last
            event.update(sent_fraction=last.sent_fraction, rounds=last.rounds, messages_sent=last.messages_sent,
                         union_fraction=last.union_density if last.path == "sparse" else None)
        emit(event)


def serve_aggregator(listen: str, timeout: float) -> None:
    """Serves an aggregator on ``listen`` until stdin closes; prints its address first."""
    from aggregator import Aggregator

    agg = Aggregator(listen=listen, timeout=timeout).start()
    try:
        _emit({"type": "address", "address": agg.address})
        sys.stdin.read()
    finally:
        agg.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if len(args) == 3 and args[0] == "rank":
        with open(args[2]) as f:
            spec = RankSpec.from_json(f.read())
        run_rank(spec, int(args[1]))
        sys.stdout.flush()
        sys.stderr.flush()
        # Skips interpreter teardown, where a hung ZeroMQ context would block the exit.
        os._exit(0)
    if len(args) == 3 and args[0] == "aggregator":
        serve_aggregator(args[1], float(args[2]))
        return 0
    print("usage: python -m bench.procs rank RANK SPEC_FILE | aggregator LISTEN TIMEOUT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
