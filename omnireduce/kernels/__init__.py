"""Block detection, compaction and scatter kernels for the CPU (Numba) and the GPU (Numba CUDA).

The CPU kernels live in :mod:`omnireduce.kernels.cpu`; the CUDA ones in
:mod:`omnireduce.kernels.cuda`, which is imported only when a CUDA entry point is
first called, so that importing this package neither imports ``numba.cuda`` nor
fixes whether the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) is used.
"""

from __future__ import annotations

import logging
from typing import Any

from omnireduce.kernels.bits import bits_info, threshold_bits
from omnireduce.kernels.cpu import (
    HAVE_NUMBA,
    add_rows_cpu,
    block_mask_cpu,
    compact_cpu,
    next_table_cpu,
    payload_length,
    scatter_cpu,
)

logger = logging.getLogger(__name__)

__all__ = [
    "HAVE_NUMBA",
    "bits_info",
    "threshold_bits",
    "payload_length",
    "block_mask_cpu",
    "compact_cpu",
    "scatter_cpu",
    "add_rows_cpu",
    "next_table_cpu",
    "cuda_block_mask",
    "cuda_compact",
    "cuda_scatter",
]


def cuda_block_mask(x: Any, block_size: int, threshold: float = 0.0, stream: Any = 0) -> Any:
    """Nonzero-block mask of a CUDA array; see :func:`omnireduce.kernels.cuda.cuda_block_mask`."""
    from omnireduce.kernels import cuda

    return cuda.cuda_block_mask(x, block_size, threshold, stream=stream)


def cuda_compact(x: Any, mask: Any, block_size: int, stream: Any = 0) -> tuple[Any, Any]:
    """Gathers the nonzero blocks of a CUDA array; see :func:`omnireduce.kernels.cuda.cuda_compact`."""
    from omnireduce.kernels import cuda

    return cuda.cuda_compact(x, mask, block_size, stream=stream)


def cuda_scatter(out: Any, indices: Any, blocks: Any, block_size: int, stream: Any = 0) -> None:
    """Writes blocks back into a CUDA array; see :func:`omnireduce.kernels.cuda.cuda_scatter`."""
    from omnireduce.kernels import cuda

    cuda.cuda_scatter(out, indices, blocks, block_size, stream=stream)
