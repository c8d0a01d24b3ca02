"""The Numba CPU kernels (mask with threshold, compaction, scatter) against plain NumPy references.

The references here compare floats as floats (``abs(x) <= t``), independently of
the kernels' bit-pattern arithmetic (:mod:`tests.helpers`, shared with :mod:`tests.test_kernels_cuda`).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from omnireduce import blocks, kernels
from omnireduce.errors import ConfigError
from tests.helpers import (
    make_case,
    ref_compact,
    ref_mask,
    ref_scatter,
    ref_zeroed,
    rounded_threshold,
    same_bits,
    values_of,
)

pytestmark = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba is not installed")

#: Storage dtypes of the element types; uint16 holds bfloat16 bit patterns.
DTYPES = [np.float32, np.float16, np.float64, np.uint16]


CASES = [(n, bs) for n in (0, 1, 7, 255, 256, 257, 1000, 70_001) for bs in (1, 3, 8, 256)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("threshold", [0.0, 1e-3, 0.5, 1e30])
def test_mask_matches_reference(dtype, threshold) -> None:
    # Not hash(): string hashes are salted per process, and a failure must reproduce.
    rng = np.random.default_rng(zlib.crc32(f"{np.dtype(dtype).name}/{threshold}".encode()))
    for n, bs in CASES:
        x = make_case(rng, n, dtype)
        expect = ref_mask(x, bs, threshold)
        for parallel in (True, False):
            y = x.copy()
            got = kernels.block_mask_cpu(y, bs, threshold, parallel=parallel)
            assert got.dtype == np.bool_
            np.testing.assert_array_equal(got, expect, err_msg=f"n={n} bs={bs} parallel={parallel}")
            assert same_bits(y, ref_zeroed(x, expect, bs, threshold)), f"n={n} bs={bs} parallel={parallel}"
        z = x.copy()
        np.testing.assert_array_equal(blocks.block_mask(z, bs, threshold=threshold), expect)
        assert same_bits(z, y)
        z = x.copy()
        np.testing.assert_array_equal(blocks.block_mask_numpy(z, bs, threshold=threshold), expect)
        assert same_bits(z, y)


def test_threshold_is_compared_in_the_element_type() -> None:
    # float32(0.3) is slightly above 0.3, yet |x| <= threshold holds in float32 (as in NumPy and torch).
    x = np.array([0.3, -0.3, 0.0, 0.0, 0.30000004, 0, 0, 0], np.float32)
    np.testing.assert_array_equal(kernels.block_mask_cpu(x, 4, 0.3), [False, True])
    np.testing.assert_array_equal(x[:4], 0)
    # A threshold beyond the type's range leaves Inf and NaN nonzero.
    h = np.array([np.inf, 0, 60000, 1, np.nan, 0], np.float16)
    np.testing.assert_array_equal(kernels.block_mask_cpu(h.copy(), 2, 1e9), [True, False, True])
    bf = np.array([0x7F80, 0x7F7F, 0x3F80, 0x0001], np.uint16)  # inf, max, 1.0, subnormal
    np.testing.assert_array_equal(kernels.block_mask_cpu(bf.copy(), 1, 1e300), [True, False, False, False])
    np.testing.assert_array_equal(kernels.block_mask_cpu(bf.copy(), 1, 0.99), [True, True, True, False])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "x"])
def test_bad_threshold(bad) -> None:
    with pytest.raises(ConfigError):
        kernels.block_mask_cpu(np.zeros(4, np.float32), 2, bad)


def test_threshold_needs_writeable_input() -> None:
    x = np.zeros(8, np.float32)
    x.flags.writeable = False
    np.testing.assert_array_equal(kernels.block_mask_cpu(x, 4), [False, False])
    with pytest.raises(ConfigError):
        kernels.block_mask_cpu(x, 4, 0.5)


def test_bad_inputs() -> None:
    with pytest.raises(ConfigError):
        kernels.block_mask_cpu(np.zeros(4, np.uint32), 2)
    with pytest.raises(ConfigError, match="threshold"):
        kernels.block_mask_cpu(np.zeros(4, np.int32), 2, 0.5)  # integers are summed exactly: no threshold
    with pytest.raises(ConfigError):
        kernels.block_mask_cpu(np.zeros((2, 4), np.float32), 2)
    with pytest.raises(ConfigError):
        kernels.block_mask_cpu(np.zeros(8, np.float32)[::2], 2)
    with pytest.raises(ConfigError):
        kernels.block_mask_cpu(np.zeros(8, np.float32), 0)
    with pytest.raises(ConfigError):
        kernels.compact_cpu(np.zeros(8, np.float32), np.zeros(3, bool), 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_compact_and_scatter_match_reference(dtype) -> None:
    rng = np.random.default_rng(np.dtype(dtype).itemsize)
    for n, bs in CASES:
        x = make_case(rng, n, dtype, density=0.1)
        mask = ref_mask(x, bs)
        ids, payload = kernels.compact_cpu(x, mask, bs)
        rids, rpayload = ref_compact(x, mask, bs)
        np.testing.assert_array_equal(ids, rids)
        assert ids.dtype == np.int64
        assert same_bits(payload, rpayload), f"n={n} bs={bs}"
        out = make_case(rng, n, dtype, density=1.0)  # garbage everywhere: absent blocks must be zeroed
        kernels.scatter_cpu(out, ids, payload, bs)
        assert same_bits(out, ref_scatter(n, ids, payload, bs)), f"n={n} bs={bs}"
        # A uint8 mask works as well as a bool one.
        ids8, _ = kernels.compact_cpu(x, mask.astype(np.uint8), bs)
        np.testing.assert_array_equal(ids8, rids)


def test_scatter_any_order_and_errors() -> None:
    n, bs = 10, 4  # blocks of 4, 4, 2
    payload = np.arange(1, 11, dtype=np.float32)[[4, 5, 6, 7, 0, 1, 2, 3, 8, 9]]
    out = np.full(n, 9, np.float32)
    kernels.scatter_cpu(out, np.array([1, 0, 2]), payload, bs)
    np.testing.assert_array_equal(out, np.arange(1, 11))
    kernels.scatter_cpu(out, np.array([2]), np.array([5, 6], np.float32), bs)
    np.testing.assert_array_equal(out, [0] * 8 + [5, 6])
    with pytest.raises(ConfigError):  # the short block must come last
        kernels.scatter_cpu(out, np.array([2, 0]), np.zeros(6, np.float32), bs)
    with pytest.raises(ConfigError):
        kernels.scatter_cpu(out, np.array([3]), np.zeros(4, np.float32), bs)
    with pytest.raises(ConfigError):
        kernels.scatter_cpu(out, np.array([0]), np.zeros(3, np.float32), bs)
    with pytest.raises(ConfigError):
        kernels.scatter_cpu(out, np.array([0]), np.zeros(4, np.float64), bs)


def test_threshold_bits_orders_like_floats() -> None:
    rng = np.random.default_rng(5)
    for dtype in (np.float32, np.float16, np.float64, np.uint16):
        info = kernels.bits_info(dtype)
        for t in np.concatenate([[0.0, 1e-40, 5e-324, 1.0, 65504.0, 3.4e38], 10.0 ** rng.uniform(-30, 30, 50)]):
            thr = kernels.threshold_bits(float(t), info)
            got = float(values_of(np.array([thr], info.uint).view(np.dtype(dtype)))[0])
            assert got == rounded_threshold(float(t), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_rows_matches_numpy(dtype) -> None:
    rng = np.random.default_rng(7)
    for k, n, width in [(5, 3, 4), (300, 200, 256), (300, 200, 100), (50, 0, 8)]:
        acc = rng.standard_normal((k, 256 if width > 8 else 8)).astype(dtype)
        rows = rng.choice(k, n, replace=False)
        vals = rng.standard_normal((n, width)).astype(dtype)
        expect = acc.copy()
        expect[rows, :width] += vals
        got = acc.copy()
        kernels.add_rows_cpu(got, rows, vals)
        assert same_bits(got, expect), (k, n, width)
        got = acc.copy()
        blocks.add_rows(got, rows, vals)  # whichever path the size picks
        assert same_bits(got, expect), (k, n, width)
    with pytest.raises(ConfigError, match="cannot add rows"):
        kernels.add_rows_cpu(np.zeros((2, 4), dtype), np.arange(2), np.zeros((2, 5), dtype))
    with pytest.raises(ConfigError, match="cannot add rows"):
        kernels.add_rows_cpu(np.zeros((2, 4), np.float32), np.arange(2), np.zeros((2, 4), np.float64))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_mask_of_mostly_dense_tensors(dtype) -> None:
    # Most blocks start nonzero, so the kernel stops at first words; the others must
    # still be read whole: zero-led blocks with a late nonzero, NaN, or only -0.0.
    rng = np.random.default_rng(zlib.crc32(np.dtype(dtype).name.encode()))
    for bs in (4, 8, 256):
        nb = 3000
        x = make_case(rng, nb * bs + 3, dtype, density=1.0)
        blocks_view = x[: nb * bs].reshape(nb, bs)
        picks = rng.choice(nb, 400, replace=False)
        blocks_view[picks[:100]] = 0  # all zero
        blocks_view[picks[100:200], : bs // 2] = 0  # nonzero only late
        nan, neg_zero = (0x7FC0, 0x8000) if dtype is np.uint16 else (np.nan, -0.0)  # bfloat16 as bits
        blocks_view[picks[200:300]] = 0
        blocks_view[picks[200:300], -1] = nan
        blocks_view[picks[300:]] = 0
        blocks_view[picks[300:], 0] = neg_zero
        expect = ref_mask(x, bs)
        assert expect.mean() > 0.8
        np.testing.assert_array_equal(kernels.block_mask_cpu(x, bs, parallel=False), expect, err_msg=f"bs={bs}")
        np.testing.assert_array_equal(blocks.block_mask(x, bs), expect, err_msg=f"bs={bs}")


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("first", [False, True], ids=["streamed", "first-word"])
def test_threaded_word_mask_equals_serial(threads, first) -> None:
    # The word-wise path (8-byte-aligned blocks) in runs of blocks per thread, incl. a short last
    # block and a count of blocks that does not divide by the runs.
    rng = np.random.default_rng(threads)
    bs, nb = 64, 4099
    x = np.zeros(bs * nb + 17, np.float32)
    nonzero = rng.random(nb + 1) < (0.9 if first else 0.05)
    where = rng.integers(0, bs, nb + 1)
    for b in np.flatnonzero(nonzero):
        x[min(b * bs + where[b], x.size - 1)] = -1e-30 if b % 2 else 3.0
    x[bs * 7] = -0.0  # the sign bit alone is zero
    expect = ref_mask(x, bs, 0.0)
    np.testing.assert_array_equal(kernels.block_mask_cpu(x, bs, parallel=False), expect)
    np.testing.assert_array_equal(kernels.block_mask_cpu(x, bs, parallel=threads), expect)


def test_mask_threads_precedence(monkeypatch) -> None:
    from omnireduce import config

    monkeypatch.delenv(config.OMNIREDUCE_MASK_THREADS, raising=False)
    monkeypatch.delenv(config.LOCAL_WORLD_SIZE, raising=False)
    assert config.mask_threads() == 1  # nothing says the cores are free
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv(config.LOCAL_WORLD_SIZE, "4")
    assert config.mask_threads() == 4
    monkeypatch.setenv(config.LOCAL_WORLD_SIZE, "1")
    assert config.mask_threads() == config.MAX_MASK_THREADS
    monkeypatch.setenv(config.LOCAL_WORLD_SIZE, "32")
    assert config.mask_threads() == 1
    monkeypatch.setenv(config.OMNIREDUCE_MASK_THREADS, "3")
    assert config.mask_threads() == 3
    assert config.mask_threads(2) == 2
    for bad in ("0", "x"):
        monkeypatch.setenv(config.OMNIREDUCE_MASK_THREADS, bad)
        with pytest.raises(ConfigError, match="OMNIREDUCE_MASK_THREADS"):
            config.mask_threads()
    with pytest.raises(ConfigError):
        config.mask_threads(0)
