"""The worker's side of one op, free of sockets so tests can drive it directly.

The worker keeps, per column, its own next nonzero block (``mynext``) and a
table giving the next nonzero block below any row. On each RESULT of a stream it
writes the summed blocks into its output and, where the instruction equals its
own next block, sends that block with the pointer to the one after.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from omnireduce import blocks
from omnireduce.dtypes import DType
from omnireduce.errors import ProtocolError
from omnireduce.layout import INF, Layout
from omnireduce.protocol import Blocks, Result, Start, buffer_of, encode, index_array
from worker.stats import OpStats, frames_nbytes

logger = logging.getLogger(__name__)

__all__ = ["WorkerOp"]


class WorkerOp:
    """One allreduce as seen by one worker.

    Args:
        job: the job id.
        rank: this worker's rank.
        world_size: the number of workers.
        op: the op number (call order within the worker).
        flat: the contiguous 1-D input (bfloat16 as uint16 bits); read until the op completes.
        dtype: the element type.
        layout: the op's block layout.
    """

    def __init__(
        self, job: str, rank: int, world_size: int, op: int, flat: np.ndarray, dtype: DType, layout: Layout
    ) -> None:
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.op = op
        self.flat = flat
        self.dtype = dtype
        self.layout = layout
        self.out = np.zeros(layout.length, dtype=dtype.storage)
        mask = blocks.block_mask(flat, layout.block_size)
        self._table = blocks.next_table(mask, layout)
        self._mynext = self._table[0].copy()
        self._cur: list[np.ndarray | None] = [None] * layout.num_streams
        self._rounds = [0] * layout.num_streams
        self._left = layout.num_streams
        self.stats = OpStats(op=op, elements=layout.length, dense_bytes=layout.length * dtype.itemsize)

    @property
    def done(self) -> bool:
        return self._left == 0

    def start(self) -> list[Any]:
        """The START message (round 0): every column's first nonzero block."""
        frames = encode(
            Start(
                self.job, self.rank, self.world_size, self.op, self.layout.length, int(self.dtype),
                self.layout.block_size, self.layout.message_blocks, self.layout.streams,
            ),
            self._mynext,
        )
        self._count_sent(frames, 0)
        return frames

    def _count_sent(self, frames: list[Any], nblocks: int) -> None:
        self.stats.bytes_sent += frames_nbytes(frames)
        self.stats.messages_sent += 1
        self.stats.blocks_sent += nblocks

    def on_result(self, msg: Result, data: list[Any]) -> list[Any] | None:
        """Applies a RESULT; returns the BLOCKS message to send, if this worker has any.

        Raises:
            ProtocolError: the result does not fit the op's state.
        """
        s = msg.stream
        if s >= self.layout.num_streams or self._cur[s] is None and msg.round != 0:
            raise ProtocolError(f"result for stream {msg.stream} round {msg.round} out of order")
        if msg.round != self._rounds[s] or len(data) != 2:
            raise ProtocolError(
                f"result for stream {s} round {msg.round} with {len(data)} frames; expected round {self._rounds[s]}"
            )
        self.stats.bytes_received += frames_nbytes(data)
        self.stats.messages_received += 1
        prev = self._cur[s]
        payload = np.frombuffer(buffer_of(data[1]), dtype=self.dtype.storage)
        if prev is not None:
            ids = prev[prev != INF]
            if len(payload) != self.layout.payload_elements(ids):
                raise ProtocolError(
                    f"result for stream {s} has {len(payload)} elements, expected {self.layout.payload_elements(ids)}"
                )
            blocks.scatter(self.out, ids, payload, self.layout)
            self.stats.blocks_received += len(ids)
        elif len(payload):
            raise ProtocolError("round 0 result carries data")
        cols = self.layout.stream_columns(s)
        cur = index_array(data[0])
        if len(cur) != cols.stop - cols.start:
            raise ProtocolError(f"instruction for stream {s} has {len(cur)} columns, expected {cols.stop - cols.start}")
        self._cur[s] = cur
        self._rounds[s] += 1
        self.stats.rounds = max(self.stats.rounds, self._rounds[s])
        mine = self._mynext[cols]
        if (mine < cur).any():
            raise ProtocolError(f"instruction for stream {s} skips a nonzero block of rank {self.rank}")
        sel = np.flatnonzero((mine == cur) & (cur != INF))
        if not (cur != INF).any():
            self._left -= 1
            return None
        if len(sel) == 0:
            return None
        ids = cur[sel]
        abs_cols = sel + cols.start
        after = self._table[ids // self.layout.num_columns + 1, abs_cols]
        self._mynext[abs_cols] = after
        frames = encode(Blocks(self.job, self.rank, self.op, s, msg.round), after, blocks.gather(self.flat, ids, self.layout))
        self._count_sent(frames, len(ids))
        return frames
