"""The data path of an allreduce of a CUDA tensor: only the nonzero blocks leave the GPU.

At submission :class:`CudaOpData` runs, on the tensor's current stream, the
block mask (one device-to-host copy of one byte per block, waited for: the
START message needs it) and the compaction of the nonzero blocks, then queues
the one device-to-host copy of the compacted bytes into pinned memory, in
chunks of ``chunk_bytes`` each followed by an event. The worker's communication
thread sends START at once and, for every BLOCKS message, waits only for the
chunks holding the blocks it sends, so the copy overlaps the first rounds.

Results go the other way: every RESULT's blocks are written into a pinned
staging slot (one ``block_size`` slot per block), copied to the GPU and put
into the zeroed output there by a kernel, chunk by chunk as the rounds arrive;
blocks no worker sent stay zero. A ring of staging slots, each reused only
after its copy's event, bounds the pinned memory a result needs.

This module imports ``numba.cuda`` only when a :class:`CudaOpData` is built.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from omnireduce import blocks
from omnireduce.dtypes import DType
from omnireduce.errors import ConfigError, OmniReduceError, OpError, ProtocolError
from omnireduce.layout import Layout
from worker.tensors import is_torch

logger = logging.getLogger(__name__)

__all__ = ["CHUNK_BYTES", "STAGING_SLOTS", "check_cuda_torch_dtype", "is_cuda_tensor", "CudaOpData", "PinnedPool"]

#: Bytes per device-to-host and host-to-device chunk (OmniReduce copies 1 MiB chunks).
CHUNK_BYTES = 1 << 20
#: Result staging slots in the ring: copies of that many chunks may be in flight.
STAGING_SLOTS = 4

_KINDS = {"f64": DType.FLOAT64, "f32": DType.FLOAT32, "f16": DType.FLOAT16, "bf16": DType.BFLOAT16}
F = TypeVar("F", bound=Callable[..., Any])


def _device_errors(fn: F) -> F:
    """Turns a CUDA failure in a data-path step into an OpError, so that only the op fails,
    not the worker's communication thread that calls these steps."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OmniReduceError:
            raise
        except Exception as e:
            logger.exception("CUDA data path: %s failed", fn.__name__)
            raise OpError(f"CUDA data path: {fn.__name__} failed: {e!r}") from e

    return wrapper  # type: ignore[return-value]


def is_cuda_tensor(x: Any) -> bool:
    """Whether ``x`` lives on a GPU: a CUDA torch tensor, a numba device array or any
    ``__cuda_array_interface__`` object. Does not import numba.cuda or torch."""
    if is_torch(x):
        return bool(x.is_cuda)
    if isinstance(x, np.ndarray):
        return False
    # Simulator arrays announce themselves with __cuda_ndarray__ only.
    return bool(getattr(x, "__cuda_ndarray__", False)) or hasattr(x, "__cuda_array_interface__")


class PinnedPool:
    """Page-locked host buffers kept for reuse: allocating pinned memory costs far more than a copy.

    Args:
        keep: at most this many free buffers are kept.
    """

    def __init__(self, keep: int = 8) -> None:
        self._free: list[Any] = []
        self._keep = keep
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> Any:
        """A pinned uint8 array of at least ``nbytes`` bytes (sized up to a power of two)."""
        from numba import cuda

        with self._lock:
            # Indices, not list.remove: arrays compare element-wise, not by identity.
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        size = 1 << max(12, (max(nbytes, 1) - 1).bit_length())
        return cuda.pinned_array(size, dtype=np.uint8)

    def release(self, buf: Any) -> None:
        """Returns a buffer; no copy may still be using it."""
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].nbytes))


_pool = PinnedPool()
# The kinds of output whose put kernel CudaOpData._warm_put compiled.
_put_warmed: set[tuple[str, int, int, bool, str]] = set()


def _host_view(buf: Any, n: int, dtype: np.dtype) -> np.ndarray:
    return np.asarray(buf)[: n * dtype.itemsize].view(dtype)


def check_cuda_torch_dtype(x: Any) -> None:
    """Refuses a torch CUDA tensor of a type the device path cannot sum.

    Raises:
        ConfigError: ``x`` is a torch tensor of integers (or bools).
    """
    if is_torch(x) and not x.is_floating_point():
        # Checked before any device work because the kernels see 16-bit integers as
        # bfloat16 bits: an int16 tensor would otherwise be summed as bfloat16.
        raise ConfigError(f"allreduce of a CUDA {x.dtype} tensor is not supported: CUDA tensors may be float32, "
                          "float64, float16 or bfloat16 (integer tensors are summed on the CPU: move it there)")


class _Slot:
    """One result staging slot: pinned ids and payload, their device copies, and the event of the last use."""

    def __init__(self, kc: Any, x: Any, cap: int, block_size: int, storage: np.dtype, stream: Any) -> None:
        self.h_ids_buf = _pool.acquire(cap * 8)
        self.h_pay_buf = _pool.acquire(cap * block_size * storage.itemsize)
        self.h_ids = _host_view(self.h_ids_buf, cap, np.dtype(np.int64))
        self.h_pay = _host_view(self.h_pay_buf, cap * block_size, storage)
        self.d_ids = kc.empty_like_device(x, cap, np.int64, stream)
        self.d_pay = kc.empty_like_device(x, cap * block_size, storage, stream)
        self.event: Any = None


class CudaOpData:
    """The GPU side of one op: where :class:`worker.op.WorkerOp` gets its mask and blocks and puts the results.

    Args:
        x: a contiguous CUDA tensor (torch, numba, or ``__cuda_array_interface__``),
            float32, float64, float16 or bfloat16 (in a non-torch array: its uint16 bits);
            not modified (threshold 0). Integer tensors, and int16 non-torch arrays, are
            refused: their exact sums run on the CPU path only.
        block_size: elements per block.
        threshold: elements with ``|x| <= threshold`` count as zero; a positive one
            zeroes the skipped blocks of ``x`` in place (as OmniReduce does).
        chunk_bytes: bytes per copy chunk.

    Raises:
        ConfigError: ``x`` is not a supported CUDA tensor.
    """

    def __init__(self, x: Any, block_size: int, threshold: float = 0.0, chunk_bytes: int = CHUNK_BYTES) -> None:
        check_cuda_torch_dtype(x)
        from numba import cuda

        from omnireduce.kernels import cuda as kc

        self._cuda = cuda
        self._kc = kc
        self._x = x
        flat, info = kc.as_device_flat(x)
        if not is_torch(x) and flat.dtype == np.int16:
            # The kernels take 16-bit integers as bfloat16 bits (torch's bfloat16 is
            # viewed as int16 above); from a numba array int16 means integers.
            raise ConfigError("allreduce of a CUDA int16 array is not supported: integer arrays are summed on the "
                              "CPU (move it there); bfloat16 bits in a non-torch array must be uint16")
        self._flat_dtype = flat.dtype
        self._shape = tuple(getattr(x, "shape", (flat.shape[0],)))
        self.dtype = _KINDS[info.kind]
        self.length = int(flat.shape[0])
        self.block_size = block_size
        self._storage = np.dtype(self.dtype.storage)
        self._chunk = max(1, chunk_bytes // self._storage.itemsize)
        stream = kc.stream_for(x)
        # A stream of our own for non-torch inputs: numba's streams are
        # blocking, so it still follows work on the legacy default stream.
        self.stream = cuda.stream() if isinstance(stream, int) else stream
        self._slots: list[_Slot] = []
        self._next_slot = 0
        self._finished = False
        nb = -(-self.length // block_size)
        with kc.on_device(x):
            dmask = kc.cuda_block_mask(x, block_size, threshold, stream=self.stream)
            self._mask_buf = _pool.acquire(nb)
            hmask = _host_view(self._mask_buf, nb, np.dtype(np.uint8))
            if nb:
                dmask.copy_to_host(hmask, stream=self.stream)
            self.stream.synchronize()
            #: The nonzero-block mask on the host (bool, one entry per block).
            self.mask = hmask.view(np.bool_)
            self.ids = np.flatnonzero(self.mask)
            _, dblocks = kc.cuda_compact(x, dmask, block_size, stream=self.stream, host_mask=hmask)
            n = int(dblocks.shape[0])
            self._host_buf = _pool.acquire(n * self._storage.itemsize)
            self._host = _host_view(self._host_buf, n, self._storage)
            dsrc = dblocks.view(self._storage)
            # One copy of the compacted bytes, cut in chunks each marked by an event.
            self._chunks: deque[tuple[int, Any]] = deque()
            for a in range(0, n, self._chunk):
                b = min(a + self._chunk, n)
                dsrc[a:b].copy_to_host(self._host[a:b], stream=self.stream)
                ev = cuda.event()
                ev.record(self.stream)
                self._chunks.append((b, ev))
            self._ready = 0
            self._compact = Layout(n, block_size, 1, 1)
            self.out = self._alloc_out()
            self._warm_put()

    def _alloc_out(self) -> Any:
        kc = self._kc
        if is_torch(self._x):
            import torch

            out = torch.empty_like(self._x, memory_format=torch.contiguous_format)
        else:
            out = kc.empty_like_device(self._x, self.length, self._flat_dtype, self.stream).reshape(self._shape)
        kc.cuda_zero(out, stream=self.stream)
        return out

    def _warm_put(self) -> None:
        """Compiles the put kernel that :meth:`scatter` runs on the communication thread here,
        on the caller's: compiling there answers no heartbeat (see :func:`omnireduce.blocks.warm`).

        Once per kind of output; the launch names one block past the last, which the kernel skips.
        """
        # Numba compiles a kernel per device too.
        key = (self._flat_dtype.str, self.block_size, (self.length * self._storage.itemsize) % 8, is_torch(self._x),
               str(getattr(self._x, "device", "")))
        if key in _put_warmed:
            return
        kc, bs = self._kc, self.block_size
        ids = kc.empty_like_device(self._x, 1, np.int64, self.stream)
        ids.copy_to_device(np.array([-(-self.length // bs)], np.int64), stream=self.stream)
        payload = kc.empty_like_device(self._x, bs, self._storage, self.stream)
        kc.cuda_put(self.out, ids, payload, bs, stream=self.stream)
        self.stream.synchronize()
        _put_warmed.add(key)

    def _wait(self, elements: int) -> None:
        while self._ready < elements:
            end, ev = self._chunks.popleft()
            ev.synchronize()
            self._ready = end

    @_device_errors
    def gather(self, ids: np.ndarray, layout: Layout) -> np.ndarray:
        """The payload of blocks ``ids`` (all nonzero here), from the pinned copy.

        Waits only for the chunks that hold them.

        Raises:
            ProtocolError: an id is not one of this tensor's nonzero blocks.
        """
        pos = np.searchsorted(self.ids, ids)
        if len(ids) and (pos.max() >= len(self.ids) or not np.array_equal(self.ids[pos], ids)):
            raise ProtocolError("asked to send a block that is zero on this worker")
        if len(ids):
            self._wait(min((int(pos.max()) + 1) * self.block_size, self._host.shape[0]))
        # A copy, never a view: the pinned buffer goes back to the pool when the
        # op ends, possibly while ZeroMQ still holds a frame sent without copying.
        return blocks.gather(self._host, pos, self._compact)

    @_device_errors
    def scatter(self, ids: np.ndarray, payload: np.ndarray, layout: Layout) -> None:
        """Copies result blocks ``ids`` (wire payload format) to the GPU and writes them into the output."""
        bs = self.block_size
        cap = max(1, self._chunk // bs)
        if len(ids) <= cap:
            self._put(ids, payload, layout)
            return
        # The wire payload stores the short last block short, wherever it is.
        lens = np.where(ids == layout.num_blocks - 1, layout.tail_length, bs)
        offsets = np.concatenate(([0], np.cumsum(lens)))
        for start in range(0, len(ids), cap):
            stop = min(start + cap, len(ids))
            self._put(ids[start:stop], payload[offsets[start] : offsets[stop]], layout)

    def _put(self, ids: np.ndarray, payload: np.ndarray, layout: Layout) -> None:
        cuda, kc = self._cuda, self._kc
        bs = self.block_size
        cap = max(1, self._chunk // bs)
        with kc.on_device(self._x):
            if len(self._slots) < STAGING_SLOTS:
                self._slots.append(_Slot(kc, self._x, cap, bs, self._storage, self.stream))
            slot = self._slots[self._next_slot % len(self._slots)]
            self._next_slot += 1
            if slot.event is not None:
                slot.event.synchronize()
            m = len(ids)
            slot.h_ids[:m] = ids
            slots = slot.h_pay[: m * bs].reshape(m, bs)
            for sl, view in blocks.split_payload(payload, ids, layout):
                slots[sl, : view.shape[1]] = view
            slot.d_ids[:m].copy_to_device(slot.h_ids[:m], stream=self.stream)
            slot.d_pay[: m * bs].copy_to_device(slot.h_pay[: m * bs], stream=self.stream)
            kc.cuda_put(self.out, slot.d_ids[:m], slot.d_pay[: m * bs], bs, stream=self.stream)
            slot.event = cuda.event()
            slot.event.record(self.stream)

    @_device_errors
    def finish(self) -> Any:
        """Waits for the last result copy and returns the output: a torch tensor for a torch
        input (same device, shape and dtype), else a numba device array of the input's shape."""
        if not self._finished:
            self._finished = True
            for slot in self._slots:
                if slot.event is not None:
                    slot.event.synchronize()
            for _, ev in self._chunks:
                ev.synchronize()
            self._chunks.clear()
            for buf in [self._mask_buf, self._host_buf, *(b for s in self._slots for b in (s.h_ids_buf, s.h_pay_buf))]:
                _pool.release(buf)
            self._slots.clear()
        return self.out

