"""The Numba CUDA kernels and the CUDA data path (:mod:`worker.cuda`) against the NumPy references.

How the simulator runs: numba decides once, when it is first imported, whether
``numba.cuda`` is the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``). The rest of
the suite imports numba in the same pytest process long before this file, so
setting the variable here would be too late (and would hide a real GPU).
Instead :func:`test_kernels_under_the_simulator` runs this same file in a child
``python -m pytest`` with the variable set in its environment, and fails if the
child fails or runs fewer kernel tests than expected. In the child (and on a
machine with a GPU) the kernel tests below run in-process; in the parent without
a GPU they skip, saying why. Simulated inputs stay small: the simulator runs
every CUDA thread as a Python thread.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omnireduce import blocks, kernels
from omnireduce.errors import ConfigError, ProtocolError
from omnireduce.layout import Layout
from tests.helpers import make_case, ref_compact, ref_mask, ref_scatter, ref_zeroed, same_bits, sparse

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM", "") not in ("", "0")
ROOT = Path(__file__).resolve().parent.parent
#: Kernel tests the simulator child must pass (all tests below but the GPU-only ones).
MIN_SIMULATED_PASSES = 13


def _gpu_skip_reason() -> str | None:
    try:
        from numba import cuda
    except ImportError as e:  # numba-cuda missing
        return f"numba.cuda cannot be imported ({e}); pip install numba-cuda"
    if SIMULATED:
        return None
    if not cuda.is_available():
        return "no CUDA GPU (numba.cuda.is_available() is False); the simulator child covers these kernels"
    return None


_REASON = _gpu_skip_reason()
#: Tests that run on a real GPU or under the simulator.
on_device = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
#: Tests that need a real GPU (sizes or torch CUDA tensors the simulator cannot take).
requires_gpu = pytest.mark.skipif(
    SIMULATED or _REASON is not None, reason=_REASON or "needs a real GPU, not the simulator"
)


@pytest.mark.skipif(SIMULATED, reason="this is the simulator child itself")
def test_kernels_under_the_simulator() -> None:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        # --noconftest: these tests need no fixture of it, and a GPU image may lack its imports (pyzmq).
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-rs",
         str(Path(__file__).relative_to(ROOT))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= MIN_SIMULATED_PASSES, out[-3000:]


@pytest.fixture
def cuda():
    from numba import cuda

    return cuda


@pytest.fixture
def kc():
    from omnireduce.kernels import cuda as kc

    return kc


@pytest.fixture
def small_launch(kc):
    """A small launch geometry: many tiles on a small input, and a fast simulator."""
    old = kc.launch_config()
    kc.set_launch_config(kc.LaunchConfig(threads=16, items=8, copy_items=8, scan_items=8))
    yield
    kc.set_launch_config(old)


def _check(cuda, kc, x: np.ndarray, bs: int, threshold: float) -> None:
    d = cuda.to_device(x)
    expect = ref_mask(x, bs, threshold)
    mask = kc.cuda_block_mask(d, bs, threshold)
    hmask = mask.copy_to_host()
    assert hmask.dtype == np.uint8
    np.testing.assert_array_equal(hmask, expect.astype(np.uint8), err_msg=f"n={len(x)} bs={bs} t={threshold}")
    left = ref_zeroed(x, expect, bs, threshold)
    assert same_bits(d.copy_to_host(), left), f"in-place zeroing n={len(x)} bs={bs}"
    ids, payload = kc.cuda_compact(d, mask, bs)
    rids, rpayload = ref_compact(left, expect, bs)
    np.testing.assert_array_equal(ids.copy_to_host(), rids)
    assert same_bits(payload.copy_to_host(), rpayload), f"compact n={len(x)} bs={bs}"
    out = cuda.to_device(make_case(np.random.default_rng(1), len(x), x.dtype.type, density=1.0))
    kc.cuda_scatter(out, ids, payload, bs)
    assert same_bits(out.copy_to_host(), ref_scatter(len(x), rids, rpayload, bs)), f"scatter n={len(x)} bs={bs}"


@on_device
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16], ids=lambda d: np.dtype(d).name)
def test_kernels_match_reference(cuda, kc, small_launch, dtype) -> None:
    rng = np.random.default_rng(np.dtype(dtype).itemsize)
    # Empty; one element; partial last blocks read one element per word (37, 1001)
    # and as packed 8-byte words (1004: 4-element tail); block size 1 over many
    # tiles; thresholds on both word paths.
    cases = [(0, 4, 0.0), (1, 8, 0.0), (37, 4, 0.0), (300, 1, 0.0), (1001, 8, 1e-3), (1004, 8, 0.0), (1024, 64, 0.5)]
    for n, bs, t in cases:
        _check(cuda, kc, make_case(rng, n, dtype, density=0.03), bs, t)


@on_device
def test_default_launch_geometry(cuda, kc) -> None:
    rng = np.random.default_rng(7)
    for dtype, n, bs, t in [(np.float32, 2000, 256, 0.0), (np.float64, 301, 8, 0.1)]:
        _check(cuda, kc, make_case(rng, n, dtype, density=0.02), bs, t)


@on_device
def test_tiny_launch_geometry(cuda, kc) -> None:
    """3 threads of 1 scan entry: the single-block scan carries its sum over many chunks,
    and the scans run on a thread count that is not a power of two."""
    old = kc.launch_config()
    kc.set_launch_config(kc.LaunchConfig(threads=3, items=2, copy_items=2, scan_items=1))
    try:
        rng = np.random.default_rng(9)
        for n, bs in [(40, 1), (50, 4)]:
            x = make_case(rng, n, np.float32, density=0.3)
            _check(cuda, kc, x, bs, 0.0)
    finally:
        kc.set_launch_config(old)


@on_device
def test_dense_and_all_zero(cuda, kc, small_launch) -> None:
    for x in (np.zeros(200, np.float32), -np.zeros(200, np.float32), np.ones(200, np.float32)):
        _check(cuda, kc, x, 9, 0.0)
    # Inf and NaN stay nonzero whatever the threshold; -0.0 and sub-threshold values are zero.
    x = np.array([np.inf, 0, 0, 0, -0.0, 0.25, 0, 0, 0, 0, 0, np.nan, 3, 0, 0, 0], np.float32)
    d = cuda.to_device(x)
    np.testing.assert_array_equal(kc.cuda_block_mask(d, 4, 0.25).copy_to_host(), [1, 0, 1, 1])
    np.testing.assert_array_equal(d.copy_to_host()[4:8], 0)


@on_device
def test_scatter_accepts_padded_slots_in_any_order(cuda, kc, small_launch) -> None:
    n, bs = 10, 4  # blocks of 4, 4, 2; the short one staged in a full slot, first
    payload = np.array([9, 10, 0, 0, 1, 2, 3, 4], np.float32)
    out = cuda.to_device(np.full(n, 7, np.float32))
    kc.cuda_scatter(out, cuda.to_device(np.array([2, 0])), cuda.to_device(payload), bs)
    np.testing.assert_array_equal(out.copy_to_host(), [1, 2, 3, 4, 0, 0, 0, 0, 9, 10])
    kc.cuda_put(out, cuda.to_device(np.array([1])), cuda.to_device(np.full(4, 5, np.float32)), bs)
    np.testing.assert_array_equal(out.copy_to_host(), [1, 2, 3, 4, 5, 5, 5, 5, 9, 10])
    kc.cuda_zero(out)
    np.testing.assert_array_equal(out.copy_to_host(), 0)


@on_device
def test_bad_inputs(cuda, kc) -> None:
    d = cuda.to_device(np.zeros(8, np.float32))
    with pytest.raises(ConfigError):
        kc.cuda_block_mask(np.zeros(8, np.float32), 4)  # host array
    with pytest.raises(ConfigError):
        kc.cuda_block_mask(cuda.to_device(np.zeros(8, np.int32)), 4)
    with pytest.raises(ConfigError):
        kc.cuda_block_mask(d, 0)
    with pytest.raises(ConfigError):
        kc.cuda_block_mask(d, 4, -1.0)
    with pytest.raises(ConfigError):
        kc.cuda_compact(d, cuda.to_device(np.zeros(3, np.uint8)), 4)
    with pytest.raises(ConfigError):
        kc.cuda_scatter(d, cuda.to_device(np.array([0])), cuda.to_device(np.zeros(3, np.float32)), 4)


@on_device
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16], ids=lambda d: np.dtype(d).name)
def test_cuda_op_data(cuda, kc, small_launch, dtype) -> None:
    from worker.cuda import CudaOpData, is_cuda_tensor

    rng = np.random.default_rng(11)
    n, bs = 603, 16  # short last block of 11
    x = make_case(rng, n, dtype, density=0.03)
    x[-1] = 1  # the short block is sent, so its chunk is exercised
    d = cuda.to_device(x)
    assert is_cuda_tensor(d) and not is_cuda_tensor(x)
    data = CudaOpData(d, bs, chunk_bytes=256)  # several copy chunks and a full ring of staging slots
    # The put kernel compiled (on this thread) by a launch that wrote nothing.
    assert not data.out.copy_to_host().view(np.uint8).any()
    layout = Layout(n, bs, 5, 2)
    np.testing.assert_array_equal(data.mask, ref_mask(x, bs))
    nz = np.flatnonzero(data.mask)
    assert nz[-1] == layout.num_blocks - 1 and not data.mask.all()
    for ids in (nz[::-1], rng.permutation(nz)[:5], nz[:0]):
        assert same_bits(data.gather(ids, layout), blocks.gather(x, ids, layout))
    with pytest.raises(ProtocolError):
        data.gather(np.flatnonzero(~data.mask)[:1], layout)
    y = make_case(rng, n, dtype, density=1.0)
    result = rng.permutation(layout.num_blocks)[: layout.num_blocks // 2]
    result = np.append(result, layout.num_blocks - 1)
    expect = np.zeros_like(y)
    for part in np.array_split(rng.permutation(result), 4):  # the short block anywhere in a message
        payload = blocks.gather(y, part, layout)
        data.scatter(part, payload, layout)
        blocks.scatter(expect, part, payload, layout)
    out = data.finish()
    assert same_bits(out.copy_to_host(), expect)
    assert same_bits(d.copy_to_host(), x)  # the input is left alone


@on_device
def test_cuda_op_data_refuses_an_int16_array(cuda, kc) -> None:
    from worker.cuda import CudaOpData

    # int16 is how the kernels see torch's bfloat16; a numba int16 array holds
    # integers, which would be summed as bfloat16 bits (2 + 3 -> 0).
    with pytest.raises(ConfigError, match="CUDA int16 array"):
        CudaOpData(cuda.to_device(np.array([2, 0, 0, 0], np.int16)), 4)


@on_device
def test_cuda_op_data_empty(cuda, kc) -> None:
    from worker.cuda import CudaOpData

    data = CudaOpData(cuda.to_device(np.zeros(0, np.float32)), 8)
    assert data.mask.shape == (0,) and data.length == 0
    assert data.finish().copy_to_host().shape == (0,)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16], ids=lambda d: np.dtype(d).name)
def test_large_on_gpu(cuda, kc, dtype) -> None:
    rng = np.random.default_rng(3)
    for n, bs, t in [(10_000_019, 256, 0.0), (1 << 24, 256, 0.1), (3_000_001, 1, 0.0), (1 << 22, 4096, 0.0)]:
        x = make_case(rng, n, dtype, density=0.001)
        d = cuda.to_device(x)
        y = x.copy()
        expect = kernels.block_mask_cpu(y, bs, t)
        mask = kc.cuda_block_mask(d, bs, t)
        np.testing.assert_array_equal(mask.copy_to_host().astype(bool), expect)
        assert same_bits(d.copy_to_host(), y)
        ids, payload = kc.cuda_compact(d, mask, bs)
        rids, rpayload = kernels.compact_cpu(y, expect, bs)
        np.testing.assert_array_equal(ids.copy_to_host(), rids)
        assert same_bits(payload.copy_to_host(), rpayload)


@pytest.mark.gpu
@requires_gpu
def test_torch_cuda_tensors() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from omnireduce.kernels import cuda as kc
    from worker.cuda import CudaOpData

    class Wrapped:  # only the interface, as cupy or any other library would offer
        def __init__(self, t):
            self.__cuda_array_interface__ = t.__cuda_array_interface__

    rng = np.random.default_rng(5)
    for tdtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.from_numpy(make_case(rng, 100_003, np.float32, density=0.01)).to(tdtype).cuda()
        bits = x.view(torch.int16).cpu().numpy().view(np.uint16) if tdtype == torch.bfloat16 else x.cpu().numpy()
        expect = ref_mask(bits, 256)
        mask = kernels.cuda_block_mask(x, 256)
        np.testing.assert_array_equal(torch.as_tensor(mask, device="cuda").cpu().numpy().astype(bool), expect)
        if tdtype != torch.bfloat16:
            np.testing.assert_array_equal(kc.cuda_block_mask(Wrapped(x), 256).copy_to_host().astype(bool), expect)
        ids, _ = kernels.cuda_compact(x, mask, 256)
        np.testing.assert_array_equal(ids.copy_to_host(), np.flatnonzero(expect))
        data = CudaOpData(x, 256)
        layout = Layout(x.numel(), 256, 256, 4)
        nz = np.flatnonzero(data.mask)
        data.scatter(nz, data.gather(nz, layout), layout)
        out = data.finish()
        assert isinstance(out, torch.Tensor) and out.dtype == tdtype and out.shape == x.shape
        assert torch.equal(out.view(torch.int16) if tdtype == torch.bfloat16 else out,
                           x.view(torch.int16) if tdtype == torch.bfloat16 else x)


def _nvvm_skip_reason() -> str | None:
    if SIMULATED:
        return "the simulator does not compile PTX"
    if _REASON is not None and not _REASON.startswith("no CUDA GPU"):
        return _REASON
    from numba import cuda

    def probe(a):  # type: ignore[no-untyped-def]
        a[0] = 1

    try:
        cuda.compile_ptx(probe, "void(int64[::1])", cc=(9, 0))
    except Exception as e:  # noqa: BLE001 - whatever the toolkit lookup raises means "no NVVM"
        return f"libNVVM not found ({type(e).__name__}); pip install 'numba-cuda[cu13]' compiles PTX without a GPU"
    return None


def test_kernels_compile_for_sm90(monkeypatch) -> None:
    """Every kernel, with the argument types the host code passes, compiles for the real CUDA target.

    Needs libNVVM (numba-cuda's cu12/cu13 extra), not a GPU: it checks the typing
    that the simulator, which runs the kernels as Python, does not.
    """
    reason = _nvvm_skip_reason()
    if reason:
        pytest.skip(reason)
    from numba import cuda
    from numba import types as T

    from omnireduce.kernels import cuda_kernels as ck

    if not cuda.is_available():
        # Device functions are compiled for the current device's capability.
        from numba.cuda import dispatcher

        class _Device:
            compute_capability = (9, 0)

        monkeypatch.setattr(dispatcher, "get_current_device", lambda: _Device())
    i64, u64 = T.int64, T.uint64

    def arr(t):  # type: ignore[no-untyped-def]
        return T.Array(t, 1, "C")

    def compile_(kernel, *sig):  # type: ignore[no-untyped-def]
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
        assert ".entry" in ptx

    from omnireduce.kernels import cuda as kc

    launch = kc.launch_config()
    cfg = (launch.threads, launch.items, launch.copy_items, launch.scan_items)
    for word, size in ((T.uint64, 8), (T.uint32, 4), (T.uint16, 2)):
        for thresh in (False, True):
            compile_(ck.mask_kernel(cfg[0], cfg[1], thresh), arr(word), *[i64] * 7, u64, u64, u64, arr(T.uint8))
        for factory in (ck.gather_kernel, ck.scatter_kernel, ck.put_kernel):
            compile_(factory(cfg[0], cfg[2], size), arr(word), arr(i64), arr(word), i64, i64)
        compile_(ck.fill_kernel, arr(word), word)
    compile_(ck.count_kernel(cfg[0], cfg[3]), arr(T.uint8), arr(i64))
    compile_(ck.scan_kernel(cfg[0], cfg[3]), arr(i64), arr(i64))
    compile_(ck.write_kernel(cfg[0], cfg[3]), arr(T.uint8), arr(i64), arr(i64))
    compile_(ck.fill_kernel, arr(i64), i64)
    compile_(ck.positions_kernel, arr(i64), arr(i64))


@on_device
def test_pinned_pool_reuses_by_identity() -> None:
    from worker.cuda import PinnedPool

    pool = PinnedPool(keep=2)
    a, b, c = pool.acquire(5000), pool.acquire(100), pool.acquire(100_000)
    assert a.nbytes >= 5000 and b.nbytes >= 100 and c.nbytes >= 100_000
    for buf in (c, a, b):
        pool.release(buf)  # keeps the two largest
    got = pool.acquire(3000)
    assert got is a  # the smallest kept buffer that fits, found by identity
    assert pool.acquire(50_000) is c
    assert pool.acquire(10) is not b


@on_device
def test_worker_allreduce_of_a_cuda_tensor(cuda, kc, small_launch) -> None:
    """Rank 0 sends a device array through Worker.allreduce, rank 1 a NumPy array: exact sums on both.

    One device rank only: the simulator is not thread-safe across host threads.
    """
    from aggregator import Aggregator
    from tests.helpers import run_ranks
    from worker.client import Worker

    rng = np.random.default_rng(2)
    n, bs = 1500, 16
    xs = [sparse(rng, n, 0.03, block=1, low=-5, high=5) for _ in range(2)]
    agg = Aggregator(listen="tcp://127.0.0.1:0", timeout=60).start()
    try:
        def run(r: int) -> Any:
            with Worker(agg.address, rank=r, world_size=2, job="cuda", block_size=bs,
                        message_blocks=4, streams=2, timeout=60) as w:
                return w.allreduce(cuda.to_device(xs[0]) if r == 0 else xs[1])

        outs = run_ranks(2, run, timeout=120)
    finally:
        agg.close()
    expect = xs[0] + xs[1]
    np.testing.assert_array_equal(outs[0].copy_to_host(), expect)
    np.testing.assert_array_equal(outs[1], expect)
