"""Conversion between user tensors (NumPy arrays, CPU torch tensors) and flat wire arrays."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from omnireduce.dtypes import DType
from omnireduce.errors import ConfigError

__all__ = ["to_flat", "from_storage", "shares_memory", "is_torch"]

_NUMPY_TYPES = "float32, float64, float16, int8, uint8, int16, int32 and int64"
_TORCH_TYPES = "float32, float64, float16, bfloat16, int8, uint8, int16, int32 and int64"


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch tensor; does not import torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def to_flat(x: Any) -> tuple[np.ndarray, DType, Callable[[np.ndarray], Any]]:
    """Flattens a tensor without copying where it is already contiguous.

    Args:
        x: a NumPy array or a CPU torch tensor of float32, float64, float16, bfloat16
            (torch only), int8, uint8, int16, int32 or int64. Integers are summed
            exactly, wrapping as their own type does.

    Returns:
        The flat contiguous array (bfloat16 as uint16 bits), its wire type, and a
        function turning a flat result back into the input's type and shape.

    Raises:
        ConfigError: the input's type, device or dtype is not supported.
    """
    if isinstance(x, np.ndarray):
        try:
            dtype = DType.of_numpy(x.dtype)
        except KeyError:
            raise ConfigError(f"allreduce supports {_NUMPY_TYPES} arrays, got dtype {x.dtype}") from None
        shape = x.shape
        return np.ascontiguousarray(x).reshape(-1), dtype, lambda out: out.reshape(shape)
    if is_torch(x):
        return _torch_to_flat(x)
    raise ConfigError(f"allreduce takes a NumPy array or a torch tensor, got {type(x).__name__}")


def _torch_to_flat(x: Any) -> tuple[np.ndarray, DType, Callable[[np.ndarray], Any]]:
    import torch

    if x.device.type != "cpu":
        raise ConfigError(f"allreduce of a tensor on {x.device} is not supported; move it to the CPU")
    if x.layout != torch.strided:
        raise ConfigError(f"allreduce supports dense and sparse COO tensors, not the {x.layout} layout")
    shape = x.shape
    t = x.detach().contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        flat = t.view(torch.int16).numpy().view(np.uint16)
        return flat, DType.BFLOAT16, lambda out: from_storage(out, DType.BFLOAT16).reshape(shape)
    names = {
        torch.float32: DType.FLOAT32, torch.float64: DType.FLOAT64, torch.float16: DType.FLOAT16,
        torch.int8: DType.INT8, torch.uint8: DType.UINT8, torch.int16: DType.INT16, torch.int32: DType.INT32,
        torch.int64: DType.INT64,
    }
    if t.dtype not in names:
        raise ConfigError(f"allreduce supports {_TORCH_TYPES} tensors, got {t.dtype}")
    return t.numpy(), names[t.dtype], lambda out: torch.from_numpy(out).reshape(shape)


def from_storage(values: np.ndarray, dtype: DType) -> Any:
    """A CPU torch tensor of wire-stored ``values`` (bfloat16 from its uint16 bits), sharing their memory."""
    import torch

    if dtype is DType.BFLOAT16:
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def shares_memory(x: Any, flat: np.ndarray) -> bool:
    """Whether ``flat`` (from :func:`to_flat`) is ``x``'s own memory, so that writing it writes ``x``."""
    if flat.size == 0:
        return True  # nothing to write: any empty tensor (a shard's empty chunk) qualifies
    if isinstance(x, np.ndarray):
        return bool(np.shares_memory(x, flat)) and x.size == flat.size
    if is_torch(x):
        return x.is_contiguous() and x.numel() == flat.size and x.data_ptr() == flat.ctypes.data
    return False
