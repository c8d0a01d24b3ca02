"""An op's state on the aggregator, and the pure helpers the engine's handlers share.

:class:`OpState` is one op in flight (its layout, the ranks that joined, the bytes it
holds against the caps) and :class:`Stream` one of its streams (the table of next
pointers, the round, what each rank sent). The functions are free of the engine's
state: what every rank of an op must agree on, the union of sorted pointer runs, the
checks of a START's frames, and received payloads in the accumulator type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aggregator.jobs import Refused
from omnireduce.dtypes import DType, to_accumulator
from omnireduce.layout import Layout
from omnireduce.protocol import ErrorCode, Start, buffer_of

__all__ = [
    "EMPTY_INDEX", "OpState", "Stream", "accumulable", "check_start_shape", "op_params", "payload_values",
    "positions", "ranks_text", "union_sorted",
]

EMPTY_INDEX = np.empty(0, dtype=np.int64)
# Ranks listed in an error's text; the error's ranks field has all of them.
_RANKS_IN_TEXT = 16


def op_params(msg: Start) -> tuple[Any, ...]:
    """What every worker of an op must agree on."""
    return (
        msg.world_size, msg.length, msg.dtype, msg.block_size, msg.message_blocks, msg.streams,
        msg.weight is not None, None if msg.shape is None else tuple(msg.shape),
        None if msg.part is None else tuple(msg.part), bool(msg.eager),
    )


@dataclass(slots=True)
class Stream:
    index: int
    # The stream's columns; ``cols`` the ones still active (some worker has a block in
    # them), ascending. A column whose instruction is INF never becomes active again,
    # so a round costs what its active columns do, not what the stream's do.
    span: slice
    cols: np.ndarray = field(default_factory=lambda: EMPTY_INDEX)
    # nextp[w, j]: worker w's next nonzero block in active column j (INF: none left).
    nextp: np.ndarray = field(default_factory=lambda: np.empty((0, 0), dtype=np.int64))
    round: int = 0
    # The instructed block of every active column.
    cur: np.ndarray = field(default_factory=lambda: EMPTY_INDEX)
    # match[w, j]: worker w must send the block instructed in active column j this round.
    match: np.ndarray = field(default_factory=lambda: np.empty((0, 0), dtype=bool))
    expected: set[int] = field(default_factory=set)
    # Per rank that sent this round: the positions (in ``cur``) of its blocks, and their payload.
    received: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    done: bool = False
    # Bytes of the received frames kept until the round completes.
    held: int = 0

    def columns(self, sel: np.ndarray) -> np.ndarray:
        """The absolute columns of the active columns at positions ``sel``."""
        return self.cols[sel]


@dataclass(slots=True)
class OpState:
    job: str
    op: int
    world_size: int
    layout: Layout
    dtype: DType
    params: tuple[int, ...]
    started: float
    peers: list[bytes | None]
    # Each rank's START pointers (its first nonzero block per column, the finite ones in
    # column order) and their columns, until every rank has joined and the streams'
    # tables are built.
    starts: list[tuple[np.ndarray, np.ndarray] | None]
    streams: list[Stream]
    streams_left: int
    generation: int = 0
    # Bytes counted against the job's and the aggregator's caps (tables + held frames).
    held: int = 0
    # Weighted ops: each rank's weight (its sample count); the sums are divided by their total.
    weights: np.ndarray | None = None
    # Seconds each rank computed before the op (NaN: not reported), for batch balancing.
    compute: np.ndarray | None = None
    # Columns whose table cells (world x 9 bytes each) are held against the caps.
    reserved_columns: int = 0

    @property
    def eager(self) -> bool:
        """Every rank's nonzero blocks go with its START (:func:`op_params` holds the flag last)."""
        return bool(self.params[-1])


def union_sorted(runs: list[np.ndarray]) -> np.ndarray:
    """The distinct values of ascending arrays, ascending.

    A stable sort merges the sorted runs (NumPy's hash-based ``unique`` took 0.5 ms for
    5,000 values, five times the whole START).
    """
    if not runs:
        return EMPTY_INDEX
    if len(runs) == 1:
        return runs[0]
    # Every rank sent the same blocks (every stream of a dense tensor): one compare
    # pass each instead of a sort of all of them. A copy, not the run itself: the union
    # is sent to every rank, and a run handed over inproc is a co-located worker's own
    # index memory, which it may reuse once its own result arrives.
    first = runs[0]
    if all(len(r) == len(first) for r in runs) and all(np.array_equal(first, r) for r in runs[1:]):
        return first.copy()
    u = np.sort(np.concatenate(runs), kind="stable")
    if len(u) < 2:
        return u
    keep = np.empty(len(u), dtype=np.bool_)
    keep[0] = True
    np.not_equal(u[1:], u[:-1], out=keep[1:])
    return u[keep]


def positions(union: np.ndarray, ptrs: np.ndarray) -> np.ndarray:
    """Where each of a rank's ascending pointers is in the ascending union that holds them."""
    if len(ptrs) == len(union):
        # A subset as long as the set is the set: no binary search per block.
        return np.arange(len(union))
    return np.searchsorted(union, ptrs)


def check_start_shape(layout: Layout, msg: Start, body: list[Any]) -> None:
    """Refuses a START whose frames cannot be what its layout allows (before any is read)."""
    if msg.eager:
        if layout.num_blocks > layout.num_columns:
            # Only where a column holds one block is a rank's first block per column all it sends.
            raise Refused.op_failure(ErrorCode.PROTOCOL, f"rank {msg.rank} sent an eager START for a layout of "
                                     f"{layout.num_blocks} blocks in {layout.num_columns} columns (more than one row)",
                                     [msg.rank])
        count = msg.stream_count or 1
        if msg.stream is None or msg.stream + count > layout.num_streams:
            raise Refused.op_failure(ErrorCode.PROTOCOL, f"rank {msg.rank} sent an eager START of streams "
                                     f"{msg.stream}+{count}, not among the op's {layout.num_streams}", [msg.rank])
        columns = layout.stream_columns(msg.stream + count - 1).stop - layout.stream_columns(msg.stream).start
    else:
        if msg.stream is not None or msg.stream_count is not None:
            raise Refused.op_failure(ErrorCode.PROTOCOL, f"rank {msg.rank} sent a START of given streams "
                                     f"({msg.stream}) for an op that is not eager", [msg.rank])
        columns = layout.num_columns
    if len(body) != 1 + bool(msg.eager) or buffer_of(body[0]).nbytes > 8 * columns:
        blocks_too = " and their blocks" if msg.eager else ""
        raise Refused.op_failure(ErrorCode.PROTOCOL, f"START from rank {msg.rank} does not carry at most "
                                 f"{columns} column pointers{blocks_too}", [msg.rank])


def payload_values(buf: memoryview, dtype: DType, owned: bool) -> np.ndarray:
    """A received payload's values; writeable only if the message owns its memory (see ``Engine.handle``)."""
    values = np.frombuffer(buf, dtype=dtype.storage)
    if not owned and values.flags.writeable:
        values.flags.writeable = False
    return values


def accumulable(vals: np.ndarray, dtype: DType, weight: float) -> np.ndarray:
    """Received values in the accumulator type, times ``weight``; no copy when neither changes them.

    Integers (int64 accumulator) always have weight 1: weighted integer ops are refused at START.
    """
    acc_type = dtype.accumulator
    if vals.dtype != acc_type:
        vals = to_accumulator(vals, dtype)  # copies even when the types agree: only called when they differ
    if weight != 1.0:
        vals = np.multiply(vals, acc_type.type(weight), dtype=acc_type)
    return vals


def ranks_text(ranks: list[int]) -> str:
    if len(ranks) <= _RANKS_IN_TEXT:
        return str(ranks)
    return f"{ranks[:_RANKS_IN_TEXT]} and {len(ranks) - _RANKS_IN_TEXT} more"
