"""Helpers shared by the tests: the one home for them (fixtures live in ``tests/conftest.py``).

- data: :func:`sparse`, the random block-sparse tensors every test sums;
- ranks: :func:`run_ranks` (one thread per rank), :func:`run_procs` (one spawned process
  per rank, for torch);
- the in-process loopback: :func:`run_allreduce` drives the aggregator's engine and the
  workers' ops through encoded bytes, as a socket would, with no socket; :func:`wire`,
  :func:`peer_of`, :func:`start_frames`, :func:`error_replies` and :func:`errors_by_peer`
  talk to an engine directly;
- kernel references: plain NumPy versions of the block kernels (:func:`ref_mask`,
  :func:`ref_compact`, :func:`ref_scatter`, :func:`ref_zeroed`) and :func:`make_case`,
  shared by ``tests/test_kernels.py`` and ``tests/test_kernels_cuda.py``.

The aggregator and the worker are imported where they are used, so that this module
imports with NumPy and the core alone (the CUDA simulator child imports it too).
"""

from __future__ import annotations

import io
import os
import random
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from omnireduce import blocks
from omnireduce.dtypes import DType, from_accumulator
from omnireduce.errors import OmniReduceError
from omnireduce.layout import Layout
from omnireduce.protocol import Error, ErrorCode, Result, decode

if TYPE_CHECKING:
    from aggregator.engine import Engine
    from worker.op import WorkerOp

#: The repository's root (the working directory of the tests' child processes).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env() -> dict[str, str]:
    """The environment of a child Python process that imports this repository's packages."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))


# Data.


def sparse(
    rng: np.random.Generator,
    n: int,
    density: float,
    block: int = 256,
    dtype: Any = np.float32,
    low: int = -50,
    high: int = 50,
    normal: bool = False,
) -> np.ndarray:
    """``n`` elements in blocks of ``block``, each block nonzero with probability ``density``.

    Args:
        rng: the generator (the tensor is a function of its state).
        n: elements; the last block may be short.
        density: the probability of each block being nonzero (``block=1``: of each element).
        block: elements per block.
        dtype: the result's type.
        low, high: the nonzero blocks hold integers in ``[low, high]``, so that float sums
            are exact whatever the order of the additions (a few of them may be 0).
        normal: standard normal values instead, whose float sums depend on that order.
    """
    nb = -(-n // block) if n else 0
    x = np.zeros(nb * block, dtype=dtype)
    keep = rng.random(nb) < density
    shape = (int(keep.sum()), block)
    values = rng.standard_normal(shape) if normal else rng.integers(low, high, size=shape, endpoint=True)
    x.reshape(nb, block)[keep] = values.astype(dtype)
    return x[:n]


# Ranks.


def run_ranks(world: int, fn: Callable[[int], Any], timeout: float = 60) -> list[Any]:
    """Runs fn(rank) on one thread per rank; returns results, re-raising the first error."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "rank thread hung"
    if errors:
        raise errors[0]
    return results


class ThreadExchange:
    """An all-gather of co-located shard addresses among the rank threads of this process
    (the ``exchange`` of :class:`worker.colocated.ColocatedWorker`); ``ex(rank)`` is rank's."""

    def __init__(self, world: int) -> None:
        self.addresses: list[Any] = [None] * world
        self._barrier = threading.Barrier(world, timeout=20)

    def __call__(self, rank: int) -> Any:
        def exchange(address: str) -> list[str]:
            self.addresses[rank] = address
            self._barrier.wait()
            return list(self.addresses)

        return exchange


def run_procs(fn_name: str, world: int, tmp_path: Any, *args: Any, timeout: float = 240) -> list[dict]:
    """Runs ``tests.torch_procs.<fn_name>`` in ``world`` spawned processes (a torch process group
    initialised from a file under ``tmp_path``); returns each rank's result, raising on a rank's failure."""
    import multiprocessing as mp

    import torch

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = str(tmp_path / f"init-{fn_name}-{world}-{os.getpid()}")
    procs = [
        ctx.Process(target=_entry, args=(fn_name, r, world, init, results, args), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for r in range(world):
        assert not isinstance(got[r], str), f"rank {r} failed:\n{got[r]}"
    return [torch.load(io.BytesIO(got[r]), weights_only=False) for r in range(world)]


def _entry(*args: Any) -> None:
    from tests.torch_procs import entry

    entry(*args)


# The in-process loopback.


def wire(frames: list[Any]) -> list[bytes]:
    """Frames as plain bytes, as a socket would deliver them."""
    return [f if isinstance(f, bytes) else memoryview(np.ascontiguousarray(f)).cast("B").tobytes() for f in frames]


def peer_of(rank: int) -> bytes:
    """The routing id the loopback gives a rank's connection."""
    return f"peer-{rank}".encode()


def start_frames(
    rank: int,
    world: int,
    length: int = 64,
    op: int = 0,
    job: str = "j",
    *,
    block_size: int = 8,
    message_blocks: int = 4,
    streams: int = 2,
    dtype: DType = DType.FLOAT32,
) -> list[bytes]:
    """A worker's encoded (first) START of an op of ``length`` ones (every block nonzero)."""
    from worker.op import WorkerOp

    layout = Layout(length, block_size, message_blocks, streams)
    return wire(WorkerOp(job, rank, world, op, np.ones(length, dtype.storage), dtype, layout).start()[0])


def _errors(out: list[tuple[bytes, list[Any]]]) -> list[tuple[bytes, Error]]:
    pairs = []
    for peer, frames in out:
        msg, _ = decode(wire(frames))
        assert isinstance(msg, Error)
        pairs.append((peer, msg))
    return pairs


def error_replies(out: list[tuple[bytes, list[Any]]]) -> list[tuple[bytes, ErrorCode, str]]:
    """An engine's replies, each of which must be an ERROR, as ``(peer, code, message)`` in order."""
    return [(peer, ErrorCode(msg.code), msg.message) for peer, msg in _errors(out)]


def errors_by_peer(out: list[tuple[bytes, list[Any]]]) -> dict[bytes, Error]:
    """An engine's replies, each of which must be an ERROR, by peer."""
    return dict(_errors(out))


def _fifo_pick(queue: list[tuple[Any, Any]], shuffle: random.Random | None) -> int:
    """A random pending message, but the oldest of its connection: ZeroMQ keeps order per pair."""
    if not shuffle:
        return 0
    who = queue[shuffle.randrange(len(queue))][0]
    return next(i for i, (w, _) in enumerate(queue) if w == who)


def run_allreduce(
    inputs: list[np.ndarray],
    dtype: DType,
    block_size: int = 256,
    message_blocks: int = 8,
    streams: int = 2,
    job: str = "job",
    op: int = 0,
    engine: Engine | None = None,
    shuffle: random.Random | None = None,
    weights: list[float] | None = None,
    compute: list[float] | None = None,
    inplace: bool = False,
) -> tuple[list[np.ndarray], list[WorkerOp], Engine]:
    """Runs one op among ``len(inputs)`` workers and an engine in this process; returns every
    worker's output, the workers' ops and the engine.

    Every message is turned into plain bytes on its way, as a socket would, so the
    protocol's encoding is exercised without any socket.

    Args:
        shuffle: when given, delivers pending messages in a random order (as
            streams and workers interleave on a real network).
        weights: each worker's weight, for a weighted op.
        compute: each worker's reported compute seconds.
        inplace: every worker writes the sum into its input.
    """
    from aggregator.engine import Engine
    from worker.op import WorkerOp

    engine = engine or Engine()
    world = len(inputs)
    ops = [
        WorkerOp(
            job, r, world, op, x, dtype, Layout(len(x), block_size, message_blocks, streams),
            weight=None if weights is None else weights[r], compute=None if compute is None else compute[r],
            inplace=inplace,
        )
        for r, x in enumerate(inputs)
    ]
    to_agg: list[tuple[bytes, list[bytes]]] = [
        (peer_of(r), wire(frames)) for r, w in enumerate(ops) for frames in w.start()
    ]
    to_workers: list[tuple[int, list[bytes]]] = []
    by_peer = {peer_of(r): r for r in range(world)}
    steps = 0
    while to_agg or to_workers:
        steps += 1
        assert steps < 10_000_000, "no progress"
        pick_agg = bool(to_agg) and (not to_workers or (shuffle.random() < 0.5 if shuffle else True))
        if pick_agg:
            peer, frames = to_agg.pop(_fifo_pick(to_agg, shuffle))
            for dest, out in engine.handle(peer, frames):
                to_workers.append((by_peer[dest], wire(out)))
        else:
            rank, frames = to_workers.pop(_fifo_pick(to_workers, shuffle))
            msg, data = decode(frames)
            if isinstance(msg, Error):
                raise OmniReduceError(f"rank {rank}: {msg.message}")
            assert isinstance(msg, Result)
            reply = ops[rank].on_result(msg, data)
            if reply is not None:
                to_agg.append((peer_of(rank), wire(reply)))
    assert all(w.done for w in ops)
    return [w.out for w in ops], ops, engine


# Kernel references: floats compared as floats (``abs(x) <= t``), independently of the
# kernels' bit-pattern arithmetic.

_MAX = {np.dtype(np.float32): np.finfo(np.float32).max, np.dtype(np.float16): np.finfo(np.float16).max,
        np.dtype(np.float64): np.finfo(np.float64).max}


def values_of(x: np.ndarray) -> np.ndarray:
    """The float values of a storage array (bfloat16 bits widened to float32)."""
    if x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x


def rounded_threshold(threshold: float, dtype: np.dtype) -> float:
    """The threshold in the element type (nearest; bfloat16 via float32), capped at the largest finite value."""
    dtype = np.dtype(dtype)
    with np.errstate(over="ignore"):
        if dtype == np.uint16:
            bits = from_accumulator(np.array([threshold], np.float32), DType.BFLOAT16)
            t = float(values_of(bits)[0])
            return t if np.isfinite(t) else float(values_of(np.array([0x7F7F], np.uint16))[0])
        t = float(dtype.type(threshold))
    return t if np.isfinite(t) else float(_MAX[dtype])


def ref_mask(x: np.ndarray, block_size: int, threshold: float = 0.0) -> np.ndarray:
    """Reference mask: a block is nonzero if any ``not (|x| <= t)`` (so NaN counts)."""
    n = len(x)
    nb = -(-n // block_size)
    nz = ~(np.abs(values_of(x)) <= rounded_threshold(threshold, x.dtype))
    pad = np.zeros(nb * block_size, bool)
    pad[:n] = nz
    return pad.reshape(nb, block_size).any(1)


def ref_zeroed(x: np.ndarray, mask: np.ndarray, block_size: int, threshold: float) -> np.ndarray:
    """What the kernels leave in ``x``: with a positive threshold, zero blocks are set to 0."""
    out = x.copy()
    if threshold > 0:
        for b in np.flatnonzero(~mask):
            out[b * block_size : (b + 1) * block_size] = 0
    return out


def ref_compact(x: np.ndarray, mask: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.flatnonzero(mask)
    return ids, blocks.gather(x, ids, Layout(len(x), block_size, 1, 1))


def ref_scatter(n: int, ids: np.ndarray, payload: np.ndarray, block_size: int) -> np.ndarray:
    out = np.zeros(n, payload.dtype)
    blocks.scatter(out, ids, payload, Layout(n, block_size, 1, 1))
    return out


def make_case(rng: np.random.Generator, n: int, dtype: type, density: float = 0.05) -> np.ndarray:
    """Sparse random data with NaN, +-Inf, -0.0, subnormals and small values sprinkled in."""
    vals = np.where(rng.random(n) < density, rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n), 0.0)
    vals = vals.astype(np.float32)
    k = max(1, n // 50) if n else 0
    for special in (np.nan, np.inf, -np.inf, -0.0, 1e-45, 1e-3):
        vals[rng.integers(0, n, size=k // 6 + 1) if n else []] = special
    if dtype is np.uint16:
        return (vals.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bfloat16
    with np.errstate(over="ignore"):
        return vals.astype(dtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a.view(np.uint8) == b.view(np.uint8)).all())
