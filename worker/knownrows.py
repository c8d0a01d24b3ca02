"""Dense tensors whose nonzero rows the caller knows: rows in, no mask pass, a dense sum out.

A model whose embedding gradients are dense (``nn.Embedding(sparse=False)``) still
knows which rows a step touched: the ids it looked up. ``allreduce(x, rows=ids)``
takes that set instead of scanning the tensor for it: each listed row of ``x`` is
one block (as in :mod:`worker.rows`), only those rows are read and sent, and the
union of every rank's rows comes back summed into a dense result of ``x``'s type
and shape, or into ``x`` itself (``inplace=True``) or ``out``. The op costs what
its rows do, not what the whole tensor does.

The caller's promise is that the rows not listed are zero: they are not read, so a
nonzero value there is left out of the sum. In a new result (or ``out``) every row
outside the union is zero; in place, such rows are not written at all.

In place (and into ``out``), sums are written as they arrive: an op that fails leaves
``x`` partly summed, as after a failed in-place gloo allreduce, and on a sharded worker
the other shards' parts may still write their rows after the call has raised (the op
fails at its first failed part). Do not reuse ``x`` after a failure before the worker
is closed.

``allreduce(coo, dense=True)`` is the same for a sparse tensor (:func:`dense_sum_of`): its
rows are sent as they are, and the sums land in a dense result instead of a sparse one.

On a sharded worker the rows are dealt round-robin as a sparse tensor's are (row
``r`` to the op's part ``r % P`` of ``P``, the parts going to the shards in turn).
Each part reads and writes its rows through a strided view of the tensor (every
``P``-th row), so the shards' sums land straight in the result, with no join. A
tensor that is not contiguous is copied first (as any allreduce input is).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from omnireduce import blocks
from omnireduce.dtypes import DType
from omnireduce.errors import ConfigError
from omnireduce.layout import Layout
from worker.op import check_destination, check_out, sparse_result
from worker.rows import RowBlocks, SparseRows, deal_order, is_rows
from worker.tensors import is_torch, shares_memory, to_flat

__all__ = ["KnownRows", "KnownRowsOpData", "as_known", "dense_sum_of", "known_rows"]


class KnownRows:
    """Rows of a dense tensor to sum (the caller's nonzero rows) and where their sums go.

    Built by :func:`known_rows`; :meth:`deal` makes a sharded op's parts. Internal to
    the workers: callers pass ``rows=`` to ``allreduce``.

    Args:
        source: the tensor's rows, ``(num_rows, width)``, a view of the input.
        dest: where the sums go, ``(num_rows, width)``: the input itself in place.
        rows: the rows to send: int64, strictly increasing, within ``num_rows``.
        dtype: the wire type.
        holds_own: ``dest`` already holds this rank's rows (in place): a row that only
            this rank sent sums to itself and need not be written.
        result: the caller's result once every part is summed into ``dest``: the input
            itself in place, else the dense sum in the input's type and shape (None for a
            sharded op's part).
        written: where the rows written are recorded (see :meth:`union`); None: not recorded.
        stride: a part's row ``i`` is the tensor's row ``i * stride + phase``.
        phase: see ``stride``.
        compact: ``source`` holds only the given rows, in order (a sparse tensor's values),
            not every row of the tensor.
    """

    __slots__ = ("source", "dest", "rows", "dtype", "holds_own", "result", "written", "stride", "phase",
                 "compact")

    def __init__(self, source: np.ndarray, dest: np.ndarray, rows: np.ndarray, dtype: DType, holds_own: bool,
                 result: Any = None, written: list[np.ndarray] | None = None, stride: int = 1,
                 phase: int = 0, compact: bool = False) -> None:
        self.source = source
        self.dest = dest
        self.rows = rows
        self.dtype = dtype
        self.holds_own = holds_own
        self.result = result
        self.written = written
        self.stride = stride
        self.phase = phase
        self.compact = compact

    def record(self, ids: np.ndarray) -> None:
        """Notes that the sums of this part's rows ``ids`` were written (when recording)."""
        if self.written is not None:
            self.written.append(ids * self.stride + self.phase if self.stride != 1 else ids)

    def union(self) -> np.ndarray:
        """The rows of the op's union (every rank's rows), ascending, once it completed: the rows
        written and this rank's own. Needs ``written`` (:func:`known_rows` with ``record=True``)."""
        if self.written is None:
            raise ValueError("the rows written were not recorded (known_rows(..., record=True))")
        return np.unique(np.concatenate([self.rows, *self.written]))

    @property
    def num_rows(self) -> int:
        return int(self.dest.shape[0])

    @property
    def width(self) -> int:
        return int(self.dest.shape[1])

    @property
    def nbytes(self) -> int:
        """The dense tensor's bytes (what a sharded worker sizes an op from)."""
        return self.num_rows * self.width * self.dtype.itemsize

    def deal(self, parts: int) -> list[KnownRows]:
        """The rows dealt round-robin: row ``r`` becomes row ``r // parts`` of part ``r % parts``.

        Each part reads and writes every ``parts``-th row of the tensor through a
        strided view, so nothing is copied here and nothing is joined afterwards.
        """
        if parts == 1:
            return [self]
        order, edges, local = deal_order(self.rows, parts)
        # A compact source (a sparse tensor's values) is dealt as its rows are: one copy.
        values = self.source.take(order, axis=0) if self.compact else None
        return [
            KnownRows(values[edges[k]: edges[k + 1]] if values is not None else self.source[k::parts],
                      self.dest[k::parts], local[edges[k]: edges[k + 1]], self.dtype, self.holds_own,
                      written=self.written, stride=self.stride * parts, phase=self.phase + k * self.stride,
                      compact=self.compact)
            for k in range(parts)
        ]


def known_rows(x: Any, rows: Any, inplace: bool = False, out: np.ndarray | None = None,
               world_size: int = 2, record: bool = False) -> KnownRows:
    """Checks an allreduce of ``x`` with its nonzero ``rows`` and sets up where the sum goes.

    Args:
        x: a NumPy array or a CPU torch tensor of at least one dimension, of a
            supported dtype; its rows are its first dimension.
        rows: the indices of ``x``'s rows that may be nonzero: a 1-D integer NumPy
            array, torch tensor or sequence, in any order, repeats allowed.
        inplace: write the sum into ``x`` (a contiguous, writeable tensor).
        out: a zero-filled, writeable, flat NumPy array of ``x``'s length and storage
            type to write the sum into.
        world_size: the op's workers (sizes a new result's lazily zeroed pages).
        record: record the rows written, for :meth:`KnownRows.union`.

    Raises:
        ConfigError: ``x`` or ``rows`` are not supported, a row is out of range, or
            ``inplace``/``out`` do not fit ``x``.
    """
    if isinstance(x, SparseRows) or (is_torch(x) and x.is_sparse):
        raise ConfigError("rows= is for dense tensors; a sparse tensor's rows are its indices already")
    flat, dtype, restore = to_flat(x)
    shape = tuple(x.shape) if hasattr(x, "shape") else ()
    if len(shape) < 1:
        raise ConfigError("rows= needs a tensor of at least one dimension (its rows are the first)")
    check_destination(flat, dtype, inplace, out)
    if inplace and not shares_memory(x, flat):
        raise ConfigError("an in-place allreduce needs a contiguous tensor (this one would be copied)")
    num_rows = shape[0]
    width = math.prod(shape[1:])
    if width == 0:
        # As SparseRows: a row is a block, and a block of no elements has no layout.
        raise ConfigError(f"rows= needs rows of at least one element, got a tensor of shape {shape}")
    ids = _row_ids(rows, num_rows)
    source = flat.reshape(num_rows, width)
    log: list[np.ndarray] | None = [] if record else None
    if inplace:
        return KnownRows(source, source, ids, dtype, True, x, written=log)
    if out is None:
        out = sparse_result(len(flat), dtype, len(ids) / num_rows if num_rows else 0.0, world_size, width)
    return KnownRows(source, out.reshape(num_rows, width), ids, dtype, False, restore(out), written=log)


def dense_sum_of(x: Any, out: np.ndarray | None = None, world_size: int = 2) -> KnownRows:
    """An allreduce of sparse rows (a sparse COO tensor, :class:`worker.rows.SparseRows`) whose
    sum is wanted dense: ``allreduce(x, dense=True)``. The rows are sent as they are; the
    sums land in a dense result of the tensor's shape (a torch tensor for a torch input),
    with no sparse result built first.

    Args:
        x: the sparse tensor.
        out: a zero-filled, writeable, flat NumPy array of the dense tensor's length and
            storage type to write the sum into.
        world_size: the op's workers (sizes a new result's lazily zeroed pages).

    Raises:
        ConfigError: ``x`` is not supported as rows, or ``out`` does not fit.
    """
    from worker.tensors import from_storage

    sr = x if isinstance(x, SparseRows) else SparseRows.from_torch(x)
    assert sr.dtype is not None  # set by SparseRows
    width = sr.row_width
    values = np.ascontiguousarray(sr.values).reshape(len(sr.rows), width)
    length = sr.num_rows * width
    check_out(out, length, sr.dtype)
    if out is None:
        out = sparse_result(length, sr.dtype, len(sr.rows) / sr.num_rows if sr.num_rows else 0.0, world_size, width)
    shape = sr.dense_shape
    result = from_storage(out, sr.dtype).reshape(shape) if is_torch(x) else out.reshape(shape)
    return KnownRows(values, out.reshape(sr.num_rows, width), sr.rows, sr.dtype, False, result, compact=True)


def as_known(x: Any, rows: Any, dense: bool, inplace: bool, out: Any, world_size: int) -> KnownRows | None:
    """The :class:`KnownRows` of an allreduce asked with ``rows=`` (:func:`known_rows`) or
    ``dense=True`` (:func:`dense_sum_of`), or None when neither was asked (or ``x`` is one already).

    Raises:
        ConfigError: the request does not fit ``x`` (``dense=True`` of a dense tensor, or with
            ``rows=`` or ``inplace``; see the functions for the rest).
    """
    if isinstance(x, KnownRows) or (rows is None and not dense):
        return None
    if not dense:
        return known_rows(x, rows, inplace, out, world_size)
    if not is_rows(x):
        raise ConfigError("dense=True is for sparse tensors (a dense tensor's sum is dense already)")
    if rows is not None or inplace:
        raise ConfigError("dense=True takes neither rows= (a sparse tensor's rows are its indices) nor inplace "
                          "(the dense sum is new; out= gives its memory)")
    return dense_sum_of(x, out, world_size)


def _row_ids(rows: Any, num_rows: int) -> np.ndarray:
    """``rows`` as int64 row indices, strictly increasing (sorted, repeats dropped), checked against ``num_rows``."""
    if is_torch(rows):
        if rows.device.type != "cpu" or rows.is_sparse:
            raise ConfigError(f"rows= must be a dense CPU tensor of indices, got a {rows.layout} one on {rows.device}")
        rows = rows.detach().numpy()
    arr = np.asarray(rows)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ConfigError(f"rows= must be a 1-D array of integer row indices, got shape {arr.shape} of {arr.dtype}")
    if arr.size and arr.dtype.kind == "u" and int(arr.max()) >= num_rows:
        # Before the cast to int64, which would wrap ids of 2**63 and more to negative ones.
        raise ConfigError(f"rows= holds row {int(arr.max())}, outside the tensor's {num_rows} rows")
    ids = arr.astype(np.int64, copy=False)
    if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        ids = np.unique(ids)  # sorted already (as the DDP hook's are): no sort
    if len(ids) and (int(ids[0]) < 0 or int(ids[-1]) >= num_rows):
        bad = int(ids[0]) if int(ids[0]) < 0 else int(ids[-1])
        raise ConfigError(f"rows= holds row {bad}, outside the tensor's {num_rows} rows")
    return ids


class KnownRowsOpData(RowBlocks):
    """The data path of an allreduce of :class:`KnownRows` (see :class:`worker.rows.RowsOpData`,
    whose interface it shares): the given rows are the blocks, read from the tensor and
    summed into the destination.

    Args:
        x: the rows and their destination.
    """

    out = None  # the sums are written into x.dest by scatter(), not into an array of the op

    def __init__(self, x: KnownRows) -> None:
        self.x = x
        self.dtype: DType = x.dtype
        self.block_size = x.width
        self.length = x.num_rows * x.width
        #: The destination holds this rank's rows already: its own blocks are not written back.
        self.holds_own = x.holds_own

    def gather(self, ids: np.ndarray, layout: Layout) -> np.ndarray:
        """The rows ``ids`` as one payload: a view of the tensor where they are consecutive rows of
        contiguous memory (the caller leaves the input alone until the op completes), else a copy."""
        if self.x.compact:
            ids = np.searchsorted(self.x.rows, ids)  # where they are among the values
        first = blocks.contiguous_start(ids)
        if first is not None and self.x.source.flags.c_contiguous:
            return self.x.source[first : first + len(ids)].reshape(-1)
        # Indexing, not take(): take() of a strided view (a shard's part) copies the whole view first.
        return self.x.source[ids].reshape(-1)

    def scatter(self, ids: np.ndarray, payload: np.ndarray, layout: Layout) -> None:
        self.x.dest[ids] = payload.reshape(len(ids), self.block_size)
        self.x.record(ids)

    def restore(self, _out: Any) -> Any:
        """The caller's result (see :class:`KnownRows`); None for a sharded op's part."""
        return self.x.result
