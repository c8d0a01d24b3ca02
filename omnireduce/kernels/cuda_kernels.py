"""The Numba CUDA kernels behind :mod:`omnireduce.kernels.cuda` (device code only).

Each factory is cached by its launch geometry, which the kernels need as
compile-time constants (shared and local array sizes, unrolled loops). Only
block-level primitives are used (``syncthreads``, shared memory, shared
atomics), no warp intrinsics, so the kernels also run under the CUDA simulator.
Index arithmetic uses ``shift`` (log2 of the words per block, or -1) to avoid
integer division for power-of-two block sizes.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numba
from numba import cuda

logger = logging.getLogger(__name__)

__all__ = [
    "mask_kernel",
    "count_kernel",
    "scan_kernel",
    "write_kernel",
    "gather_kernel",
    "scatter_kernel",
    "put_kernel",
    "fill_kernel",
    "positions_kernel",
]

_NB_WORDS = {1: numba.uint8, 2: numba.uint16, 4: numba.uint32, 8: numba.uint64}


@cuda.jit(device=True)
def _block_exclusive_scan(sh, t, v, threads):  # type: ignore[no-untyped-def]
    # Hillis-Steele over one value per thread: log2(threads) rounds, each
    # between barriers; sh has one int64 slot per thread.
    sh[t] = v
    cuda.syncthreads()
    off = 1
    while off < threads:
        x = sh[t - off] if t >= off else 0
        cuda.syncthreads()
        sh[t] += x
        cuda.syncthreads()
        off *= 2
    incl = sh[t]
    total = sh[threads - 1]
    cuda.syncthreads()
    return incl - v, total


@functools.cache
def mask_kernel(threads: int, items: int, thresh: bool) -> Any:
    flag_slots = threads * items

    @cuda.jit
    def mask_kernel(words, nwords, nb, wpb, shift, dblocks, lanes, lane_bits, lane_mask, packed_mask, thr, out):  # type: ignore[no-untyped-def]
        # One tile of dblocks whole data blocks per CUDA block, so a data block
        # never spans two CUDA blocks and needs no cross-block reduction.
        flags = cuda.shared.array(flag_slots, numba.uint8)
        t = cuda.threadIdx.x
        b0 = cuda.blockIdx.x * dblocks
        b1 = min(b0 + dblocks, nb)
        w0 = b0 * wpb
        w1 = min(b1 * wpb, nwords)
        for i in range(t, b1 - b0, threads):
            flags[i] = 0
        cuda.syncthreads()
        base = w0
        while base < w1:
            # All loads of a pass first, tested into a bit mask in registers:
            # no store between them, so they are all in flight at once.
            hits = 0
            for k in range(items):
                w = base + k * threads + t
                if w < w1:
                    v = numba.uint64(words[w])
                    if thresh:
                        hit = False
                        for lane in range(lanes):
                            hit |= ((v >> numba.uint64(lane * lane_bits)) & lane_mask) > thr
                    else:
                        hit = (v & packed_mask) != numba.uint64(0)
                    if hit:
                        hits |= 1 << k
            if hits:
                for k in range(items):
                    if hits & (1 << k):
                        off = base + k * threads + t - w0
                        flags[(off >> shift) if shift >= 0 else off // wpb] = 1
            base += threads * items
        cuda.syncthreads()
        for i in range(t, b1 - b0, threads):
            out[b0 + i] = flags[i]
        if thresh:
            # As OmniReduce's kernel: a block below the threshold is zeroed in
            # place, so the tensor left behind agrees with what was skipped.
            for w in range(w0 + t, w1, threads):
                off = w - w0
                if flags[(off >> shift) if shift >= 0 else off // wpb] == 0:
                    words[w] = 0

    return mask_kernel


@functools.cache
def count_kernel(threads: int, items: int) -> Any:
    @cuda.jit
    def count_kernel(mask, counts):  # type: ignore[no-untyped-def]
        total = cuda.shared.array(1, numba.int64)
        t = cuda.threadIdx.x
        if t == 0:
            total[0] = 0
        cuda.syncthreads()
        start = (cuda.blockIdx.x * threads + t) * items
        c = 0
        for i in range(start, min(start + items, mask.shape[0])):
            if mask[i] != 0:
                c += 1
        if c:
            cuda.atomic.add(total, 0, c)
        cuda.syncthreads()
        if t == 0:
            counts[cuda.blockIdx.x] = total[0]

    return count_kernel


@functools.cache
def scan_kernel(threads: int, items: int) -> Any:
    @cuda.jit
    def scan_kernel(counts, offsets):  # type: ignore[no-untyped-def]
        # One CUDA block walks all tile counts: there are few (one per
        # threads * items mask entries), and it saves a multi-level scan.
        sh = cuda.shared.array(threads, numba.int64)
        t = cuda.threadIdx.x
        n = counts.shape[0]
        carry = 0
        for base in range(0, n, threads * items):
            start = base + t * items
            end = min(start + items, n)
            s = 0
            for i in range(start, end):
                s += counts[i]
            excl, total = _block_exclusive_scan(sh, t, s, threads)
            run = carry + excl
            for i in range(start, end):
                offsets[i] = run
                run += counts[i]
            carry += total
        if t == 0:
            offsets[n] = carry

    return scan_kernel


@functools.cache
def write_kernel(threads: int, items: int) -> Any:
    @cuda.jit
    def write_kernel(mask, offsets, indices):  # type: ignore[no-untyped-def]
        sh = cuda.shared.array(threads, numba.int64)
        t = cuda.threadIdx.x
        start = (cuda.blockIdx.x * threads + t) * items
        end = min(start + items, mask.shape[0])
        c = 0
        for i in range(start, end):
            if mask[i] != 0:
                c += 1
        excl, _ = _block_exclusive_scan(sh, t, c, threads)
        k = offsets[cuda.blockIdx.x] + excl
        for i in range(start, end):
            if mask[i] != 0:
                indices[k] = i
                k += 1

    return write_kernel


@functools.cache
def gather_kernel(threads: int, items: int, itemsize: int) -> Any:
    word = _NB_WORDS[itemsize]

    @cuda.jit
    def gather_kernel(src, indices, dst, wpb, shift):  # type: ignore[no-untyped-def]
        vals = cuda.local.array(items, word)
        t = cuda.threadIdx.x
        base = cuda.blockIdx.x * threads * items
        n = dst.shape[0]
        # Loads into registers first, stores after, so the loads overlap.
        for k in range(items):
            j = base + k * threads + t
            if j < n:
                p = (j >> shift) if shift >= 0 else j // wpb
                vals[k] = src[indices[p] * wpb + (j - p * wpb)]
        for k in range(items):
            j = base + k * threads + t
            if j < n:
                dst[j] = vals[k]

    return gather_kernel


@functools.cache
def scatter_kernel(threads: int, items: int, itemsize: int) -> Any:
    word = _NB_WORDS[itemsize]

    @cuda.jit
    def scatter_kernel(out, pos, payload, wpb, shift):  # type: ignore[no-untyped-def]
        vals = cuda.local.array(items, word)
        t = cuda.threadIdx.x
        base = cuda.blockIdx.x * threads * items
        n = out.shape[0]
        for k in range(items):
            w = base + k * threads + t
            vals[k] = 0
            if w < n:
                b = (w >> shift) if shift >= 0 else w // wpb
                p = pos[b]
                if p >= 0:
                    vals[k] = payload[p * wpb + (w - b * wpb)]
        for k in range(items):
            w = base + k * threads + t
            if w < n:
                out[w] = vals[k]

    return scatter_kernel


@functools.cache
def put_kernel(threads: int, items: int, itemsize: int) -> Any:
    word = _NB_WORDS[itemsize]

    @cuda.jit
    def put_kernel(out, indices, payload, wpb, shift):  # type: ignore[no-untyped-def]
        # One block_size slot per index; the short last block of out only takes
        # the words it has. Blocks not named are left as they are.
        vals = cuda.local.array(items, word)
        t = cuda.threadIdx.x
        base = cuda.blockIdx.x * threads * items
        n = payload.shape[0]
        nout = out.shape[0]
        for k in range(items):
            j = base + k * threads + t
            if j < n:
                vals[k] = payload[j]
        for k in range(items):
            j = base + k * threads + t
            if j < n:
                p = (j >> shift) if shift >= 0 else j // wpb
                b = indices[p]
                w = b * wpb + (j - p * wpb)
                if b >= 0 and w < nout:
                    out[w] = vals[k]

    return put_kernel


@cuda.jit
def fill_kernel(arr, value):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < arr.shape[0]:
        arr[i] = value


@cuda.jit
def positions_kernel(indices, pos):  # type: ignore[no-untyped-def]
    # Out-of-range indices are dropped rather than written out of bounds.
    p = cuda.grid(1)
    if p < indices.shape[0]:
        b = indices[p]
        if 0 <= b < pos.shape[0]:
            pos[b] = p
