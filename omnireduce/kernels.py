"""Numba CPU kernels for block detection.

A float is nonzero iff its bit pattern without the sign bit is nonzero: that
counts NaN and Inf as nonzero and -0.0 as zero, and lets one integer kernel
serve float64, float32, float16 and bfloat16 alike.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["HAVE_NUMBA", "block_mask_cpu"]

try:
    import numba
    from numba import njit, prange

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - numba is a dependency; kept importable without it
    HAVE_NUMBA = False

# Elements OR-ed together before testing, so the inner loop vectorises while a
# dense block still exits after its first chunk.
_CHUNK = 64

_SIGN_MASKS = {
    1: np.uint8(0x7F),
    2: np.uint16(0x7FFF),
    4: np.uint32(0x7FFFFFFF),
    8: np.uint64(0x7FFFFFFFFFFFFFFF),
}
_UINTS = {2: np.uint16, 4: np.uint32, 8: np.uint64}

if HAVE_NUMBA:

    @njit(parallel=True, cache=True, nogil=True)
    def _mask_bits(bits, block_size, sign_mask, out):  # type: ignore[no-untyped-def]
        n = bits.shape[0]
        for b in prange(out.shape[0]):
            start = b * block_size
            end = min(start + block_size, n)
            nonzero = False
            for j in range(start, end, _CHUNK):
                acc = bits[j] & 0
                for i in range(j, min(j + _CHUNK, end)):
                    acc |= bits[i]
                if acc & sign_mask:
                    nonzero = True
                    break
            out[b] = nonzero


def block_mask_cpu(flat: np.ndarray, block_size: int) -> np.ndarray:
    """Nonzero-block mask of a contiguous 1-D float array with the Numba CPU kernel.

    Args:
        flat: contiguous 1-D array of float16/32/64 (or uint16 bfloat16 bits).
        block_size: elements per block; the last block may be short.

    Returns:
        A bool array with one entry per block, True where any element is nonzero.
    """
    if not HAVE_NUMBA:
        raise RuntimeError("numba is not installed")
    size = flat.dtype.itemsize
    bits = flat.view(_UINTS[size])
    out = np.empty(-(-flat.shape[0] // block_size), dtype=np.bool_)
    _mask_bits(bits, np.int64(block_size), _SIGN_MASKS[size], out)
    return out
