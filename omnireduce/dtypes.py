"""Element types on the wire and how the aggregator accumulates them.

16-bit floats travel at 2 bytes but are summed in float32, as OmniReduce does,
so an fp16 sum of many workers does not lose more than one final rounding.
bfloat16 has no NumPy type: it travels and is stored as its uint16 bit pattern.

Integers travel as themselves and are summed in int64; the sums are narrowed back
to the stored type by two's-complement truncation, so they wrap exactly as an
integer sum in the stored type does (torch's own integer allreduce on gloo):
addition modulo ``2**bits`` gives the same low bits whatever the width it is done
in. An integer op is always a plain sum: a weighted mean has no integer result.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

__all__ = ["DType", "to_accumulator", "from_accumulator"]


class DType(IntEnum):
    """Wire codes of the supported element types (the ``dtype`` field of START)."""

    FLOAT32 = 1
    FLOAT64 = 2
    FLOAT16 = 3
    BFLOAT16 = 4
    INT32 = 5
    INT64 = 6
    INT8 = 7
    UINT8 = 8
    INT16 = 9

    @property
    def storage(self) -> np.dtype:
        """The NumPy dtype holding the elements (uint16 bits for bfloat16)."""
        return _STORAGE[self]

    @property
    def accumulator(self) -> np.dtype:
        """The NumPy dtype the aggregator sums in."""
        return _ACCUMULATOR[self]

    @property
    def itemsize(self) -> int:
        """Bytes per element on the wire."""
        return _STORAGE[self].itemsize

    @property
    def is_integer(self) -> bool:
        """Whether the elements are integers: exact sums that wrap, no weighted means."""
        return self in _INTEGERS

    @classmethod
    def of_numpy(cls, dtype: np.dtype) -> DType:
        """The wire code of a NumPy float or integer dtype.

        uint16 is not one: it is how bfloat16 is stored, and has no wire type of its own.

        Raises:
            KeyError: the dtype is not a supported element type.
        """
        return _FROM_NUMPY[np.dtype(dtype)]


_STORAGE = {
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT64: np.dtype(np.float64),
    DType.FLOAT16: np.dtype(np.float16),
    DType.BFLOAT16: np.dtype(np.uint16),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
    DType.INT8: np.dtype(np.int8),
    DType.UINT8: np.dtype(np.uint8),
    DType.INT16: np.dtype(np.int16),
}
_INTEGERS = frozenset({DType.INT32, DType.INT64, DType.INT8, DType.UINT8, DType.INT16})
_ACCUMULATOR = {
    d: np.dtype(np.int64) if d in _INTEGERS else np.dtype(np.float64) if d is DType.FLOAT64 else np.dtype(np.float32)
    for d in DType
}
_FROM_NUMPY = {_STORAGE[d]: d for d in DType if d is not DType.BFLOAT16}


def to_accumulator(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Converts stored elements to the accumulator type (a new array)."""
    if dtype is DType.BFLOAT16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(dtype.accumulator)


def from_accumulator(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Converts accumulated sums back to the stored type.

    Floats are rounded to nearest even; integers keep their low bits (NumPy's
    integer cast truncates), which is the sum wrapped as the stored type wraps.
    """
    if dtype is DType.BFLOAT16:
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        out = ((bits + rounding) >> 16).astype(np.uint16)
        # A NaN must stay a NaN: rounding could carry its mantissa into Inf.
        out[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
        return out
    return values.astype(dtype.storage, copy=False)
