"""Numba CPU kernels: nonzero-block mask, compaction and scatter.

All kernels work on the unsigned-integer view of the data (see
:mod:`omnireduce.kernels.bits`), so one compiled kernel per element width
serves every float type, bfloat16 bit patterns included, and the integer types
(their dtypes are taken as integers here: bfloat16 bits must be uint16).

Payload format (shared with :func:`omnireduce.blocks.gather` and the wire): the
blocks of ``indices`` back to back, each ``block_size`` elements, except that the
short last block of the tensor, if among them, is stored short and must then be
the last entry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from omnireduce.config import PROBE_DENSE
from omnireduce.errors import ConfigError
from omnireduce.kernels.bits import bits_info, check_block_size, threshold_bits
from omnireduce.layout import INF, Layout

logger = logging.getLogger(__name__)

__all__ = [
    "HAVE_NUMBA", "PROBE_DENSE", "block_mask_cpu", "compact_cpu", "scatter_cpu", "add_rows_cpu", "next_table_cpu",
    "payload_length",
]

try:
    from numba import config as numba_config
    from numba import get_num_threads, njit, prange, set_num_threads

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - numba is a dependency; kept importable without it
    HAVE_NUMBA = False

# Elements OR-ed together before testing, so the inner loop vectorises while a
# dense block still exits after its first chunk.
_CHUNK = 64
# The word-wise mask probes every _PROBE_STRIDE-th block's first word and stops at
# the first word of each block when more than PROBE_DENSE (omnireduce.config, shared
# with omnireduce.model's prediction of the mask) of the probes are nonzero.
_PROBE_STRIDE = 64
# Mask entries per prefix-sum chunk: enough work per prange iteration to beat
# the scheduling cost, few enough chunks for the sequential scan between passes.
_SCAN_CHUNK = 1 << 14
# Runs of blocks a threaded mask pass is cut into: 8 per thread at config.MAX_MASK_THREADS.
_MASK_RUNS = 64

if HAVE_NUMBA:

    @njit(cache=True, nogil=True)
    def _block_nonzero(bits, start, end, sign_mask):  # type: ignore[no-untyped-def]
        for j in range(start, end, _CHUNK):
            acc = bits[j] & 0
            for i in range(j, min(j + _CHUNK, end)):
                acc |= bits[i]
            if acc & sign_mask:
                return True
        return False

    @njit(cache=True, nogil=True)
    def _block_above(bits, start, end, sign_mask, thr):  # type: ignore[no-untyped-def]
        # thr > 0 only: a block whose magnitudes are all <= thr is zeroed in
        # place, as OmniReduce's kernel does, so skipped blocks read as zero.
        for j in range(start, end, _CHUNK):
            hit = False
            for i in range(j, min(j + _CHUNK, end)):
                hit |= (bits[i] & sign_mask) > thr
            if hit:
                return True
        for i in range(start, end):
            bits[i] = 0
        return False

    # Each kernel twice, under two names so that numba's cache keeps both: the
    # parallel one, and a serial one that does not collapse when the cores are
    # busy (a parallel region waits for its slowest thread; see block_mask_cpu).

    @njit(parallel=True, cache=True, nogil=True)
    def _mask_bits(bits, block_size, sign_mask, out):  # type: ignore[no-untyped-def]
        n = bits.shape[0]
        for b in prange(out.shape[0]):
            out[b] = _block_nonzero(bits, b * block_size, min((b + 1) * block_size, n), sign_mask)

    @njit(cache=True, nogil=True)
    def _mask_bits_serial(bits, block_size, sign_mask, out):  # type: ignore[no-untyped-def]
        n = bits.shape[0]
        for b in range(out.shape[0]):
            out[b] = _block_nonzero(bits, b * block_size, min((b + 1) * block_size, n), sign_mask)

    @njit(cache=True, nogil=True)
    def _mask_words_range(rows, sign_mask, first, out, b0, b1):  # type: ignore[no-untyped-def]
        # The full blocks as rows of uint64 words, 8 bytes per OR whatever the element
        # type. With ``first`` false every word of every block is read with no early
        # exit: a branch-free stream runs at memory bandwidth at any density, while
        # early exits defeat the prefetcher (stopping at a block's first nonzero chunk
        # took 7.5 ms dense, 9.7 ms at 1% and 15 ms at 10% for 100 MB). With ``first``
        # (mostly nonzero tensors) a block whose first word is nonzero is done after
        # one load: 100 MB dense in 0.9 ms. Each block's loop indexes its own row
        # from 0: with a computed start (``words[b * wpb + i]``) LLVM did not
        # vectorise the loop (numba's negative-index wraparound), 25 ms per 100 MB
        # against 3.8 ms for this form on an EPYC.
        for b in range(b0, b1):
            row = rows[b]
            if first and row[0] & sign_mask:
                out[b] = True
                continue
            acc = np.uint64(0)
            for i in range(row.shape[0]):
                acc |= row[i]
            out[b] = (acc & sign_mask) != 0

    @njit(cache=True, nogil=True)
    def _mask_words(rows, sign_mask, first, out):  # type: ignore[no-untyped-def]
        _mask_words_range(rows, sign_mask, first, out, 0, out.shape[0])

    @njit(parallel=True, cache=True, nogil=True)
    def _mask_words_parallel(rows, sign_mask, first, out):  # type: ignore[no-untyped-def]
        # Contiguous runs of blocks per iteration: each thread streams its own stretch of
        # memory, which is what keeps the serial kernel at bandwidth; several runs per
        # thread (up to MAX_MASK_THREADS), so a thread the OS delays holds up less of the pass.
        nb = out.shape[0]
        chunk = max(1, (nb + _MASK_RUNS - 1) // _MASK_RUNS)
        for c in prange((nb + chunk - 1) // chunk):
            _mask_words_range(rows, sign_mask, first, out, c * chunk, min(nb, (c + 1) * chunk))

    @njit(parallel=True, cache=True, nogil=True)
    def _mask_threshold(bits, block_size, sign_mask, thr, out):  # type: ignore[no-untyped-def]
        n = bits.shape[0]
        for b in prange(out.shape[0]):
            out[b] = _block_above(bits, b * block_size, min((b + 1) * block_size, n), sign_mask, thr)

    @njit(cache=True, nogil=True)
    def _mask_threshold_serial(bits, block_size, sign_mask, thr, out):  # type: ignore[no-untyped-def]
        n = bits.shape[0]
        for b in range(out.shape[0]):
            out[b] = _block_above(bits, b * block_size, min((b + 1) * block_size, n), sign_mask, thr)

    @njit(parallel=True, cache=True, nogil=True)
    def _nonzero_indices(mask, chunk):  # type: ignore[no-untyped-def]
        # Two-pass prefix sum: count per chunk in parallel, scan the few chunk
        # counts, then every chunk writes its indices at its offset in parallel.
        nb = mask.shape[0]
        nchunks = (nb + chunk - 1) // chunk
        counts = np.zeros(nchunks + 1, dtype=np.int64)
        for c in prange(nchunks):
            s = 0
            for b in range(c * chunk, min((c + 1) * chunk, nb)):
                s += mask[b] != 0
            counts[c + 1] = s
        for c in range(nchunks):
            counts[c + 1] += counts[c]
        out = np.empty(counts[nchunks], dtype=np.int64)
        for c in prange(nchunks):
            k = counts[c]
            for b in range(c * chunk, min((c + 1) * chunk, nb)):
                if mask[b] != 0:
                    out[k] = b
                    k += 1
        return out

    @njit(parallel=True, cache=True, nogil=True)
    def _gather_blocks(bits, indices, block_size, out):  # type: ignore[no-untyped-def]
        n = bits.shape[0]
        for p in prange(indices.shape[0]):
            src = indices[p] * block_size
            end = min(src + block_size, n)
            dst = p * block_size
            for i in range(end - src):
                out[dst + i] = bits[src + i]

    @njit(parallel=True, cache=True, nogil=True)
    def _scatter_blocks(out, indices, payload, block_size):  # type: ignore[no-untyped-def]
        n = out.shape[0]
        nb = (n + block_size - 1) // block_size
        pos = np.full(nb, -1, dtype=np.int64)
        for p in prange(indices.shape[0]):
            pos[indices[p]] = p
        for b in prange(nb):
            start = b * block_size
            end = min(start + block_size, n)
            p = pos[b]
            if p < 0:
                for i in range(start, end):
                    out[i] = 0
            else:
                src = p * block_size - start
                for i in range(start, end):
                    out[i] = payload[src + i]

    @njit(cache=True, nogil=True)
    def _add_rows(acc, rows, vals):  # type: ignore[no-untyped-def]
        width = vals.shape[1]
        for i in range(rows.shape[0]):
            r = rows[i]
            for j in range(width):
                acc[r, j] += vals[i, j]


    @njit(cache=True, nogil=True)
    def _next_table(mask, columns, inf, table):  # type: ignore[no-untyped-def]
        rows = table.shape[0] - 1
        nb = mask.shape[0]
        for c in range(columns):
            table[rows, c] = inf
        for r in range(rows - 1, -1, -1):
            base = r * columns
            for c in range(columns):
                b = base + c
                table[r, c] = b if b < nb and mask[b] else table[r + 1, c]


def next_table_cpu(mask: np.ndarray, num_columns: int) -> np.ndarray:
    """:func:`omnireduce.blocks.next_table` in one pass from the bottom row up.

    Args:
        mask: the nonzero-block mask (bool, one entry per block).
        num_columns: columns of the layout (at least 1).

    Returns:
        The int64 table of shape ``(rows + 1, num_columns)``.
    """
    _require_numba()
    rows = -(-mask.shape[0] // num_columns)
    table = np.empty((rows + 1, num_columns), dtype=np.int64)
    _next_table(np.ascontiguousarray(mask, dtype=np.bool_), np.int64(num_columns), INF, table)
    return table


def add_rows_cpu(acc: np.ndarray, rows: np.ndarray, vals: np.ndarray) -> None:
    """``acc[rows[i], :w] += vals[i]`` for every i, in one pass (``w`` = ``vals``' width).

    NumPy's ``acc[rows] += vals`` reads the rows out, adds and writes them back
    (three passes and a temporary); this reads and writes each row once: 2.5x
    faster for a sparse round's sums here (two ranks, 1,640 blocks each, 0.92 ->
    0.37 ms).

    Args:
        acc: C-contiguous 2-D float32/float64 (or int64: sums wrap) array, updated in place.
        rows: row of ``acc`` for each row of ``vals``; distinct, in range (not checked).
        vals: 2-D array of ``acc``'s dtype, at most as wide as ``acc``.

    Raises:
        ConfigError: shapes or dtypes do not fit.
    """
    _require_numba()
    if (
        acc.ndim != 2 or vals.ndim != 2 or not acc.flags.c_contiguous or vals.dtype != acc.dtype
        or vals.shape[1] > acc.shape[1] or rows.shape != (vals.shape[0],)
    ):
        raise ConfigError(f"cannot add rows of shape {vals.shape} ({vals.dtype}) into {acc.shape} ({acc.dtype})")
    _add_rows(acc, np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(vals))


def _require_numba() -> None:
    if not HAVE_NUMBA:
        raise RuntimeError("numba is not installed")


def _flat_bits(flat: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(flat, np.ndarray) or flat.ndim != 1 or not flat.flags.c_contiguous:
        raise ConfigError(f"{what} must be a contiguous 1-D NumPy array")
    return flat.view(bits_info(flat.dtype, integers=True).uint)


def payload_length(indices: np.ndarray, length: int, block_size: int) -> int:
    """Elements of the payload of blocks ``indices`` of a tensor of ``length`` elements.

    Raises:
        ConfigError: an index is out of range, or the short last block is present but not last.
    """
    nb = -(-length // block_size)
    k = len(indices)
    if k == 0:
        return 0
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= nb:
        raise ConfigError(f"block indices must lie in [0, {nb}), got [{lo}, {hi}]")
    layout = Layout(length, block_size, 1, 1)
    if hi == nb - 1 and layout.tail_length != block_size and int(indices[-1]) != nb - 1:
        raise ConfigError("the short last block must be the last entry of the payload")
    return layout.payload_elements(indices)


def _threads(parallel: bool | int) -> int:
    """Threads for one pass: 1 (serial), numba's current count (True), or ``parallel`` within numba's pool."""
    if parallel is False:
        return 1
    if parallel is True:
        return get_num_threads()
    return max(1, min(int(parallel), numba_config.NUMBA_NUM_THREADS))


def _run(threads: int, parallel_kernel: Callable[..., None], serial_kernel: Callable[..., None], *args: Any) -> None:
    """One pass: the parallel kernel on ``threads`` of numba's threads, or the serial one in this thread."""
    if threads <= 1:
        serial_kernel(*args)
        return
    # numba's thread count is per calling thread: set it for this pass, then put it back.
    before = get_num_threads()
    set_num_threads(threads)
    try:
        parallel_kernel(*args)
    finally:
        set_num_threads(before)


def block_mask_cpu(
    flat: np.ndarray, block_size: int, threshold: float = 0.0, parallel: bool | int = True
) -> np.ndarray:
    """Nonzero-block mask of a contiguous 1-D float or integer array with the Numba CPU kernel.

    The parallel kernel splits the blocks over numba's threads, each streaming
    its own contiguous runs of blocks; the serial one reads them in one thread.
    Both give the same mask.

    Args:
        flat: contiguous 1-D array of float16/32/64, uint16 (bfloat16 bits), or
            int8/uint8/int16/int32/int64 (every bit counts: only 0 is zero).
        block_size: elements per block; the last block may be short.
        threshold: elements with ``|x| <= threshold`` count as zero; when it is
            positive, blocks found zero are zeroed in place in ``flat``. NaN and Inf
            are always nonzero, -0.0 always zero. Integers take 0 only.
        parallel: True uses numba's threads (its current count), an int that many
            threads (capped by numba's pool, ``NUMBA_NUM_THREADS``), False or 1 runs
            in the calling thread.

    Returns:
        A bool array with one entry per block, True where any element is nonzero.

    Raises:
        ConfigError: bad dtype, layout, block size or threshold.
    """
    _require_numba()
    block_size = check_block_size(block_size)
    info = bits_info(flat.dtype, integers=True)
    bits = _flat_bits(flat, "flat")
    thr = threshold_bits(threshold, info)
    out = np.empty(-(-flat.shape[0] // block_size), dtype=np.bool_)
    threads = _threads(parallel)
    if thr == 0:
        block_bytes = block_size * bits.itemsize
        nfull = flat.shape[0] // block_size
        if nfull and block_bytes % 8 == 0 and bits.ctypes.data % 8 == 0:
            # Word-wise rows: 6x faster than the element-wise kernel for float32 (25 -> 4 ms per 100 MB).
            words = bits[: nfull * block_size].view(np.uint64)
            repeat = 8 // bits.itemsize
            sign64 = np.uint64(int.from_bytes(int(info.sign_mask).to_bytes(bits.itemsize, "little") * repeat, "little"))
            wpb = block_bytes // 8
            # Probe the first word of every 64th block: where most blocks start nonzero
            # (a dense gradient), stopping at the first word wins 8x; elsewhere the early
            # exits cost more than they save (10% dense: 9.0 ms against 7.7 streamed).
            probe = words[: nfull * wpb : wpb * _PROBE_STRIDE] & sign64
            dense = np.count_nonzero(probe) > PROBE_DENSE * len(probe)
            _run(threads, _mask_words_parallel, _mask_words, words.reshape(nfull, wpb), sign64, dense, out[:nfull])
            if nfull < out.shape[0]:
                _mask_bits_serial(bits[nfull * block_size :], np.int64(block_size), info.uint.type(info.sign_mask),
                                  out[nfull:])
        else:
            _run(threads, _mask_bits, _mask_bits_serial, bits, np.int64(block_size), info.uint.type(info.sign_mask),
                 out)
    else:
        if not flat.flags.writeable:
            raise ConfigError("a positive threshold zeroes skipped blocks in place: flat must be writeable")
        _run(threads, _mask_threshold, _mask_threshold_serial, bits, np.int64(block_size),
             info.uint.type(info.sign_mask), info.uint.type(thr), out)
    return out


def compact_cpu(flat: np.ndarray, mask: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Gathers the blocks of ``flat`` where ``mask`` is set into one contiguous payload.

    Args:
        flat: contiguous 1-D array (any dtype :func:`block_mask_cpu` takes).
        mask: one entry per block, nonzero = keep (bool or uint8).
        block_size: elements per block.

    Returns:
        ``(indices, payload)``: the kept block indices (int64, ascending) and their
        elements back to back in ``flat``'s dtype, the short last block stored short.

    Raises:
        ConfigError: the mask length does not match, or bad dtype or block size.
    """
    _require_numba()
    block_size = check_block_size(block_size)
    bits = _flat_bits(flat, "flat")
    nb = -(-flat.shape[0] // block_size)
    if mask.ndim != 1 or mask.shape[0] != nb:
        raise ConfigError(f"mask has shape {mask.shape}, expected ({nb},)")
    indices = _nonzero_indices(mask.view(np.uint8), np.int64(_SCAN_CHUNK))
    out = np.empty(payload_length(indices, flat.shape[0], block_size), dtype=flat.dtype)
    _gather_blocks(bits, indices, np.int64(block_size), out.view(bits.dtype))
    return indices, out


def scatter_cpu(out: np.ndarray, indices: np.ndarray, payload: np.ndarray, block_size: int) -> None:
    """Writes the blocks of ``payload`` into ``out`` at ``indices``; every other block of ``out`` is zeroed.

    Args:
        out: contiguous 1-D array, overwritten entirely.
        indices: distinct block indices (int64), in payload order.
        payload: their elements in ``out``'s dtype (see the module's payload format).
        block_size: elements per block.

    Raises:
        ConfigError: dtypes, lengths or indices do not fit.
    """
    _require_numba()
    block_size = check_block_size(block_size)
    bits = _flat_bits(out, "out")
    if payload.dtype != out.dtype:
        raise ConfigError(f"payload dtype {payload.dtype} differs from out dtype {out.dtype}")
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    need = payload_length(indices, out.shape[0], block_size)
    if payload.shape != (need,):
        raise ConfigError(f"payload has shape {payload.shape}, expected ({need},) for {len(indices)} blocks")
    _scatter_blocks(bits, indices, np.ascontiguousarray(payload).view(bits.dtype), np.int64(block_size))
