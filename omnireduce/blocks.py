"""Block detection, gather and scatter on the CPU, all vectorised.

These are the data-path primitives both sides share: the nonzero-block mask of
a flat tensor, the per-column "next nonzero block" table that drives the
protocol, and the gather/scatter of a set of blocks to and from a payload in
which the short last block (if any) is stored short.
"""

from __future__ import annotations

import logging

import numpy as np

from omnireduce import kernels
from omnireduce.layout import INF, Layout

logger = logging.getLogger(__name__)

__all__ = [
    "block_mask",
    "block_mask_numpy",
    "next_table",
    "split_payload",
    "gather",
    "scatter",
]

# Below this many elements NumPy beats the cost of entering the parallel kernel.
_NUMBA_MIN_ELEMENTS = 1 << 16
_UINTS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def block_mask_numpy(flat: np.ndarray, block_size: int) -> np.ndarray:
    """Reference nonzero-block mask in NumPy (see :func:`block_mask`)."""
    n = flat.shape[0]
    nb = -(-n // block_size)
    out = np.empty(nb, dtype=np.bool_)
    if n == 0:
        return out
    size = flat.dtype.itemsize
    # Comparing the bits without the sign makes -0.0 zero and NaN nonzero, for
    # bfloat16 bit patterns too.
    bits = flat.view(_UINTS[size])
    sign_mask = _UINTS[size](~(1 << (8 * size - 1)) & ((1 << (8 * size)) - 1))
    nfull = n // block_size
    if nfull:
        out[:nfull] = ((bits[: nfull * block_size].reshape(nfull, block_size) & sign_mask) != 0).any(1)
    if nfull < nb:
        out[nfull] = bool(((bits[nfull * block_size :] & sign_mask) != 0).any())
    return out


def block_mask(flat: np.ndarray, block_size: int) -> np.ndarray:
    """Nonzero-block mask of a flat tensor.

    A block is nonzero when any element is nonzero, NaN or Inf; a block of 0.0
    and -0.0 is zero. The last block may be short.

    Args:
        flat: contiguous 1-D float array (bfloat16 as uint16 bits).
        block_size: elements per block.

    Returns:
        A bool array of ``ceil(len(flat) / block_size)`` entries.
    """
    if kernels.HAVE_NUMBA and flat.shape[0] >= _NUMBA_MIN_ELEMENTS:
        return kernels.block_mask_cpu(flat, block_size)
    return block_mask_numpy(flat, block_size)


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


def gather(flat: np.ndarray, ids: np.ndarray, layout: Layout) -> np.ndarray:
    """Copies blocks ``ids`` of ``flat`` into a new contiguous payload, in ``ids`` order."""
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
    full, tail = _full_and_tail(flat, layout)
    for sl, view in split_payload(payload, ids, layout):
        if view.shape[1] == layout.block_size:
            full[ids[sl]] = view
        else:
            tail[:] = view[0]
