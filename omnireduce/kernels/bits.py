"""Bit-pattern helpers shared by the CPU and CUDA kernels.

Every kernel works on the unsigned-integer view of the floats. For a
non-negative float that is not NaN, the order of the values is the order of
their bit patterns, so with ``m = bits & ~sign``:

* ``m == 0`` is exactly ``x == 0.0`` or ``x == -0.0``;
* ``m > thr_bits`` is exactly ``|x| > t`` for the threshold ``t`` rounded to the
  element type (pattern ``thr_bits``); and NaN and Inf (exponent all ones) are
  above every finite threshold, so they count as nonzero.

One integer comparison thus serves float64, float32, float16 and bfloat16 (whose
16-bit pattern is all the kernels ever see) without a float type per dtype.

Integer elements (the CPU kernels only, asked for with ``integers=True``) have no
sign to strip: in two's complement only the all-zero pattern is zero, and the
most negative value is the sign bit alone, so every bit counts (``sign_mask`` is
all ones). They take no threshold: their sums are exact.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from omnireduce.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["BitsInfo", "bits_info", "threshold_bits", "check_block_size"]

_UINTS = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_FLOAT_KINDS = {
    np.dtype(np.float64): "f64",
    np.dtype(np.float32): "f32",
    np.dtype(np.float16): "f16",
    np.dtype(np.uint16): "bf16",
    np.dtype(np.int16): "bf16",
}
_INT_KINDS = {
    np.dtype(np.int8): "i8",
    np.dtype(np.uint8): "u8",
    np.dtype(np.int16): "i16",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
}


@dataclass(frozen=True, slots=True)
class BitsInfo:
    """How an element dtype is seen by the kernels.

    Args:
        kind: "f64", "f32", "f16" or "bf16"; for integers "i8", "u8", "i16", "i32" or "i64".
        uint: the unsigned dtype of the same width.
        sign_mask: the bits that make an element nonzero, as a Python int: all but
            the sign for floats, all of them for integers.
    """

    kind: str
    uint: np.dtype
    sign_mask: int

    @property
    def itemsize(self) -> int:
        return self.uint.itemsize

    @property
    def integer(self) -> bool:
        """Whether the elements are integers (every bit counts, no threshold)."""
        return self.kind[0] in "iu"


def bits_info(dtype: np.dtype | type, integers: bool = False) -> BitsInfo:
    """The kernel view of a dtype.

    Args:
        dtype: float64, float32, float16, or bfloat16 bits: uint16, and int16 unless
            ``integers`` (CUDA torch bfloat16 tensors are viewed as int16).
        integers: also take int8, uint8, int16, int32 and int64 as integers, int16
            included; bfloat16 bits must then be uint16 (as the CPU path stores them).

    Raises:
        ConfigError: any other dtype.
    """
    dt = np.dtype(dtype)
    kind = _INT_KINDS.get(dt) if integers else None
    if kind is not None:
        return BitsInfo(kind, _UINTS[dt.itemsize], (1 << (dt.itemsize * 8)) - 1)
    kind = _FLOAT_KINDS.get(dt)
    if kind is None:
        what = (
            "float64, float32, float16, bfloat16 (as uint16), int8, uint8, int16, int32 or int64" if integers
            else "float64, float32, float16 or bfloat16 (as 16-bit integers)"
        )
        raise ConfigError(f"block kernels take {what}, got dtype {dt}")
    width = dt.itemsize * 8
    return BitsInfo(kind, _UINTS[dt.itemsize], (1 << (width - 1)) - 1)


_MAX_FINITE = {"f64": 0x7FEFFFFFFFFFFFFF, "f32": 0x7F7FFFFF, "f16": 0x7BFF, "bf16": 0x7F7F}
_INF_BITS = {"f64": 0x7FF0000000000000, "f32": 0x7F800000, "f16": 0x7C00, "bf16": 0x7F80}


def threshold_bits(threshold: float, info: BitsInfo) -> int:
    """The magnitude bit pattern of ``threshold`` rounded to the dtype.

    The threshold is rounded to the nearest value of the element type (as NumPy
    and torch do for ``abs(x) <= threshold``; bfloat16 through float32, then
    round to nearest even) and the comparison is made in that type. A threshold
    that rounds to Inf is capped at the largest finite value, so Inf stays nonzero.

    Args:
        threshold: a finite, non-negative float; elements with ``|x| <= threshold`` count as zero.
        info: the dtype's kernel view.

    Returns:
        ``thr_bits`` such that ``(bits & sign_mask) > thr_bits`` iff ``|x| > threshold``
        in the element type; NaN and Inf are always above it.

    Raises:
        ConfigError: the threshold is negative, NaN or infinite, or positive for integers.
    """
    try:
        t = float(threshold)
    except (TypeError, ValueError):
        raise ConfigError(f"threshold must be a number, got {threshold!r}") from None
    if not math.isfinite(t) or t < 0:
        # An infinite threshold would make Inf count as zero; NaN and Inf must stay nonzero.
        raise ConfigError(f"threshold must be finite and >= 0, got {threshold!r}")
    if info.integer:
        if t:
            # Dropping small integers would make an exact sum inexact; and in two's
            # complement |x| <= t is not one comparison of the unsigned patterns.
            raise ConfigError(f"integer elements take no threshold (their sums are exact), got {threshold!r}")
        return 0
    with np.errstate(over="ignore"):
        if info.kind == "f64":
            bits = int(np.float64(t).view(np.uint64))
        elif info.kind == "f32":
            bits = int(np.float32(t).view(np.uint32))
        elif info.kind == "f16":
            bits = int(np.float16(t).view(np.uint16))
        else:
            b32 = int(np.float32(t).view(np.uint32))
            bits = (b32 + 0x7FFF + ((b32 >> 16) & 1)) >> 16
    if bits >= _INF_BITS[info.kind]:
        bits = _MAX_FINITE[info.kind]
    return bits


def check_block_size(block_size: int) -> int:
    """Validates a block size.

    Raises:
        ConfigError: it is not a positive integer.
    """
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size < 1:
        raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
    return int(block_size)
