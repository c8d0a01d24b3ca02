"""Block detection, gather and scatter on the CPU, all vectorised.

These are the data-path primitives both sides share: the nonzero-block mask of
a flat tensor, the per-column "next nonzero block" table that drives the
protocol, and the gather/scatter of a set of blocks to and from a payload in
which the short last block (if any) is stored short.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from omnireduce import config, kernels
from omnireduce.errors import ConfigError
from omnireduce.layout import INF, Layout

logger = logging.getLogger(__name__)

__all__ = [
    "block_mask",
    "block_mask_numpy",
    "warm",
    "warm_dtype",
    "warm_next_table",
    "next_table",
    "next_table_numpy",
    "split_payload",
    "gather",
    "scatter",
    "add_rows",
    "contiguous_start",
]

# From this many elements on, the serial Numba kernel computes the mask.
# Measured on the 2-core development machine (bench/kernels.py, and interleaved
# loops of numpy / serial / parallel, float32, blocks of 256): the serial kernel
# is as fast as NumPy on sparse tensors (within noise from 256 KB to 256 MB) and
# 2-3x faster on dense ones (it stops reading a block at its first nonzero
# chunk). The parallel kernel was up to 2x faster again on an idle machine but
# 5-20x slower than NumPy at 4-16 MB while the cores were busy (load 9 on 2
# cores: a parallel region waits for its slowest thread), which is the normal
# state of a training node, so it is not the default. Compaction goes the other
# way: np.flatnonzero + np.take (gather below) matched or beat the Numba
# gather at every size, so gather and scatter stay NumPy. Below it no Numba
# kernel runs for a tensor (nothing for warm() to compile).
NUMBA_MIN_ELEMENTS = 1 << 16
# Below this a pass takes tens of microseconds: waking numba's threads would cost more.
_PARALLEL_MIN_BYTES = 4 << 20
# From this many elements added on, add_rows calls the Numba kernel (below it the
# call's overhead is more than NumPy's extra passes cost).
_ADD_ROWS_NUMBA_MIN = 1 << 12
# From this many blocks on, next_table is one Numba pass (100 MB of 256-element
# blocks: 0.1 ms instead of 1.3-1.7 ms for NumPy's arange, where, full and accumulate).
_NEXT_TABLE_NUMBA_MIN = 1 << 12


def block_mask_numpy(flat: np.ndarray, block_size: int, threshold: float = 0.0) -> np.ndarray:
    """Reference nonzero-block mask in NumPy (see :func:`block_mask`)."""
    n = flat.shape[0]
    nb = -(-n // block_size)
    out = np.empty(nb, dtype=np.bool_)
    info = kernels.bits_info(flat.dtype, integers=True)
    thr = kernels.threshold_bits(threshold, info)
    if n == 0:
        return out
    # Comparing the bits without the sign makes -0.0 zero and NaN nonzero, for
    # bfloat16 bit patterns too; for non-negative floats the order of the bit
    # patterns is the order of the values, so the threshold is one comparison.
    # An integer's sign_mask keeps every bit: its most negative value is the sign bit alone.
    bits = flat.view(info.uint)
    sign_mask = info.uint.type(info.sign_mask)
    nfull = n // block_size
    if nfull:
        full = bits[: nfull * block_size].reshape(nfull, block_size) & sign_mask
        out[:nfull] = (full > thr).any(1) if thr else (full != 0).any(1)
    if nfull < nb:
        out[nfull] = bool(((bits[nfull * block_size :] & sign_mask) > thr).any())
    if thr:
        # As OmniReduce's kernel: blocks below the threshold are zeroed in place.
        if not flat.flags.writeable:
            raise ConfigError("a positive threshold zeroes skipped blocks in place: flat must be writeable")
        zero = np.flatnonzero(~out[:nfull])
        bits[: nfull * block_size].reshape(nfull, block_size)[zero] = 0
        if nfull < nb and not out[nfull]:
            bits[nfull * block_size :] = 0
    return out


def block_mask(flat: np.ndarray, block_size: int, threshold: float = 0.0) -> np.ndarray:
    """Nonzero-block mask of a flat tensor.

    A block is nonzero when any element has ``|x| > threshold`` (the threshold
    rounded to the element type), or is NaN or Inf; a block of 0.0 and -0.0 is
    zero. A block of integers is zero when all its elements are 0. The last block
    may be short.

    Args:
        flat: contiguous 1-D float array (bfloat16 as uint16 bits) or integer
            array (int8, uint8, int16, int32, int64).
        block_size: elements per block.
        threshold: finite and >= 0; when positive, the blocks found zero are
            zeroed in place in ``flat`` (as OmniReduce's kernel does), so ``flat``
            must be writeable. Integers take 0 only (their sums are exact).

    Returns:
        A bool array of ``ceil(len(flat) / block_size)`` entries.

    Raises:
        ConfigError: bad threshold or dtype.
    """
    if kernels.HAVE_NUMBA and flat.shape[0] >= NUMBA_MIN_ELEMENTS:
        threads = config.mask_threads() if flat.nbytes >= _PARALLEL_MIN_BYTES else 1
        return kernels.block_mask_cpu(flat, block_size, threshold, parallel=threads)
    return block_mask_numpy(flat, block_size, threshold)


# The kinds of tensor whose mask kernels warm() compiled in this process, and whether next_table's was.
_warmed: set[tuple[str, bool, bool, bool]] = set()
_table_warmed = False
_warm_lock = threading.Lock()


def warm(flat: np.ndarray, block_size: int) -> None:
    """Compiles, in the calling thread, the Numba kernels that :func:`block_mask` and
    :func:`next_table` will run on ``flat`` (or loads them from Numba's cache).

    A kernel compiles on its first call for a kind of array: a second or two on an idle
    machine, several on a loaded one. A worker's op runs these on its communication
    thread, which answers no heartbeat meanwhile, so the aggregator counted a worker
    whose first op compiled for longer than its heartbeat timeout as lost. The thread
    that submits the op calls this first. Only the first call per kind of tensor
    (element type, alignment, writeability, parallel pass) does any work.
    """
    if not kernels.HAVE_NUMBA or flat.ndim != 1 or flat.shape[0] < NUMBA_MIN_ELEMENTS:
        return
    threads = config.mask_threads() if flat.nbytes >= _PARALLEL_MIN_BYTES else 1
    _warm(flat.dtype, block_size, flat.ctypes.data % 8 == 0, bool(flat.flags.writeable), threads)
    warm_next_table(-(-flat.shape[0] // block_size))


def warm_next_table(num_blocks: int) -> None:
    """:func:`warm` for :func:`next_table` alone, of an op of ``num_blocks`` blocks whose
    mask comes from elsewhere (a device tensor's)."""
    global _table_warmed
    if kernels.HAVE_NUMBA and num_blocks >= _NEXT_TABLE_NUMBA_MIN and not _table_warmed:
        with _warm_lock:
            if not _table_warmed:
                kernels.next_table_cpu(np.ones(4, np.bool_), 2)
                _table_warmed = True


def warm_dtype(dtype: np.dtype, block_size: int) -> None:
    """:func:`warm` for every aligned, writeable flat tensor of ``dtype``, whatever its size.

    For a thread that submits ops whose size it does not know yet, but whose op may then
    be submitted from the communication thread (an all_to_all's chunks, sized by the
    answer of a first op).
    """
    if kernels.HAVE_NUMBA:
        for t in {1, config.mask_threads()}:
            _warm(np.dtype(dtype), block_size, True, True, t)
        warm_next_table(_NEXT_TABLE_NUMBA_MIN)


def _warm(dtype: np.dtype, block_size: int, aligned: bool, writeable: bool, threads: int) -> None:
    """Compiles block_mask_cpu's kernels for one kind of tensor, once per process."""
    # block_mask_cpu's word-wise pass needs 8-byte blocks and an 8-byte aligned start.
    words = (block_size * dtype.itemsize) % 8 == 0 and aligned
    key = (dtype.str, words, writeable, threads > 1)
    if key in _warmed:
        return
    with _warm_lock:
        if key in _warmed:
            return
        # Two full blocks and a short one (the tail's own kernel), aligned as asked.
        n = 2 * block_size + 1
        sample = np.zeros(n + 8, dtype)
        skips = [i for i in range(8) if ((sample.ctypes.data + i * dtype.itemsize) % 8 == 0) == aligned]
        sample = sample[skips[0] if skips else 0 :][:n]
        sample.flags.writeable = writeable
        kernels.block_mask_cpu(sample, block_size, parallel=threads)
        _warmed.add(key)


def next_table(mask: np.ndarray, layout: Layout) -> np.ndarray:
    """For every row and column, the first nonzero block at or below that row.

    Args:
        mask: the nonzero-block mask (``layout.num_blocks`` entries).
        layout: the op's layout.

    Returns:
        An int64 array of shape ``(rows + 1, num_columns)``: entry ``[r, c]`` is the
        smallest nonzero block index ``r' * C + c`` with ``r' >= r``, or INF. The
        extra last row is all INF so that "the block after row r" is ``[r + 1, c]``.
    """
    c = layout.num_columns
    nb = layout.num_blocks
    if len(mask) != nb:
        raise ConfigError(f"mask has {len(mask)} entries for {nb} blocks")
    if kernels.HAVE_NUMBA and c and nb >= _NEXT_TABLE_NUMBA_MIN:
        return kernels.next_table_cpu(mask, c)
    return next_table_numpy(mask, layout)


def next_table_numpy(mask: np.ndarray, layout: Layout) -> np.ndarray:
    """Reference :func:`next_table` in NumPy."""
    c = layout.num_columns
    nb = layout.num_blocks
    if c == 0:
        return np.full((1, 0), INF, dtype=np.int64)
    rows = -(-nb // c)
    table = np.full((rows + 1) * c, INF, dtype=np.int64)
    ids = np.arange(nb, dtype=np.int64)
    table[:nb] = np.where(mask, ids, INF)
    table = table.reshape(rows + 1, c)
    # A running minimum from the bottom row up gives each row its next nonzero block.
    np.minimum.accumulate(table[::-1], axis=0, out=table[::-1])
    return table


def split_payload(payload: np.ndarray, ids: np.ndarray, layout: Layout) -> list[tuple[slice, np.ndarray]]:
    """Views of a payload as 2-D runs of blocks.

    Args:
        payload: the flat elements of blocks ``ids``, in that order, the short
            last block (if among them) stored short.
        ids: the block indices carried, in payload order.
        layout: the op's layout.

    Returns:
        Up to three ``(slice of ids, view)`` pairs covering the payload; each view
        is 2-D ``(k, width)``, width ``block_size`` or, for the short block, its length.
    """
    b = layout.block_size
    tl = layout.tail_length
    n = len(ids)
    if n == 0:
        return []
    if tl == b:
        return [(slice(0, n), payload.reshape(n, b))]
    hits = np.flatnonzero(ids == layout.num_blocks - 1)
    if len(hits) == 0:
        return [(slice(0, n), payload.reshape(n, b))]
    p = int(hits[0])
    parts = []
    if p:
        parts.append((slice(0, p), payload[: p * b].reshape(p, b)))
    parts.append((slice(p, p + 1), payload[p * b : p * b + tl].reshape(1, tl)))
    if p + 1 < n:
        parts.append((slice(p + 1, n), payload[p * b + tl :].reshape(n - p - 1, b)))
    return parts


def _full_and_tail(flat: np.ndarray, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    b = layout.block_size
    nfull = layout.length // b
    return flat[: nfull * b].reshape(nfull, b), flat[nfull * b :]


def contiguous_start(ids: np.ndarray) -> int | None:
    """The first block of ``ids`` when they are consecutive ascending blocks, else None.

    A stream whose columns are all active in one row asks for such a run (every
    round of a dense tensor does): its payload is then one slice of the tensor.
    """
    n = len(ids)
    if n == 0:
        return None
    first = int(ids[0])
    if int(ids[-1]) - first != n - 1:
        return None
    if n > 2 and not bool((ids[1:] - ids[:-1] == 1).all()):
        return None
    return first


def gather(flat: np.ndarray, ids: np.ndarray, layout: Layout, copy: bool = True) -> np.ndarray:
    """The blocks ``ids`` of ``flat`` as one contiguous payload, in ``ids`` order.

    Args:
        flat: the flat tensor.
        ids: block indices.
        layout: the op's layout.
        copy: False returns a view of ``flat`` instead of a copy where the blocks
            are consecutive; the caller must then keep ``flat`` unchanged while the
            payload is in use (a zero-copy send).
    """
    if not copy:
        first = contiguous_start(ids)
        if first is not None:
            start = first * layout.block_size
            return flat[start : start + layout.payload_elements(ids)]
    out = np.empty(layout.payload_elements(ids), dtype=flat.dtype)
    full, tail = _full_and_tail(flat, layout)
    for sl, view in split_payload(out, ids, layout):
        if view.shape[1] == layout.block_size:
            # mode="clip" avoids the extra buffer np.take makes for mode="raise";
            # the ids were validated by whoever produced them.
            np.take(full, ids[sl], axis=0, out=view, mode="clip")
        else:
            view[0] = tail
    return out


def scatter(flat: np.ndarray, ids: np.ndarray, payload: np.ndarray, layout: Layout) -> None:
    """Writes the blocks of ``payload`` into ``flat`` at block indices ``ids``."""
    first = contiguous_start(ids)
    if first is not None:
        # One memcpy instead of a fancy-indexed row copy: the dense case.
        start = first * layout.block_size
        flat[start : start + len(payload)] = payload
        return
    full, tail = _full_and_tail(flat, layout)
    for sl, view in split_payload(payload, ids, layout):
        if view.shape[1] == layout.block_size:
            full[ids[sl]] = view
        else:
            tail[:] = view[0]


def add_rows(acc: np.ndarray, rows: np.ndarray, vals: np.ndarray) -> None:
    """Adds each row of ``vals`` into row ``rows[i]`` of ``acc`` (its first ``vals.shape[1]`` columns).

    The aggregator's sum of a round in which the ranks sent different blocks.
    ``rows`` must be distinct (a rank sends a block once per round).
    """
    if kernels.HAVE_NUMBA and vals.size >= _ADD_ROWS_NUMBA_MIN and acc.dtype == vals.dtype:
        kernels.add_rows_cpu(acc, rows, vals)
    elif vals.shape[1] == acc.shape[1]:
        acc[rows] += vals
    else:
        acc[rows, : vals.shape[1]] += vals
