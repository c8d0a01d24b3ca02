"""Drives the aggregator engine and worker ops in one process, through encoded bytes.

Every message is turned into plain bytes on its way, as a socket would, so the
protocol's encoding is exercised without any socket.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from aggregator.engine import Engine
from omnireduce.dtypes import DType
from omnireduce.errors import OmniReduceError
from omnireduce.layout import Layout
from omnireduce.protocol import Error, Result, decode
from worker.op import WorkerOp


def wire(frames: list[Any]) -> list[bytes]:
    return [f if isinstance(f, bytes) else memoryview(np.ascontiguousarray(f)).cast("B").tobytes() for f in frames]


def peer_of(rank: int) -> bytes:
    return f"peer-{rank}".encode()


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
    """Runs one op among ``len(inputs)`` workers; returns every worker's output.

    Args:
        shuffle: when given, delivers pending messages in a random order (as
            streams and workers interleave on a real network).
        weights: each worker's weight, for a weighted op.
        compute: each worker's reported compute seconds.
        inplace: every worker writes the sum into its input.
    """
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
    to_agg: list[tuple[bytes, list[bytes]]] = [(peer_of(r), wire(w.start())) for r, w in enumerate(ops)]
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
