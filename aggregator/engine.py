"""The aggregator's state machine, free of sockets so it can be driven by tests.

:class:`Engine` takes one decoded-or-not message at a time from a peer and
returns the messages to send. Per op it keeps every worker's next nonzero block
per column (``nextp``, ranks x columns); per stream and round it knows from that
table exactly which workers must send, sums their blocks in rank order once all
have, and answers every worker with the sums and the next instruction: the
per-column minimum of the workers' next pointers.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnireduce import blocks
from omnireduce.dtypes import DType, from_accumulator, to_accumulator
from omnireduce.errors import OmniReduceError, ProtocolError
from omnireduce.layout import INF, Layout
from omnireduce.protocol import (
    Blocks,
    Error,
    ErrorCode,
    Result,
    Start,
    buffer_of,
    decode,
    encode,
    index_array,
)

logger = logging.getLogger(__name__)

__all__ = ["Engine", "Outgoing"]

#: A message to send: the peer's routing id and the frames.
Outgoing = tuple[bytes, list[Any]]
_EMPTY_INDEX = np.empty(0, dtype=np.int64)
_TOMBSTONES = 1024


class _OpFailed(OmniReduceError):
    def __init__(self, code: ErrorCode, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.ranks = ranks or []


@dataclass(slots=True)
class _Stream:
    index: int
    cols: slice
    round: int = 0
    cur: np.ndarray = field(default_factory=lambda: _EMPTY_INDEX)
    # match[w, j]: worker w must send the block instructed in column j this round.
    match: np.ndarray = field(default_factory=lambda: np.empty((0, 0), dtype=bool))
    expected: set[int] = field(default_factory=set)
    received: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    done: bool = False


@dataclass(slots=True)
class _Op:
    job: str
    op: int
    world_size: int
    layout: Layout
    dtype: DType
    params: tuple[int, ...]
    started: float
    peers: list[bytes | None]
    nextp: np.ndarray
    streams: list[_Stream]
    streams_left: int


class Engine:
    """Coordinates the ops of every job; one instance per aggregator.

    Args:
        timeout: seconds after an op's first message at which it is failed with
            TIMEOUT, naming the ranks it still waits for; None waits forever.
        clock: monotonic time source (tests substitute their own).
    """

    def __init__(self, timeout: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self._clock = clock
        self._ops: dict[tuple[str, int], _Op] = {}
        self._failed: OrderedDict[tuple[str, int], tuple[ErrorCode, str, list[int]]] = OrderedDict()
        self.ops_completed = 0
        self.ops_failed = 0

    @property
    def active_ops(self) -> int:
        return len(self._ops)

    def handle(self, peer: bytes, frames: list[Any]) -> list[Outgoing]:
        """Processes one message from ``peer`` and returns what to send.

        Never raises for bad input: a message that cannot be decoded gets an ERROR
        reply; one that breaks an op fails that op on every worker.
        """
        try:
            msg, data = decode(frames)
        except ProtocolError as e:
            logger.warning("bad message from peer %s: %s", peer.hex(), e)
            return [(peer, encode(Error("?", None, ErrorCode.PROTOCOL, str(e), [])))]
        if isinstance(msg, Start):
            key = (msg.job, msg.op)
        elif isinstance(msg, Blocks):
            key = (msg.job, msg.op)
        else:
            err = f"{msg.TYPE.name} is not a message a worker may send"
            logger.warning("peer %s: %s", peer.hex(), err)
            return [(peer, encode(Error(msg.job, None, ErrorCode.PROTOCOL, err, [])))]
        failed = self._failed.get(key)
        if failed is not None:
            code, message, ranks = failed
            return [(peer, encode(Error(key[0], key[1], code, message, ranks)))]
        try:
            if isinstance(msg, Start):
                return self._on_start(peer, msg, data)
            return self._on_blocks(peer, msg, data)
        except _OpFailed as e:
            return self._fail(key, e.code, e.message, e.ranks, extra_peer=peer)
        except Exception as e:  # a bug must fail the op, not kill the daemon
            logger.exception("internal error handling %s for job %r op %d", msg.TYPE.name, key[0], key[1])
            return self._fail(key, ErrorCode.INTERNAL, f"internal aggregator error: {e!r}", [], extra_peer=peer)

    def expire(self) -> list[Outgoing]:
        """Fails every op older than the timeout; call it periodically."""
        if self.timeout is None:
            return []
        now = self._clock()
        out: list[Outgoing] = []
        for key, op in list(self._ops.items()):
            if now - op.started <= self.timeout:
                continue
            missing = [r for r, p in enumerate(op.peers) if p is None]
            if not missing:
                missing = sorted({r for s in op.streams if not s.done for r in s.expected - s.received.keys()})
            out += self._fail(
                key, ErrorCode.TIMEOUT,
                f"op did not complete within {self.timeout:g} s; waiting for ranks {missing}", missing,
            )
        return out

    def _fail(
        self, key: tuple[str, int], code: ErrorCode, message: str, ranks: list[int], extra_peer: bytes | None = None
    ) -> list[Outgoing]:
        logger.error("job %r op %d failed (%s): %s", key[0], key[1], code.name, message)
        op = self._ops.pop(key, None)
        self._failed[key] = (code, message, ranks)
        if len(self._failed) > _TOMBSTONES:
            self._failed.popitem(last=False)
        self.ops_failed += 1
        peers = {p for p in (op.peers if op else []) if p is not None}
        if extra_peer is not None:
            peers.add(extra_peer)
        return [(p, encode(Error(key[0], key[1], code, message, ranks))) for p in peers]

    def _on_start(self, peer: bytes, msg: Start, data: list[Any]) -> list[Outgoing]:
        key = (msg.job, msg.op)
        params = (msg.world_size, msg.length, msg.dtype, msg.block_size, msg.message_blocks, msg.streams)
        op = self._ops.get(key)
        if op is None:
            try:
                layout = Layout(msg.length, msg.block_size, msg.message_blocks, msg.streams)
            except OmniReduceError as e:
                raise _OpFailed(ErrorCode.PROTOCOL, f"rank {msg.rank}: {e}") from None
            op = _Op(
                job=msg.job, op=msg.op, world_size=msg.world_size, layout=layout, dtype=DType(msg.dtype),
                params=params, started=self._clock(), peers=[None] * msg.world_size,
                nextp=np.full((msg.world_size, layout.num_columns), INF, dtype=np.int64),
                streams=[_Stream(s, layout.stream_columns(s)) for s in range(layout.num_streams)],
                streams_left=layout.num_streams,
            )
            self._ops[key] = op
        elif params != op.params:
            names = ("world_size", "length", "dtype", "block_size", "message_blocks", "streams")
            diff = ", ".join(
                f"{n}: {a} vs {b}" for n, a, b in zip(names, op.params, params, strict=True) if a != b
            )
            joined = [r for r, p in enumerate(op.peers) if p is not None]
            raise _OpFailed(
                ErrorCode.MISMATCH,
                f"workers disagree on the op: rank {msg.rank} sent {diff} (first value from ranks {joined})",
                sorted({*joined, msg.rank}),
            )
        if op.peers[msg.rank] is not None:
            raise _OpFailed(ErrorCode.PROTOCOL, f"rank {msg.rank} joined the op twice", [msg.rank])
        if len(data) != 1:
            raise _OpFailed(ErrorCode.PROTOCOL, f"START from rank {msg.rank} has {len(data)} frames, expected 1")
        first = index_array(data[0])
        cols = np.arange(op.layout.num_columns, dtype=np.int64)
        if len(first) != len(cols):
            raise _OpFailed(
                ErrorCode.PROTOCOL, f"rank {msg.rank} sent {len(first)} column pointers, expected {len(cols)}"
            )
        self._check_pointers(op, first, cols, _EMPTY_INDEX, msg.rank)
        op.nextp[msg.rank] = first
        op.peers[msg.rank] = peer
        if any(p is None for p in op.peers):
            return []
        out: list[Outgoing] = []
        for s in op.streams:
            out += self._advance(op, s, np.empty(0, dtype=op.dtype.storage))
        return out

    def _check_pointers(
        self, op: _Op, ptrs: np.ndarray, cols: np.ndarray, after: np.ndarray, rank: int
    ) -> None:
        c = op.layout.num_columns
        finite = ptrs != INF
        ok = (ptrs[finite] < op.layout.num_blocks) & (ptrs[finite] % c == cols[finite])
        if len(after):
            ok &= ptrs[finite] > after[finite]
        if not ok.all():
            raise _OpFailed(ErrorCode.PROTOCOL, f"rank {rank} sent block pointers outside its columns", [rank])

    def _advance(self, op: _Op, s: _Stream, payload: np.ndarray) -> list[Outgoing]:
        """Sends the last round's sums and the next instruction, and sets up the next round."""
        table = op.nextp[:, s.cols]
        cur = table.min(axis=0) if len(table) else _EMPTY_INDEX
        active = cur != INF
        s.match = (table == cur) & active
        s.expected = set(np.flatnonzero(s.match.any(axis=1)).tolist())
        s.received = {}
        frames = encode(Result(op.job, op.op, s.index, s.round), cur, payload)
        s.cur = cur
        if not active.any():
            s.done = True
            op.streams_left -= 1
            if op.streams_left == 0:
                del self._ops[(op.job, op.op)]
                self.ops_completed += 1
        return [(p, frames) for p in op.peers if p is not None]

    def _on_blocks(self, peer: bytes, msg: Blocks, data: list[Any]) -> list[Outgoing]:
        key = (msg.job, msg.op)
        op = self._ops.get(key)
        if op is None:
            return [(peer, encode(Error(msg.job, msg.op, ErrorCode.UNKNOWN_OP, "no such op in flight", [msg.rank])))]
        if msg.rank >= op.world_size or msg.stream >= len(op.streams):
            raise _OpFailed(ErrorCode.PROTOCOL, f"rank {msg.rank} sent stream {msg.stream} out of range", [msg.rank])
        s = op.streams[msg.stream]
        if s.done or msg.round != s.round or msg.rank not in s.expected or msg.rank in s.received:
            raise _OpFailed(
                ErrorCode.PROTOCOL,
                f"rank {msg.rank} sent stream {msg.stream} round {msg.round} unexpectedly "
                f"(stream at round {s.round}, done={s.done})",
                [msg.rank],
            )
        if len(data) != 2:
            raise _OpFailed(ErrorCode.PROTOCOL, f"BLOCKS from rank {msg.rank} has {len(data)} frames, expected 2")
        op.peers[msg.rank] = peer
        sel = np.flatnonzero(s.match[msg.rank])
        ptrs = index_array(data[0])
        if len(ptrs) != len(sel):
            raise _OpFailed(
                ErrorCode.PROTOCOL, f"rank {msg.rank} sent {len(ptrs)} pointers, expected {len(sel)}", [msg.rank]
            )
        ids = s.cur[sel]
        self._check_pointers(op, ptrs, sel + s.cols.start, ids, msg.rank)
        buf = buffer_of(data[1])
        want = op.layout.payload_elements(ids) * op.dtype.itemsize
        if buf.nbytes != want:
            raise _OpFailed(
                ErrorCode.PROTOCOL, f"rank {msg.rank} sent a payload of {buf.nbytes} bytes, expected {want}", [msg.rank]
            )
        s.received[msg.rank] = (sel, ptrs, np.frombuffer(buf, dtype=op.dtype.storage))
        if len(s.received) < len(s.expected):
            return []
        return self._complete_round(op, s)

    def _complete_round(self, op: _Op, s: _Stream) -> list[Outgoing]:
        layout = op.layout
        active = np.flatnonzero(s.cur != INF)
        ids = s.cur[active]
        # Row of each column of the stream in the summed output.
        row_of = np.cumsum(s.cur != INF) - 1
        acc = np.zeros((len(active), layout.block_size), dtype=op.dtype.accumulator)
        # A fixed rank order makes the sums identical from run to run.
        for rank in sorted(s.received):
            sel, ptrs, payload = s.received[rank]
            rows = row_of[sel]
            for sl, view in blocks.split_payload(payload, s.cur[sel], layout):
                acc[rows[sl], : view.shape[1]] += to_accumulator(view, op.dtype)
            op.nextp[rank, sel + s.cols.start] = ptrs
        summed = from_accumulator(acc, op.dtype)
        out = np.empty(layout.payload_elements(ids), dtype=op.dtype.storage)
        for sl, view in blocks.split_payload(out, ids, layout):
            view[:] = summed[sl, : view.shape[1]]
        s.round += 1
        return self._advance(op, s, out)
