"""Element types on the wire and how the aggregator accumulates them.

16-bit floats travel at 2 bytes but are summed in float32, as OmniReduce does,
so an fp16 sum of many workers does not lose more than one final rounding.
bfloat16 has no NumPy type: it travels and is stored as its uint16 bit pattern.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

__all__ = ["DType", "to_accumulator", "from_accumulator"]


class DType(IntEnum):
    """Wire codes of the supported element types."""

    FLOAT32 = 1
    FLOAT64 = 2
    FLOAT16 = 3
    BFLOAT16 = 4

    @property
    def storage(self) -> np.dtype:
        """The NumPy dtype holding the elements (uint16 bits for bfloat16)."""
        return _STORAGE[self]

    @property
    def accumulator(self) -> np.dtype:
        """The NumPy dtype the aggregator sums in."""
        return np.dtype(np.float64) if self is DType.FLOAT64 else np.dtype(np.float32)

    @property
    def itemsize(self) -> int:
        return _STORAGE[self].itemsize

    @classmethod
    def of_numpy(cls, dtype: np.dtype) -> DType:
        """The wire code of a NumPy float dtype.

        Raises:
            KeyError: the dtype is not a supported float type.
        """
        return _FROM_NUMPY[np.dtype(dtype)]


_STORAGE = {
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT64: np.dtype(np.float64),
    DType.FLOAT16: np.dtype(np.float16),
    DType.BFLOAT16: np.dtype(np.uint16),
}
_FROM_NUMPY = {
    np.dtype(np.float32): DType.FLOAT32,
    np.dtype(np.float64): DType.FLOAT64,
    np.dtype(np.float16): DType.FLOAT16,
}


def to_accumulator(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Converts stored elements to the accumulator type (a new array)."""
    if dtype is DType.BFLOAT16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(dtype.accumulator)


def from_accumulator(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Rounds accumulated sums back to the stored type (round to nearest even)."""
    if dtype is DType.BFLOAT16:
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        out = ((bits + rounding) >> 16).astype(np.uint16)
        # A NaN must stay a NaN: rounding could carry its mantissa into Inf.
        out[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
        return out
    return values.astype(dtype.storage, copy=False)
