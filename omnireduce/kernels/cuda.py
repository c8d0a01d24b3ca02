"""Numba CUDA kernels: nonzero-block mask, compaction and scatter on the GPU.

Importing this module imports ``numba.cuda`` (provided by the ``numba-cuda``
package), so whether the CUDA simulator is used (``NUMBA_ENABLE_CUDASIM=1``)
is fixed by the environment when numba is first imported.

The kernels read the data as unsigned words. Where the byte counts and the
alignment allow it they read 8-byte words that hold 1, 2 or 4 elements
("packed"), which halves or quarters the load instructions for 32- and 16-bit
data; otherwise one word per element. Only block-level primitives
(``syncthreads``, shared memory, shared atomics) are used, no warp intrinsics,
so that the same kernels run under the simulator in CI.

Payload format: as :mod:`omnireduce.kernels.cpu`, the kept blocks back to back,
the short last block of the tensor stored short and last. :func:`cuda_scatter`
also accepts one ``block_size`` slot per block, and :func:`cuda_put` (which
:mod:`worker.cuda` uses to write results chunk by chunk) takes only that.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numba import cuda

from omnireduce.errors import ConfigError
from omnireduce.kernels import cuda_kernels as ck
from omnireduce.kernels.bits import BitsInfo, bits_info, check_block_size, threshold_bits

logger = logging.getLogger(__name__)

__all__ = [
    "LaunchConfig",
    "launch_config",
    "set_launch_config",
    "simulator_enabled",
    "as_device_flat",
    "cuda_block_mask",
    "cuda_compact",
    "cuda_scatter",
    "empty_like_device",
    "stream_for",
    "on_device",
    "cuda_put",
    "cuda_zero",
]


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Launch geometry of the kernels.

    Args:
        threads: threads per CUDA block.
        items: words each thread loads per pass of the mask kernel (loads in flight).
        copy_items: words each thread moves per pass of the gather and scatter kernels.
        scan_items: mask entries each thread handles in the compaction scan.
    """

    threads: int = 256
    items: int = 16
    copy_items: int = 8
    scan_items: int = 8


_config = LaunchConfig()


def launch_config() -> LaunchConfig:
    """The launch geometry in use."""
    return _config


def set_launch_config(config: LaunchConfig) -> None:
    """Replaces the launch geometry (the simulator tests use small ones to reach many tiles cheaply)."""
    global _config
    if config.threads < 1 or config.threads > 1024 or min(config.items, config.copy_items, config.scan_items) < 1:
        raise ConfigError(f"invalid launch config {config}")
    if config.items > 62:
        raise ConfigError("items must be at most 62 (a 64-bit hit mask per thread)")
    _config = config


def simulator_enabled() -> bool:
    """Whether ``numba.cuda`` is the CUDA simulator."""
    return bool(getattr(cuda, "simulator_enabled", None) or numba.config.ENABLE_CUDASIM)


# ---------------------------------------------------------------- host side


def _torch_tensor(x: Any) -> Any:
    torch = sys.modules.get("torch")
    return x if torch is not None and isinstance(x, torch.Tensor) else None


def as_device_flat(x: Any) -> tuple[Any, BitsInfo]:
    """A flat numba device view of ``x`` (no copy, in its own dtype) and its element kind.

    Args:
        x: a contiguous CUDA torch tensor (bfloat16 is viewed as its 16-bit
            pattern), a numba device array, any object with
            ``__cuda_array_interface__``, or, under the simulator, a simulator array.

    Raises:
        ConfigError: not a CUDA array, not contiguous, or an unsupported dtype.
    """
    t = _torch_tensor(x)
    if t is not None:
        if not t.is_cuda:
            raise ConfigError(f"expected a CUDA tensor, got one on {t.device}")
        if not t.is_contiguous():
            raise ConfigError("the tensor must be contiguous")
        import torch

        t = t.reshape(-1)
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        # sync=False: the kernels run on the tensor's current stream, which
        # orders them after its producer without blocking the host.
        arr = cuda.as_cuda_array(t, sync=False)
    elif getattr(x, "__cuda_ndarray__", False):
        arr = x
    elif not simulator_enabled() and hasattr(x, "__cuda_array_interface__"):
        arr = cuda.as_cuda_array(x, sync=False)
    else:
        raise ConfigError(f"expected a CUDA array (__cuda_array_interface__), got {type(x).__name__}")
    if not arr.is_c_contiguous():
        raise ConfigError("the array must be C-contiguous")
    info = bits_info(arr.dtype)
    return arr.reshape(arr.size), info


def stream_for(x: Any, stream: Any = 0) -> Any:
    """``stream`` if given, else the torch tensor's current stream (so kernels follow its producer), else 0."""
    if stream is not None and stream != 0:
        return stream
    t = _torch_tensor(x)
    if t is not None:
        import torch

        ptr = torch.cuda.current_stream(t.device).cuda_stream
        return cuda.external_stream(ptr) if ptr else 0
    return 0


@contextlib.contextmanager
def on_device(x: Any) -> Iterator[None]:
    """Makes the torch tensor's GPU numba's current device for the block (a no-op for other inputs)."""
    t = _torch_tensor(x)
    if t is not None and t.is_cuda and t.device.index is not None:
        with cuda.gpus[t.device.index]:
            yield
    else:
        yield


def _address(arr: Any) -> int:
    if simulator_enabled():
        return int(arr._ary.ctypes.data)
    return int(arr.__cuda_array_interface__["data"][0])


def empty_like_device(x: Any, n: int, dtype: Any, stream: Any = 0) -> Any:
    """An uninitialised device array, from torch's caching allocator when ``x`` is a torch tensor.

    Args:
        x: the input whose allocator (and device) to use.
        n: elements.
        dtype: NumPy dtype.
        stream: the stream the array is used on.
    """
    dtype = np.dtype(dtype)
    t = _torch_tensor(x)
    if t is not None:
        import torch

        raw = torch.empty(max(n, 1) * dtype.itemsize, dtype=torch.uint8, device=t.device)
        return cuda.as_cuda_array(raw, sync=False).view(dtype)[:n]
    return cuda.device_array(n, dtype=dtype, stream=stream)


def _words(flat: Any, info: BitsInfo, block_size: int, *others: Any) -> tuple[Any, int, int]:
    """The word view of ``flat``: 8-byte words where every byte count and address allows, else elements.

    Returns:
        ``(words, words_per_block, elements_per_word)``.
    """
    size = info.itemsize
    n = flat.shape[0]
    if (
        size < 8
        and (block_size * size) % 8 == 0
        and (n * size) % 8 == 0
        and all((o.shape[0] * size) % 8 == 0 for o in others)
        and all(_address(a) % 8 == 0 for a in (flat, *others) if a.shape[0])
    ):
        per = 8 // size
        return flat.view(np.uint64), block_size // per, per
    return flat, block_size, 1


def _shift(wpb: int) -> int:
    return wpb.bit_length() - 1 if wpb & (wpb - 1) == 0 else -1


def _replicate(mask: int, size: int) -> int:
    out = 0
    for lane in range(8 // size):
        out |= mask << (8 * size * lane)
    return out


def cuda_block_mask(x: Any, block_size: int, threshold: float = 0.0, stream: Any = 0) -> Any:
    """Nonzero-block mask of a flat CUDA tensor, computed on the GPU.

    A block is nonzero when any element has ``|x| > threshold`` (the threshold
    rounded to the element type) or is NaN or Inf; -0.0 is zero. With a positive
    threshold, blocks found zero are zeroed in place, as OmniReduce's kernel does.

    Args:
        x: a contiguous CUDA array of float32, float16, float64 or bfloat16
            (see :func:`as_device_flat`); any shape, read flat.
        block_size: elements per block; the last block may be short.
        threshold: finite, >= 0.
        stream: a numba stream; default the torch tensor's current stream, else 0.

    Returns:
        A device uint8 array of ``ceil(n / block_size)`` entries, 1 = nonzero.

    Raises:
        ConfigError: bad input, block size or threshold.
    """
    block_size = check_block_size(block_size)
    flat, info = as_device_flat(x)
    flat = flat.view(info.uint)
    thr = threshold_bits(threshold, info)
    n = flat.shape[0]
    nb = -(-n // block_size)
    stream = stream_for(x, stream)
    with on_device(x):
        out = empty_like_device(x, nb, np.uint8, stream)
        if nb == 0:
            return out
        words, wpb, per = _words(flat, info, block_size)
        cfg = _config
        chunk = cfg.threads * cfg.items
        dblocks = max(1, chunk // wpb)
        lane_bits = 8 * info.itemsize
        kernel = ck.mask_kernel(cfg.threads, cfg.items, thr != 0)
        kernel[-(-nb // dblocks), cfg.threads, stream](
            words, np.int64(words.shape[0]), np.int64(nb), np.int64(wpb), np.int64(_shift(wpb)),
            np.int64(dblocks), np.int64(per), np.int64(lane_bits), np.uint64(info.sign_mask),
            np.uint64(_replicate(info.sign_mask, info.itemsize) if per > 1 else info.sign_mask),
            np.uint64(thr), out,
        )
    return out


def _read_one(arr: Any, i: int, stream: Any) -> Any:
    """Element ``i`` of a device array, once the work queued on ``stream`` has written it."""
    host = arr[i : i + 1].copy_to_host(stream=stream)
    if not isinstance(stream, int):
        # A copy "on a stream" may return before the data lands; wait for it.
        stream.synchronize()
    return host[0]


def _mask_to_indices(x: Any, mask: Any, count: int | None, stream: Any) -> Any:
    cfg = _config
    nb = mask.shape[0]
    tile = cfg.threads * cfg.scan_items
    ntiles = -(-nb // tile)
    counts = empty_like_device(x, ntiles, np.int64, stream)
    offsets = empty_like_device(x, ntiles + 1, np.int64, stream)
    ck.count_kernel(cfg.threads, cfg.scan_items)[ntiles, cfg.threads, stream](mask, counts)
    ck.scan_kernel(cfg.threads, cfg.scan_items)[1, cfg.threads, stream](counts, offsets)
    if count is None:
        # The one host synchronisation: the output must be sized.
        count = int(_read_one(offsets, ntiles, stream))
    indices = empty_like_device(x, count, np.int64, stream)
    if count:
        ck.write_kernel(cfg.threads, cfg.scan_items)[ntiles, cfg.threads, stream](mask, offsets, indices)
    return indices


def cuda_compact(
    x: Any, mask: Any, block_size: int, stream: Any = 0, host_mask: np.ndarray | None = None
) -> tuple[Any, Any]:
    """Gathers the nonzero blocks of a CUDA tensor into one contiguous device buffer.

    A prefix sum over the mask gives every kept block its slot; the blocks are
    then copied there in parallel.

    Args:
        x: the tensor the mask was computed from (see :func:`as_device_flat`).
        mask: device array of ``ceil(n / block_size)`` entries, nonzero = keep
            (as returned by :func:`cuda_block_mask`).
        block_size: elements per block.
        stream: a numba stream; default the torch tensor's current stream, else 0.
        host_mask: the same mask on the host when the caller has it: it sizes
            the output without the device-to-host synchronisation otherwise needed.

    Returns:
        ``(indices, blocks)`` on the device: the kept block indices (int64,
        ascending) and their elements back to back in ``x``'s dtype (bfloat16
        tensors give int16), the short last block stored short.

    Raises:
        ConfigError: bad input or a mask of the wrong length.
    """
    block_size = check_block_size(block_size)
    flat, info = as_device_flat(x)
    n = flat.shape[0]
    nb = -(-n // block_size)
    if getattr(mask, "ndim", 1) != 1 or mask.shape[0] != nb:
        raise ConfigError(f"mask has shape {tuple(mask.shape)}, expected ({nb},)")
    stream = stream_for(x, stream)
    with on_device(x):
        mask_arr = mask if getattr(mask, "__cuda_ndarray__", False) else cuda.as_cuda_array(mask, sync=False)
        if mask_arr.dtype.itemsize != 1:
            raise ConfigError(f"mask must be uint8 or bool, got {mask_arr.dtype}")
        mask_arr = mask_arr.view(np.uint8)
        if nb == 0:
            return empty_like_device(x, 0, np.int64, stream), empty_like_device(x, 0, flat.dtype, stream)
        count = None if host_mask is None else int(np.count_nonzero(host_mask))
        indices = _mask_to_indices(x, mask_arr, count, stream)
        k = indices.shape[0]
        short = n - (nb - 1) * block_size
        if not k or short == block_size:
            tail_kept = False
        elif host_mask is not None:
            tail_kept = bool(host_mask[nb - 1])
        else:
            tail_kept = int(_read_one(mask_arr, nb - 1, stream)) != 0
        length = k * block_size - ((block_size - short) if tail_kept else 0)
        out = empty_like_device(x, length, flat.dtype, stream)
        if length:
            src, wpb, _ = _words(flat.view(info.uint), info, block_size, out)
            dst = out.view(src.dtype)
            cfg = _config
            kernel = ck.gather_kernel(cfg.threads, cfg.copy_items, src.dtype.itemsize)
            per_block = cfg.threads * cfg.copy_items
            kernel[-(-dst.shape[0] // per_block), cfg.threads, stream](
                src, indices, dst, np.int64(wpb), np.int64(_shift(wpb))
            )
    return indices, out


def _write_operands(out: Any, indices: Any, blocks: Any) -> tuple[Any, Any, Any, Any]:
    """The bit views of ``out`` and ``blocks`` and the device indices of a scatter or put, checked."""
    flat, info = as_device_flat(out)
    payload, pinfo = as_device_flat(blocks)
    idx = indices if getattr(indices, "__cuda_ndarray__", False) else cuda.as_cuda_array(indices, sync=False)
    if pinfo.itemsize != info.itemsize:
        raise ConfigError(f"blocks have {pinfo.itemsize}-byte elements, out has {info.itemsize}-byte ones")
    if np.dtype(idx.dtype) != np.dtype(np.int64):
        raise ConfigError(f"indices must be int64, got {idx.dtype}")
    return flat.view(info.uint), info, payload.view(pinfo.uint), idx


def cuda_scatter(out: Any, indices: Any, blocks: Any, block_size: int, stream: Any = 0) -> None:
    """Writes blocks into a CUDA tensor at their indices and zeroes every other block.

    Args:
        out: contiguous CUDA array, overwritten entirely (see :func:`as_device_flat`).
        indices: device int64 array of distinct block indices; out-of-range ones are ignored.
        blocks: device array of ``out``'s element type: one ``block_size`` slot
            per index in index order, where the short last block may be stored
            short if it is the last entry (:func:`cuda_compact`'s format).
        block_size: elements per block.
        stream: a numba stream; default the torch tensor's current stream, else 0.

    Raises:
        ConfigError: bad input, or ``blocks`` of a length that fits neither format.
    """
    block_size = check_block_size(block_size)
    flat, info, payload, idx = _write_operands(out, indices, blocks)
    n = flat.shape[0]
    nb = -(-n // block_size)
    k = idx.shape[0]
    short = n - (nb - 1) * block_size if nb else block_size
    if payload.shape[0] not in (k * block_size, k * block_size - (block_size - short) if k else 0):
        raise ConfigError(
            f"blocks have {payload.shape[0]} elements, which fits no payload of {k} blocks of {block_size}"
        )
    stream = stream_for(out, stream)
    with on_device(out):
        if nb == 0:
            return
        cfg = _config
        pos = empty_like_device(out, nb, np.int64, stream)
        grid = -(-nb // cfg.threads)
        ck.fill_kernel[grid, cfg.threads, stream](pos, np.int64(-1))
        if k:
            ck.positions_kernel[-(-k // cfg.threads), cfg.threads, stream](idx, pos)
        dst, wpb, _ = _words(flat, info, block_size, payload)
        src = payload.view(dst.dtype)
        kernel = ck.scatter_kernel(cfg.threads, cfg.copy_items, dst.dtype.itemsize)
        per_block = cfg.threads * cfg.copy_items
        kernel[-(-dst.shape[0] // per_block), cfg.threads, stream](dst, pos, src, np.int64(wpb), np.int64(_shift(wpb)))


def cuda_put(out: Any, indices: Any, blocks: Any, block_size: int, stream: Any = 0) -> None:
    """Writes blocks into a CUDA tensor at their indices, leaving every other block as it is.

    Args:
        out: contiguous CUDA array (see :func:`as_device_flat`).
        indices: device int64 array of distinct block indices; out-of-range ones are ignored.
        blocks: device array of ``len(indices) * block_size`` elements of ``out``'s
            element size, one full slot per index (the short last block uses the
            start of its slot).
        block_size: elements per block.
        stream: a numba stream; default the torch tensor's current stream, else 0.

    Raises:
        ConfigError: bad input or lengths.
    """
    block_size = check_block_size(block_size)
    flat, info, payload, idx = _write_operands(out, indices, blocks)
    if payload.shape[0] != idx.shape[0] * block_size:
        raise ConfigError(f"blocks have {payload.shape[0]} elements, expected {idx.shape[0]} slots of {block_size}")
    if payload.shape[0] == 0:
        return
    stream = stream_for(out, stream)
    with on_device(out):
        dst, wpb, _ = _words(flat, info, block_size, payload)
        src = payload.view(dst.dtype)
        cfg = _config
        kernel = ck.put_kernel(cfg.threads, cfg.copy_items, dst.dtype.itemsize)
        per_block = cfg.threads * cfg.copy_items
        kernel[-(-src.shape[0] // per_block), cfg.threads, stream](dst, idx, src, np.int64(wpb), np.int64(_shift(wpb)))


def cuda_zero(out: Any, stream: Any = 0) -> None:
    """Sets a contiguous CUDA array to zero on ``stream`` (default: as :func:`stream_for`)."""
    flat, info = as_device_flat(out)
    words = flat.view(info.uint)
    if words.shape[0] == 0:
        return
    stream = stream_for(out, stream)
    with on_device(out):
        cfg = _config
        ck.fill_kernel[-(-words.shape[0] // cfg.threads), cfg.threads, stream](words, info.uint.type(0))
