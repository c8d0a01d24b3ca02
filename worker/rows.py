"""Row-sparse tensors: the caller says which rows are nonzero, and each row is a block.

An embedding's gradient (``nn.Embedding(sparse=True)``) is a sparse COO tensor
whose nonzero rows are exactly the rows the step looked up. OmniReduce cuts a
tensor into blocks and sends only the nonzero ones; for such a tensor the rows
*are* the blocks, so no pass over a dense tensor is needed to find them. An op
of :class:`SparseRows` lays the tensor out with one row per block (block size =
row width): its mask is the given rows, its payload the given values, and the
aggregator streams back the sums of the union of every worker's rows, which
become the result's rows. The result holds exactly the rows some worker gave
(as gloo's sparse allreduce, rows that sum to zero included).

:class:`SparseRows` is the NumPy form; torch's sparse COO tensors convert to it
(:meth:`SparseRows.from_torch`) and back (:meth:`SparseRows.to_torch`), so
``Worker.allreduce`` of a sparse tensor returns a coalesced sparse tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from omnireduce import blocks
from omnireduce.dtypes import DType
from omnireduce.errors import ConfigError
from omnireduce.layout import Layout
from worker.tensors import from_storage, is_torch, to_flat

__all__ = [
    "ROWS_MESSAGE_BYTES", "RowBlocks", "SparseRows", "RowsOpData", "deal_order", "is_rows", "is_sparse_torch",
    "rows_layout", "rows_op_data",
]

#: Payload bytes a rows op's message carries at most (the aggregator refuses frames over
#: 64 MiB by default); fewer, larger messages cut the fixed cost of a sparse op.
ROWS_MESSAGE_BYTES = 32 << 20
#: Most streams of a rows op: the aggregator's default ``--max-streams``.
ROWS_MAX_STREAMS = 1024


def is_sparse_torch(x: Any) -> bool:
    """Whether ``x`` is a sparse COO torch tensor; does not import torch."""
    return is_torch(x) and bool(x.is_sparse)


@dataclass(frozen=True, slots=True)
class SparseRows:
    """A tensor of ``num_rows`` rows of which only ``rows`` are stored (the others are zero).

    Args:
        rows: the stored rows' indices: int64, strictly increasing, in ``[0, num_rows)``.
        values: the stored rows, shape ``(len(rows), *row_shape)``, a supported dtype.
        num_rows: the tensor's number of rows.
        shape: the dense tensor's shape; default ``(num_rows, *row_shape)``. A torch
            tensor with several sparse dimensions keeps them here (its rows are then
            the flattened sparse indices).
        dtype: the values' wire type; default the one of ``values.dtype``. Needed for
            bfloat16 only, whose values are stored as their uint16 bits.
    """

    rows: np.ndarray
    values: np.ndarray
    num_rows: int
    shape: tuple[int, ...] | None = None
    dtype: DType | None = None

    def __post_init__(self) -> None:
        rows, values = self.rows, self.values
        if not isinstance(rows, np.ndarray) or rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise ConfigError("SparseRows.rows must be a 1-D integer array")
        if not isinstance(values, np.ndarray) or values.ndim < 1 or len(values) != len(rows):
            raise ConfigError(f"SparseRows.values must be an array of {len(rows)} rows, one per index")
        if isinstance(self.num_rows, bool) or not isinstance(self.num_rows, (int, np.integer)) or self.num_rows < 0:
            raise ConfigError(f"SparseRows.num_rows must be a non-negative integer, got {self.num_rows!r}")
        # A Python int: a NumPy one would overflow in the layout's arithmetic.
        object.__setattr__(self, "num_rows", int(self.num_rows))
        if self.shape is not None:
            if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in self.shape):
                raise ConfigError(f"SparseRows.shape must be non-negative integers, got {self.shape!r}")
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype is not None and not isinstance(self.dtype, DType):
            raise ConfigError(f"SparseRows.dtype must be an omnireduce DType, got {self.dtype!r}")
        if len(rows) and (int(rows[0]) < 0 or int(rows[-1]) >= self.num_rows):
            raise ConfigError(f"SparseRows.rows must lie in [0, {self.num_rows})")
        if len(rows) > 1 and not bool((rows[1:] > rows[:-1]).all()):
            raise ConfigError("SparseRows.rows must be strictly increasing (coalesced)")
        if self.row_width == 0:
            raise ConfigError("SparseRows with empty rows (a zero-sized row shape) are not supported")
        shape = self.dense_shape
        if math.prod(shape) != self.num_rows * self.row_width:
            raise ConfigError(f"SparseRows.shape {shape} does not hold {self.num_rows} rows of {self.row_width}")
        if self.dtype is None:
            try:
                object.__setattr__(self, "dtype", DType.of_numpy(values.dtype))
            except KeyError:
                raise ConfigError(f"allreduce does not support rows of dtype {values.dtype}") from None
        elif values.dtype != np.dtype(self.dtype.storage):
            raise ConfigError(f"rows of {self.dtype.name} must be stored as {self.dtype.storage}, got {values.dtype}")
        object.__setattr__(self, "rows", rows.astype(np.int64, copy=False))

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[1:])

    @property
    def row_width(self) -> int:
        """Elements per row: the op's block size."""
        return math.prod(self.row_shape)

    @property
    def dense_shape(self) -> tuple[int, ...]:
        return self.shape if self.shape is not None else (self.num_rows, *self.row_shape)

    def to_dense(self) -> np.ndarray:
        """The dense array (zeros where no row is stored)."""
        out = np.zeros((self.num_rows, *self.row_shape), dtype=self.values.dtype)
        out[self.rows] = self.values
        return out.reshape(self.dense_shape)

    def slice_rows(self, lo: int, hi: int) -> SparseRows:
        """Rows ``[lo, hi)``, renumbered from 0 (e.g. one table's rows of several joined)."""
        if not 0 <= lo <= hi <= self.num_rows:
            raise ConfigError(f"rows [{lo}, {hi}) are not a range of a tensor of {self.num_rows} rows")
        a, b = np.searchsorted(self.rows, [lo, hi])
        return SparseRows._unchecked(self.rows[a:b] - lo, self.values[a:b], hi - lo, None, self.dtype)

    @staticmethod
    def join(parts: list[SparseRows], offsets: list[int], num_rows: int, shape: tuple[int, ...] | None) -> SparseRows:
        """The chunks ``parts`` (chunk ``k`` starting at row ``offsets[k]``) as one tensor."""
        rows = np.concatenate([p.rows + o for p, o in zip(parts, offsets, strict=True)])
        values = np.concatenate([p.values for p in parts])
        return SparseRows(rows, values, num_rows, shape, parts[0].dtype)

    @classmethod
    def _unchecked(cls, rows: np.ndarray, values: np.ndarray, num_rows: int, shape: tuple[int, ...] | None,
                   dtype: DType | None) -> Any:
        """Rows derived from checked ones by a transformation that keeps them valid (a slice, a
        deal): built without :meth:`__post_init__`'s checks, which cost more than a small op's
        share of the transformation itself."""
        x = object.__new__(cls)
        for name, value in (("rows", rows), ("values", values), ("num_rows", num_rows), ("shape", shape),
                            ("dtype", dtype)):
            object.__setattr__(x, name, value)
        return x

    def deal(self, parts: int, kind: type[SparseRows] | None = None) -> list[Any]:
        """The rows dealt round-robin: row ``r`` becomes row ``r // parts`` of part ``r % parts``.

        A sharded op's chunks. Contiguous ranges would give one shard most of the rows
        of a table whose frequent ids come first (a vocabulary sorted by frequency), and
        its link most of the traffic; dealt rows spread any such skew evenly.

        Args:
            parts: how many parts.
            kind: the parts' class (a subclass of :class:`SparseRows`); default this one's.
        """
        kind = type(self) if kind is None else kind
        if parts == 1:
            return [self if type(self) is kind else kind._unchecked(self.rows, self.values, self.num_rows, None,
                                                                    self.dtype)]
        order, edges, rows = deal_order(self.rows, parts)
        values = self.values.take(order, axis=0)
        # Each part's rows are increasing and within its row count, as this tensor's are.
        return [
            kind._unchecked(rows[edges[k] : edges[k + 1]], values[edges[k] : edges[k + 1]],
                            (self.num_rows - k + parts - 1) // parts, None, self.dtype)
            for k in range(parts)
        ]

    @staticmethod
    def undeal(parts: list[SparseRows], num_rows: int, shape: tuple[int, ...] | None) -> SparseRows:
        """The tensor whose :meth:`deal` into ``len(parts)`` parts gave ``parts``: one copy of the values."""
        n = len(parts)
        if n == 1:
            p = parts[0]
            return SparseRows(p.rows, p.values, num_rows, shape, p.dtype)
        pieces = [(p.rows, p.values) for p in parts]
        return _placed(pieces, [k for k in range(n)], n, num_rows, shape, parts[0])

    @classmethod
    def from_torch(cls, t: Any) -> SparseRows:
        """A sparse COO torch tensor (CPU) as rows: its sparse dimensions flattened into one.

        Returns:
            The rows (values as wire storage: bfloat16 as uint16 bits).

        Raises:
            ConfigError: not a CPU sparse COO tensor of a supported dtype.
        """
        if t.device.type != "cpu":
            raise ConfigError(f"allreduce of a sparse tensor on {t.device} is not supported; move it to the CPU")
        c = t.detach().coalesce()
        k = c.sparse_dim()
        if k < 1:
            raise ConfigError("allreduce of a sparse tensor needs at least one sparse dimension")
        shape = tuple(c.shape)
        idx = c.indices().numpy()
        rows = np.ravel_multi_index(tuple(idx), shape[:k]) if k > 1 else idx[0]
        vals = c.values()
        flat, dtype, _ = to_flat(vals)
        values = flat.reshape(vals.shape) if vals.dim() > 1 else flat.reshape(len(rows), 1)
        return cls(np.asarray(rows, dtype=np.int64), values, math.prod(shape[:k]), shape, dtype)

    def to_torch(self, sparse_dim: int) -> Any:
        """This tensor as a coalesced sparse COO torch tensor of ``sparse_dim`` sparse dimensions."""
        import torch

        shape = self.dense_shape
        if sparse_dim > 1:
            idx = np.stack(np.unravel_index(self.rows, shape[:sparse_dim])) if len(self.rows) else (
                np.empty((sparse_dim, 0), dtype=np.int64))
        else:
            idx = self.rows.reshape(1, -1)
        assert self.dtype is not None  # set by __post_init__
        values = from_storage(np.ascontiguousarray(self.values), self.dtype)
        values = values.reshape(len(self.rows), *shape[sparse_dim:])
        # Built from rows that are sorted and in range by construction: torch need not check them.
        return torch.sparse_coo_tensor(torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)), values, shape,
                                       is_coalesced=True, check_invariants=False)


def _placed(pieces: list[tuple[np.ndarray, np.ndarray]], shard_of: list[int], parts: int, num_rows: int,
            shape: tuple[int, ...] | None, like: SparseRows) -> SparseRows:
    """Dealt pieces of rows joined in row order, in one copy of their values.

    Args:
        pieces: (local row ids, their values) of the parts, in any order.
        shard_of: which part each piece comes from (its local row ``i`` is row ``i * parts + k``).
        parts: how many parts the rows were dealt into.
        num_rows: the joined tensor's row count.
        shape: its dense shape.
        like: a part, for the row shape and the dtypes.
    """
    row_shape = like.row_shape
    if not pieces:
        return SparseRows(np.empty(0, dtype=np.int64), np.empty((0, *row_shape), dtype=like.values.dtype),
                          num_rows, shape, like.dtype)
    rows = np.concatenate([ids * parts + k for (ids, _), k in zip(pieces, shard_of, strict=True)])
    order = np.argsort(rows)
    # Where each piece's rows land in the sorted result.
    place = np.empty_like(order)
    place[order] = np.arange(len(order))
    values = np.empty((len(rows), *row_shape), dtype=like.values.dtype)
    start = 0
    for ids, v in pieces:
        values[place[start : start + len(ids)]] = v.reshape(len(ids), *row_shape)
        start += len(ids)
    return SparseRows(rows[order], values, num_rows, shape, like.dtype)


@dataclass(frozen=True, slots=True)
class ShardChunk(SparseRows):
    """One shard's part of a sharded rows op (see :meth:`SparseRows.deal`); internal to
    :class:`worker.sharded.ShardedWorker`, not for callers of ``allreduce``.

    Its op returns :class:`RowPieces`, the summed rows as they came in, so that the
    sharded worker joins every shard's rows in one copy instead of each shard
    joining its own first.
    """


@dataclass(frozen=True, slots=True)
class RowPieces:
    """A :class:`ShardChunk`'s summed rows, not joined: (row ids, values) as received, the
    pieces disjoint, in any order, and their ids in any order."""

    pieces: list[tuple[np.ndarray, np.ndarray]]
    chunk: ShardChunk

    @staticmethod
    def join(results: list[RowPieces], num_rows: int, shape: tuple[int, ...] | None) -> SparseRows:
        """The whole tensor from every shard's pieces (shard ``k``'s at ``k`` of ``len(results)``)."""
        pieces = [piece for r in results for piece in r.pieces]
        shard_of = [k for k, r in enumerate(results) for _ in r.pieces]
        return _placed(pieces, shard_of, len(results), num_rows, shape, results[0].chunk)


class RowBlocks:
    """What the data paths whose blocks are rows share: ``x.rows`` (of ``x.num_rows``) are the
    nonzero blocks, each ``block_size`` elements, one column per row (:func:`rows_layout`)."""

    x: Any
    block_size: int
    dtype: DType

    @property
    def block_ids(self) -> np.ndarray:
        """The nonzero blocks, ascending: the given rows (one row per block)."""
        return self.x.rows

    @property
    def mask(self) -> np.ndarray:
        mask = np.zeros(self.x.num_rows, dtype=np.bool_)
        mask[self.x.rows] = True
        return mask

    def layout(self) -> Layout:
        """The op's layout (:func:`rows_layout`)."""
        return rows_layout(self.x.num_rows, self.block_size, self.dtype)


class RowsOpData(RowBlocks):
    """The data path of an allreduce of :class:`SparseRows`: where :class:`worker.op.WorkerOp`
    gets its mask and blocks (the given rows) and puts the results (the summed rows).

    Args:
        x: the rows.
        sparse_dim: for a torch tensor's rows, its number of sparse dimensions: the
            result is then a sparse torch tensor again.
    """

    out = None  # the result is built by finish(), not written into an array

    def __init__(self, x: SparseRows, sparse_dim: int | None = None) -> None:
        assert x.dtype is not None  # set by SparseRows
        self.x = x
        self.dtype: DType = x.dtype
        # Set for a torch tensor: the result goes back to one of that many sparse dimensions.
        self.sparse_dim = sparse_dim
        self.block_size = x.row_width
        self.length = x.num_rows * x.row_width
        self._values = np.ascontiguousarray(x.values).reshape(len(x.rows), x.row_width)
        self._ids: list[np.ndarray] = []
        self._payloads: list[np.ndarray] = []

    @property
    def shape(self) -> list[int]:
        """The sparse tensor's shape, which every rank's op must share (``Start.shape``)."""
        return list(self.x.dense_shape)

    def gather(self, ids: np.ndarray, layout: Layout) -> np.ndarray:
        """The rows ``ids`` (all of them stored here) as one payload, a view where they are consecutive."""
        pos = np.searchsorted(self.x.rows, ids)
        first = blocks.contiguous_start(pos)
        if first is not None:
            return self._values[first : first + len(pos)].reshape(-1)
        return self._values.take(pos, axis=0).reshape(-1)

    def scatter(self, ids: np.ndarray, payload: np.ndarray, layout: Layout) -> None:
        # Kept as received (views of the message frames): joined once, in finish().
        self._ids.append(ids)
        self._payloads.append(payload.reshape(len(ids), self.block_size))

    def finish(self) -> SparseRows:
        """The summed rows, in row order."""
        width = self.x.row_shape
        if not self._ids:
            empty = np.empty((0, *width), dtype=self._values.dtype)
            return SparseRows(np.empty(0, dtype=np.int64), empty, self.x.num_rows, self.x.shape, self.dtype)
        parts = list(zip(self._ids, self._payloads, strict=True))
        self._ids, self._payloads = [], []
        ids = np.concatenate([i for i, _ in parts])
        if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
            # Parts that interleave (a rank's own rows, which the aggregator did not send
            # back, among the others): each part's rows go to their places, one copy in all.
            ids = np.sort(ids)
            values = np.empty((len(ids), self.block_size), dtype=self._values.dtype)
            for i, v in parts:
                values[np.searchsorted(ids, i)] = v
        else:
            # Each message's rows come in increasing order and the messages, as they came,
            # cover increasing disjoint ranges: joined in one copy.
            values = np.concatenate([v for _, v in parts])
        return SparseRows(ids, values.reshape(len(ids), *width), self.x.num_rows, self.x.shape, self.dtype)

    def restore(self, _out: Any) -> Any:
        """The result in the input's form: :class:`SparseRows`, or a sparse torch tensor
        (:class:`RowPieces` for a :class:`ShardChunk`)."""
        if isinstance(self.x, ShardChunk):
            pieces = list(zip(self._ids, self._payloads, strict=True))
            self._ids, self._payloads = [], []
            return RowPieces(pieces, self.x)
        result = self.finish()
        return result if self.sparse_dim is None else result.to_torch(self.sparse_dim)


def deal_order(rows: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """How ascending ``rows`` are dealt round-robin: row ``r`` to part ``r % parts``, as its row ``r // parts``.

    Returns:
        ``(order, edges, local)``: the rows grouped by part (``rows[order]``, ascending
        within each part), where each part's run starts (``parts + 1`` offsets), and the
        grouped rows' numbers within their parts.
    """
    shard = rows % parts
    # A stable sort keeps each part's rows ascending (radix on small keys).
    order = np.argsort(shard.astype(np.uint16 if parts <= 1 << 16 else np.int64), kind="stable")
    edges = np.zeros(parts + 1, dtype=np.int64)
    np.cumsum(np.bincount(shard, minlength=parts), out=edges[1:])
    return order, edges, rows[order] // parts


def rows_layout(num_rows: int, width: int, dtype: DType) -> Layout:
    """The layout of an op whose blocks are rows, from the row count and width alone (every rank computes the same).

    One column per row, so the op is eager (every nonzero row moves with the
    START, one round trip whatever the density); as few streams as keep a
    message's payload within :data:`ROWS_MESSAGE_BYTES`, and at most
    :data:`ROWS_MAX_STREAMS`: a table of more rows than that many messages hold
    (an embedding of 100M rows of 128 floats) has longer streams, whose messages
    exceed that size only where a rank sends most rows of one stream's range.
    """
    rows = max(1, num_rows)
    per_message = max(1, ROWS_MESSAGE_BYTES // (width * dtype.itemsize))
    streams = min(-(-rows // per_message), ROWS_MAX_STREAMS)
    return Layout(num_rows * width, width, -(-rows // streams), streams)


def is_rows(x: Any) -> bool:
    """Whether an allreduce of ``x`` sums rows: :class:`SparseRows` or a sparse COO torch tensor."""
    return isinstance(x, SparseRows) or is_sparse_torch(x)


def rows_op_data(x: Any, inplace: bool = False, out: Any = None) -> RowsOpData:
    """The data path of an allreduce of ``x``: :class:`SparseRows` or a sparse COO torch tensor.

    Raises:
        ConfigError: the rows or their dtype are not supported, or ``inplace``/``out``
            asked of them (the sum of rows is new rows).
    """
    if inplace or out is not None:
        raise ConfigError("an allreduce of sparse rows returns new rows: inplace and out are not supported")
    if isinstance(x, SparseRows):
        return RowsOpData(x)
    return RowsOpData(SparseRows.from_torch(x), x.sparse_dim())
