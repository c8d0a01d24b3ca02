"""The worker's side of one op, free of sockets so tests can drive it directly.

The worker keeps, per column, its own next nonzero block (``mynext``) and a
table giving the next nonzero block below any row. On each RESULT of a stream it
writes the summed blocks into its output and, where the instruction equals its
own next block, sends that block with the pointer to the one after.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from omnireduce import blocks
from omnireduce.dtypes import DType
from omnireduce.errors import ConfigError, ProtocolError
from omnireduce.layout import EAGER_PIECES, INF, Layout, eager_start_blocks
from omnireduce.protocol import (
    Blocks,
    Result,
    Start,
    buffer_of,
    compact_pointers,
    encode,
    index_array,
    pointer_columns,
)
from worker.stats import OpStats, frames_nbytes

if TYPE_CHECKING:
    from worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

__all__ = [
    "LAZY_ZEROS_BYTES", "OpRequest", "WorkerOp", "lazy_zeros", "pages_written", "sparse_result", "check_out",
    "check_destination",
]

#: From this size on, a sparse result is allocated as an anonymous mapping (see lazy_zeros).
LAZY_ZEROS_BYTES = 1 << 22
# Above this expected fraction of 4 KiB pages written, huge pages are cheaper: a fault
# costs about 3x more per 4 KiB page than zeroing it within a 2 MiB page (measured here).
_LAZY_PAGE_FRACTION = 0.3
_PAGE = 4096


def lazy_zeros(length: int, dtype: np.dtype, written: float = 0.0) -> np.ndarray:
    """A zero-filled array for a result of which only a ``written`` fraction of pages will be set.

    NumPy asks for transparent huge pages on large arrays, so writing one block
    zeroes the whole 2 MiB page around it, and a sparse result costs about as much
    as a dense one. An anonymous mapping of 4 KiB pages is zeroed page by page as
    the blocks land, and the pages never written read as the kernel's zero page.

    Args:
        length: elements.
        dtype: their type.
        written: the expected fraction of 4 KiB pages that will be written.
    """
    dtype = np.dtype(dtype)
    nbytes = length * dtype.itemsize
    if nbytes < LAZY_ZEROS_BYTES or written >= _LAZY_PAGE_FRACTION:
        return np.zeros(length, dtype=dtype)
    # The array keeps the mapping alive; it is unmapped when the array goes.
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype)


def pages_written(own: float, world_size: int, block_bytes: int) -> float:
    """Expected fraction of 4 KiB pages holding a block of the union, for independent random blocks."""
    union = 1.0 - (1.0 - own) ** world_size
    per_page = max(1.0, _PAGE / max(1, block_bytes))
    return 1.0 - (1.0 - union) ** per_page


def sparse_result(length: int, dtype: DType, own: float, world_size: int, block_size: int) -> np.ndarray:
    """A zero-filled result of ``length`` elements for an op of which this rank holds an ``own``
    fraction of the blocks: lazily zeroed pages where the union will touch few of them."""
    return lazy_zeros(length, np.dtype(dtype.storage), pages_written(own, world_size, block_size * dtype.itemsize))


def check_out(out: np.ndarray | None, length: int, dtype: DType) -> None:
    """Checks an op's ``out`` (if given): a writeable flat array of ``length`` elements of ``dtype``'s storage type.

    Raises:
        ConfigError: it is not.
    """
    storage = np.dtype(dtype.storage)
    if out is not None and (
        not isinstance(out, np.ndarray) or out.shape != (length,) or out.dtype != storage or not out.flags.writeable
    ):
        raise ConfigError(f"out must be a writeable flat {storage} array of {length} elements")


def check_destination(flat: np.ndarray, dtype: DType, inplace: bool, out: np.ndarray | None) -> None:
    """Checks where an op's sum is to go: into ``flat`` itself, or into ``out``.

    Raises:
        ConfigError: both asked, a read-only ``flat`` in place, or an ``out`` that is
            not a writeable flat array of ``flat``'s length and storage type.
    """
    if inplace and out is not None:
        raise ConfigError("inplace and out cannot be used together")
    if inplace and not flat.flags.writeable:
        raise ConfigError("an in-place allreduce needs a writeable tensor")
    check_out(out, len(flat), dtype)


@dataclass(frozen=True, slots=True)
class PartOf:
    """What makes an op one part of a sharded worker's op (:mod:`worker.sharded`).

    Attributes:
        op: the sharded op's number, which its parts take at every shard: ranks that
            split an op differently stay in step for the next ones.
        index: which part this is.
        parts: how many parts the op has.
        shape: the whole tensor's shape, for a sparse tensor's rows; else None.
    """

    op: int
    index: int
    parts: int
    shape: tuple[int, ...] | None = None


@dataclass(slots=True)
class OpRequest:
    """One allreduce as a caller asked for it, checked and ready to run.

    Attributes:
        flat: the contiguous 1-D input (bfloat16 as uint16 bits); None when ``data`` is given.
        dtype: the element type.
        layout: the op's block layout.
        restore: turns the op's output into the caller's result (type, shape).
        future: completed with that result, or failed.
        inplace: the sum goes into ``flat`` itself.
        data: a data path other than a host array (device tensor, sparse rows).
        out: the array the sum goes into, if the caller gave one.
        weight: this worker's weight for a weighted mean, or None.
        compute: seconds of compute reported for batch balancing, or None.
        dense: send every block (no zero-block detection).
        measured: called with the op's stats once it finished (auto mode's density record).
        part: where the op is a sharded op's part, which (its number included).
        op: the op number, given by the connection when it queues the request.
    """

    flat: np.ndarray | None
    dtype: DType
    layout: Layout
    restore: Callable[[Any], Any]
    future: Future
    inplace: bool = False
    data: Any = None
    out: np.ndarray | None = None
    weight: float | None = None
    compute: float | None = None
    dense: bool = False
    measured: Callable[[OpStats], None] | None = None
    part: PartOf | None = None
    op: int = -1


class WorkerOp:
    """One allreduce as seen by one worker.

    Args:
        job: the job id.
        rank: this worker's rank.
        world_size: the number of workers.
        op: the op number (call order within the worker).
        flat: the contiguous 1-D input (bfloat16 as uint16 bits); read until the op completes.
            ``None`` when ``data`` is given.
        dtype: the element type.
        layout: the op's block layout.
        inplace: write the sum into ``flat`` itself (it must be writeable) instead of a
            new array. Safe: a block is read before it is sent and written only when
            its sum comes back, after which it is never read again; blocks outside
            the union of every worker's nonzero blocks are zero in ``flat`` already.
        data: the data path of a device tensor (:class:`worker.cuda.CudaOpData`):
            the op takes its mask and blocks from it and hands it the results.
        out: a zero-filled, writeable flat array of the input's length and storage
            type to write the sum into (e.g. a slice of a larger result).
        weight: this worker's weight (sample count) for a weighted mean; None for a sum.
        compute: seconds of compute reported for batch balancing; None if not measured.
        dense: send every block, without detecting the zero ones (the dense path:
            no mask pass; the sums are the same).
        part: where the op is a sharded op's part, which: the START says so, and every
            rank's must agree.
    """

    def __init__(
        self,
        job: str,
        rank: int,
        world_size: int,
        op: int,
        flat: np.ndarray | None,
        dtype: DType,
        layout: Layout,
        inplace: bool = False,
        data: Any = None,
        out: np.ndarray | None = None,
        weight: float | None = None,
        compute: float | None = None,
        dense: bool = False,
        pieces: int = EAGER_PIECES,
        part: PartOf | None = None,
    ) -> None:
        self.job = job
        self.part = part
        #: Most STARTs an eager payload is cut in (omnireduce.layout.eager_start_blocks).
        self.pieces = pieces
        self.rank = rank
        self.world_size = world_size
        self.op = op
        self.flat = flat
        self.dtype = dtype
        self.layout = layout
        self.weight = weight
        self.compute = compute
        #: The aggregator's recommended batch per rank, if it sent one with this op.
        self.batches: list[float] | None = None
        # A device tensor's data path (worker.cuda.CudaOpData): its mask, blocks and output live there.
        self._data = data
        # Where the sums go holds this rank's own blocks already (in place): a block only it sent is not written.
        self._holds_own = bool(getattr(data, "holds_own", False)) if data is not None else inplace
        # The nonzero blocks, where the data path knows them without a mask (rows ops).
        known: np.ndarray | None = getattr(data, "block_ids", None)
        mask: np.ndarray | None = None
        if data is not None:
            if known is None:
                mask = data.mask
            self.out = data.out
        else:
            check_destination(flat, dtype, inplace, out)
            mask = np.ones(layout.num_blocks, dtype=np.bool_) if dense else blocks.block_mask(flat, layout.block_size)
            if inplace:
                self.out = flat
            elif out is not None:
                self.out = out
            elif dense:
                self.out = np.empty(layout.length, dtype.storage)  # every block is written
            else:
                own = float(np.count_nonzero(mask)) / len(mask) if len(mask) else 0.0
                self.out = sparse_result(layout.length, dtype, own, world_size, layout.block_size)
        #: One row of blocks (a rows op lays one row per column): no column has a block
        #: after its first, so the START carries the blocks too and the op takes one round
        #: trip (an eager op; see omnireduce.protocol).
        self.eager = layout.num_blocks <= layout.num_columns
        self._ids: np.ndarray | None = None
        # An eager op's START payload (its blocks in order), until the RESULT.
        self._sent: np.ndarray | None = None
        # Not eager: the next-block table, and per stream this worker's columns with a block
        # still to send (an instruction must name every one of them, else it skipped one).
        self._table: np.ndarray | None = None
        self._live: list[int] = []
        if self.eager:
            # No table is built; this costs what the nonzero blocks do.
            ids = known if known is not None else np.flatnonzero(mask)
            self._ids = ids
            # Block c is column c's only block: per stream, this worker's blocks are a run of ids.
            starts = [layout.stream_columns(k).start for k in range(layout.num_streams)]
            self._bounds = np.searchsorted(ids, [*starts, layout.num_columns])
        else:
            if mask is None:
                mask = data.mask
            self._table = blocks.next_table(mask, layout)
            self._mynext = self._table[0].copy()
            live = self._mynext != INF
            self._live = [int(np.count_nonzero(live[layout.stream_columns(k)])) for k in range(layout.num_streams)]
        # Per stream, the last instruction: its finite pointers, as they came.
        self._cur: list[np.ndarray | None] = [None] * layout.num_streams
        self._rounds = [0] * layout.num_streams
        self._left = layout.num_streams
        self.stats = OpStats(
            op=op, elements=layout.length, blocks=layout.num_blocks, dense_bytes=layout.length * dtype.itemsize,
            path="dense" if dense else "sparse",
        )

    @classmethod
    def from_request(cls, settings: WorkerSettings, request: OpRequest) -> WorkerOp:
        """The op of ``request``, numbered, for the worker of ``settings``."""
        return cls(
            settings.job, settings.rank, settings.world_size, request.op, request.flat, request.dtype,
            request.layout, inplace=request.inplace, data=request.data, out=request.out, weight=request.weight,
            compute=request.compute, dense=request.dense, pieces=settings.eager_pieces, part=request.part,
        )

    @property
    def done(self) -> bool:
        return self._left == 0

    def _shape(self) -> list[int] | None:
        """The sparse tensor's shape that the START carries (a part's: the whole tensor's)."""
        if self.part is not None and self.part.shape is not None:
            return list(self.part.shape)
        return getattr(self._data, "shape", None)

    def start(self) -> list[list[Any]]:
        """The START messages (round 0), each a list of frames.

        Not eager: one, every column's first nonzero block. Eager: runs of consecutive
        streams, each with at most :func:`omnireduce.layout.eager_start_blocks` blocks
        (in a one-row layout a block is its column's pointer) and their payload: as few
        messages as that allows.
        """
        header = Start(
            self.job, self.rank, self.world_size, self.op, self.layout.length, int(self.dtype),
            self.layout.block_size, self.layout.message_blocks, self.layout.streams,
            self.weight, self.compute, self.eager or None, shape=self._shape(),
            part=None if self.part is None else [self.part.index, self.part.parts],
        )
        if not self.eager:
            frames = encode(header, compact_pointers(self._mynext))
            self._count_sent(frames, 0)
            return [frames]
        assert self._ids is not None
        # The payload is kept: the RESULT leaves out the sums that are this rank's own blocks.
        self._sent = sent = self._payload(self._ids)
        b = self.layout.block_size
        bounds = self._bounds
        nstreams = self.layout.num_streams
        most = eager_start_blocks(len(self._ids), b * self.dtype.itemsize, self.layout.message_blocks, self.pieces)
        messages = []
        k = 0
        while k < nstreams:
            # The most consecutive streams whose blocks fit in ``most`` (a stream always goes).
            end = max(k + 1, int(np.searchsorted(bounds, bounds[k] + most, "right")) - 1)
            lo, hi = int(bounds[k]), int(bounds[end])
            ids = self._ids[lo:hi]
            header.stream, header.stream_count = k, (end - k if end - k > 1 else None)
            # Only the last stream can hold the short last block.
            frames = encode(header, ids, sent[lo * b : lo * b + self.layout.payload_elements(ids)])
            self._count_sent(frames, hi - lo)
            messages.append(frames)
            k = end
        return messages

    def _payload(self, ids: np.ndarray) -> np.ndarray:
        # A run of consecutive blocks goes out as a view of the input, without a copy:
        # the input is not modified before the op completes (the caller's contract).
        if self._data is not None:
            return self._data.gather(ids, self.layout)
        return blocks.gather(self.flat, ids, self.layout, copy=False)

    def _apply_eager(self, s: int, cur: np.ndarray, data: list[Any]) -> None:
        """An eager stream's RESULT: the sums of the union ``cur``, less this rank's own blocks.

        Frames after the instruction: the order of the sums (a permutation of ``cur``;
        empty: as ``cur``), the W + 1 starts of the ranks' groups in that order (rank
        ``r``'s own blocks, which only it sent, are ``[g[r], g[r+1])``: their sums are
        the blocks it sent), and the sums before and after this rank's group (see
        ``aggregator.engine.Engine._eager_order``).
        """
        assert self._ids is not None and self._sent is not None
        order, groups = index_array(data[1]), index_array(data[2])
        k = len(cur)
        ids = cur
        if len(order):
            seen = np.zeros(k, dtype=np.bool_)
            if len(order) != k or int(order.min()) < 0 or int(order.max()) >= k:
                raise ProtocolError(f"result for stream {s} orders {len(order)} sums of {k}")
            seen[order] = True
            if not seen.all():
                raise ProtocolError(f"result for stream {s} orders its sums with repeats")
            ids = cur[order]
        if len(groups) != self.world_size + 1 or int(groups[0]) != 0 or int(groups[-1]) > k or (
            np.diff(groups) < 0
        ).any():
            raise ProtocolError(f"result for stream {s} has bad group starts")
        lo, hi = int(groups[self.rank]), int(groups[self.rank + 1])
        nb = self.layout.num_blocks
        short_tail = self.layout.tail_length != self.layout.block_size
        if k and short_tail and int(cur[-1]) == nb - 1 and int(ids[-1]) != nb - 1:
            raise ProtocolError(f"result for stream {s} does not order the short last block last")
        own = ids[lo:hi]
        where = np.searchsorted(self._ids, own)
        b = self.layout.block_size
        nfull = len(self._sent) // b
        if len(own) and (int(where.max()) >= nfull or not np.array_equal(self._ids[where], own)):
            raise ProtocolError(f"result for stream {s} leaves out blocks that rank {self.rank} did not send in full")
        for part, frame in ((ids[:lo], data[3]), (ids[hi:], data[4])):
            payload = np.frombuffer(buffer_of(frame), dtype=self.dtype.storage)
            if len(payload) != self.layout.payload_elements(part):
                raise ProtocolError(
                    f"result for stream {s} has {len(payload)} elements for {len(part)} blocks, expected "
                    f"{self.layout.payload_elements(part)}"
                )
            if len(part):
                self._scatter(part, payload)
        if len(own) and not self._holds_own:
            # In place, the input already holds them.
            self._scatter(own, self._sent[: nfull * b].reshape(nfull, b)[where].reshape(-1))
        self.stats.blocks_received += k - len(own)
        self.stats.union_blocks += k

    def _scatter(self, ids: np.ndarray, payload: np.ndarray) -> None:
        if self._data is not None:
            self._data.scatter(ids, payload, self.layout)
        else:
            blocks.scatter(self.out, ids, payload, self.layout)

    def _count_sent(self, frames: list[Any], nblocks: int) -> None:
        self.stats.bytes_sent += frames_nbytes(frames)
        self.stats.messages_sent += 1
        self.stats.blocks_sent += nblocks

    def on_result(self, msg: Result, data: list[Any]) -> list[Any] | None:
        """Applies a RESULT; returns the BLOCKS message to send, if this worker has any.

        Raises:
            ProtocolError: the result does not fit the op's state.
        """
        count = msg.stream_count or 1
        width = 5 if self.eager else 2
        if msg.stream + count > self.layout.num_streams or (count > 1 and not self.eager):
            raise ProtocolError(f"result for {count} streams from stream {msg.stream} out of order")
        if len(data) != width * count:
            raise ProtocolError(f"result for {count} streams from stream {msg.stream} with {len(data)} frames; "
                                f"expected {width * count}")
        if msg.batches is not None:
            if len(msg.batches) != self.world_size:
                raise ProtocolError(f"result carries {len(msg.batches)} batch sizes for {self.world_size} ranks")
            self.batches = msg.batches
        self.stats.bytes_received += frames_nbytes(data)
        self.stats.messages_received += 1
        reply = None
        for i in range(count):
            reply = self._on_stream_result(msg.stream + i, msg.round, data[i * width : (i + 1) * width])
        return reply

    def _on_stream_result(self, s: int, rnd: int, data: list[Any]) -> list[Any] | None:
        if (self._cur[s] is None or self.eager) and rnd != 0 or rnd != self._rounds[s]:
            raise ProtocolError(f"result for stream {s} round {rnd} out of order (expected round {self._rounds[s]})")
        if not self.eager and self._cur[s] is not None and len(self._cur[s]) == 0:
            # Taken, it would count a second end of the stream: the op done with another unsummed.
            raise ProtocolError(f"result for stream {s} round {rnd} after the stream finished")
        cols = self.layout.stream_columns(s)
        # Only the instructed (finite) pointers are looked at: a round costs what its
        # blocks do, not what the stream's columns do.
        cur = index_array(data[0])
        try:
            cur_cols = pointer_columns(cur, cols.start, cols.stop - cols.start,
                                       self.layout.num_columns, self.layout.num_blocks)
        except ProtocolError as e:
            raise ProtocolError(f"instruction for stream {s}: {e}") from None
        if self.eager:
            assert self._ids is not None
            # The instruction is the union of the ranks' blocks, so it holds all of ours.
            mine = self._ids[self._bounds[s] : self._bounds[s + 1]]
            if len(mine) == len(cur):
                # Every block of the stream (a dense tensor): one compare, no search per block.
                skipped = not np.array_equal(cur, mine)
            else:
                pos = np.searchsorted(cur, mine)
                skipped = len(mine) > 0 and (int(pos[-1]) >= len(cur) or not np.array_equal(cur[pos], mine))
        else:
            mine = self._mynext[cur_cols]
            skipped = bool((mine < cur).any()) or np.count_nonzero(mine != INF) != self._live[s]
        if skipped:
            raise ProtocolError(f"instruction for stream {s} skips a nonzero block of rank {self.rank}")
        if self.eager:
            self._apply_eager(s, cur, data)
        else:
            # The payload holds the sums of the previous instruction's blocks.
            ids = self._cur[s]
            payload = np.frombuffer(buffer_of(data[1]), dtype=self.dtype.storage)
            if ids is not None:
                if len(payload) != self.layout.payload_elements(ids):
                    raise ProtocolError(f"result for stream {s} has {len(payload)} elements, expected "
                                        f"{self.layout.payload_elements(ids)}")
                self._scatter(ids, payload)
                self.stats.blocks_received += len(ids)
                self.stats.union_blocks += len(ids)
            elif len(payload):
                raise ProtocolError("round 0 result carries data")
        self._cur[s] = cur
        self._rounds[s] += 1
        self.stats.rounds = max(self.stats.rounds, self._rounds[s])
        if self.eager or len(cur) == 0:
            self._left -= 1
            return None
        sel = np.flatnonzero(mine == cur)
        if len(sel) == 0:
            return None
        ids = cur[sel]
        abs_cols = cur_cols[sel]
        assert self._table is not None
        after = self._table[ids // self.layout.num_columns + 1, abs_cols]
        self._mynext[abs_cols] = after
        self._live[s] -= int(np.count_nonzero(after == INF))
        frames = encode(Blocks(self.job, self.rank, self.op, s, rnd), after, self._payload(ids))
        self._count_sent(frames, len(ids))
        return frames
