from __future__ import annotations

import numpy as np
import pytest

from omnireduce import blocks, kernels
from omnireduce.dtypes import DType, from_accumulator, to_accumulator
from omnireduce.errors import ConfigError
from omnireduce.layout import INF, Layout
from tests.helpers import sparse

MASKS = [blocks.block_mask_numpy, blocks.block_mask]
if kernels.HAVE_NUMBA:
    MASKS.append(kernels.block_mask_cpu)


@pytest.mark.parametrize("mask_fn", MASKS, ids=lambda f: f.__module__ + "." + f.__name__)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_mask_special_values(mask_fn, dtype) -> None:
    x = np.zeros(4 * 8 + 3, dtype=dtype)
    x[1] = np.nan  # block 0
    x[8 + 7] = -np.inf  # block 1
    x[16:24] = -0.0  # block 2: negative zeros are zero
    x[24 + 3] = np.finfo(dtype).tiny  # block 3: smallest normal
    x[33] = 5  # short last block (3 elements)
    np.testing.assert_array_equal(mask_fn(x, 8), [True, True, False, True, True])


@pytest.mark.parametrize("mask_fn", MASKS)
def test_mask_edges(mask_fn) -> None:
    assert mask_fn(np.zeros(0, np.float32), 256).shape == (0,)
    np.testing.assert_array_equal(mask_fn(np.array([0.0], np.float32), 256), [False])
    np.testing.assert_array_equal(mask_fn(np.array([2.0], np.float32), 256), [True])
    np.testing.assert_array_equal(mask_fn(np.array([-0.0], np.float64), 1), [False])
    denormal = np.array([0, 0, np.float32(1e-45)], np.float32)
    np.testing.assert_array_equal(mask_fn(denormal, 2), [False, True])


def test_mask_bfloat16_bits() -> None:
    bits = np.array([0x0000, 0x8000, 0x3F80, 0x0000, 0x7FC0, 0xFF80], dtype=np.uint16)  # 0,-0 | 1,0 | nan,-inf
    for fn in MASKS:
        np.testing.assert_array_equal(fn(bits, 2), [False, True, True])


@pytest.mark.parametrize("n", [1, 255, 256, 257, 70_000, 1 << 17])
def test_numba_equals_numpy(n) -> None:
    rng = np.random.default_rng(n)
    x = sparse(rng, n, 0.002, block=1, normal=True)
    x[rng.integers(0, n)] = np.nan
    for bs in (1, 7, 256):
        np.testing.assert_array_equal(blocks.block_mask(x, bs), blocks.block_mask_numpy(x, bs))


def test_next_table() -> None:
    layout = Layout(length=10 * 4 - 1, block_size=4, message_blocks=3, streams=1)  # 10 blocks, 3 columns
    mask = np.zeros(10, bool)
    mask[[1, 3, 9]] = True
    t = blocks.next_table(mask, layout)
    assert t.shape == (5, 3)
    # Column 0 holds blocks 0,3,6,9; column 1: 1,4,7; column 2: 2,5,8.
    np.testing.assert_array_equal(t[:, 0], [3, 3, 9, 9, INF])
    np.testing.assert_array_equal(t[:, 1], [1, INF, INF, INF, INF])
    np.testing.assert_array_equal(t[:, 2], [INF] * 5)


@pytest.mark.parametrize("length", [1, 5, 8, 29, 32])
def test_gather_scatter_round_trip(length) -> None:
    layout = Layout(length, block_size=8, message_blocks=2, streams=2)
    x = np.arange(1, length + 1, dtype=np.float32)
    rng = np.random.default_rng(length)
    ids = rng.permutation(layout.num_blocks)[: max(1, layout.num_blocks - 1)]
    payload = blocks.gather(x, ids, layout)
    assert len(payload) == layout.payload_elements(ids)
    out = np.zeros_like(x)
    blocks.scatter(out, ids, payload, layout)
    expect = np.zeros_like(x)
    for b in ids:
        expect[b * 8 : (b + 1) * 8] = x[b * 8 : (b + 1) * 8]
    np.testing.assert_array_equal(out, expect)


def test_layout_streams_and_columns() -> None:
    lay = Layout(length=1000 * 256, block_size=256, message_blocks=64, streams=4)
    assert (lay.num_blocks, lay.num_columns, lay.num_streams) == (1000, 256, 4)
    assert [lay.stream_columns(s) for s in range(4)] == [slice(0, 64), slice(64, 128), slice(128, 192), slice(192, 256)]
    small = Layout(length=300, block_size=256, message_blocks=64, streams=4)
    assert (small.num_blocks, small.num_columns, small.num_streams, small.tail_length) == (2, 2, 1, 44)
    empty = Layout(length=0, block_size=256, message_blocks=64, streams=4)
    assert (empty.num_blocks, empty.num_columns, empty.num_streams) == (0, 0, 1)


def test_bfloat16_accumulator_round_trip() -> None:
    values = np.array([1.0, -2.5, 3.140625, 0.0, -0.0, np.inf, 1e30], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # exact in bfloat16
    np.testing.assert_array_equal(from_accumulator(to_accumulator(bits, DType.BFLOAT16), DType.BFLOAT16), bits)
    # Round to nearest even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 and rounds to 1.
    half = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8], np.float32)
    np.testing.assert_array_equal(from_accumulator(half, DType.BFLOAT16), [0x3F80, 0x3F82])
    nan = from_accumulator(np.array([np.nan], np.float32), DType.BFLOAT16)
    assert np.isnan(to_accumulator(nan, DType.BFLOAT16)[0])


@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 1.0])
def test_next_table_kernel_matches_numpy(density) -> None:
    rng = np.random.default_rng(int(density * 100))
    for nb, mb, streams in [(5000, 7, 3), (102_400, 4096, 8), (4099, 4096, 2), (70_000, 1, 1)]:
        layout = Layout(nb * 256 - 5, 256, mb, streams)
        mask = rng.random(nb) < density
        got = blocks.next_table(mask, layout)
        np.testing.assert_array_equal(got, blocks.next_table_numpy(mask, layout))
        assert got.dtype == np.int64


def test_next_table_refuses_a_mask_of_another_length() -> None:
    layout = Layout(100_000, 4, 64, 2)
    with pytest.raises(ConfigError, match="mask has"):
        blocks.next_table(np.zeros(layout.num_blocks + 1, bool), layout)


def test_gather_view_and_scatter_slice_for_consecutive_blocks() -> None:
    layout = Layout(10 * 8 + 3, 8, 4, 2)  # 11 blocks, the last one 3 elements
    x = np.arange(layout.length, dtype=np.float32)
    for ids in (np.array([2, 3, 4]), np.array([8, 9, 10]), np.array([5])):
        view = blocks.gather(x, ids, layout, copy=False)
        assert np.shares_memory(view, x)
        np.testing.assert_array_equal(view, blocks.gather(x, ids, layout))
        out = np.zeros_like(x)
        blocks.scatter(out, ids, view, layout)
        ref = np.zeros_like(x)
        for i in ids:
            ref[i * 8 : (i + 1) * 8] = x[i * 8 : (i + 1) * 8]
        np.testing.assert_array_equal(out, ref)
    for ids in (np.array([4, 2, 3]), np.array([1, 3]), np.array([0, 2, 1, 3])):
        assert not np.shares_memory(blocks.gather(x, ids, layout, copy=False), x)
    assert blocks.contiguous_start(np.array([7, 8, 9])) == 7
    assert blocks.contiguous_start(np.array([9, 7, 8])) is None
    assert blocks.contiguous_start(np.array([], dtype=np.int64)) is None


_WARM_CASES = """
import itertools, numpy as np
from omnireduce import blocks
from omnireduce.kernels import cpu
from omnireduce.layout import Layout

def compiled():
    return sum(len(k.signatures) for k in vars(cpu).values() if hasattr(k, "signatures"))

kinds = itertools.product([np.float32, np.float16, np.float64, np.int8, np.int64], [256, 3], [0, 1], [True, False])
for dtype, block_size, offset, writeable in kinds:
    # Unaligned, read-only or odd-sized: warm compiles (or loads) the kernels of the pass block_mask takes.
    flat = np.zeros((1 << 16) + 7, dtype)[offset:]
    flat[::997] = 1
    flat.flags.writeable = writeable
    blocks.warm(flat, block_size)
    before = compiled()
    blocks.warm(flat, block_size)
    mask = blocks.block_mask(flat, block_size)
    assert (mask == blocks.block_mask_numpy(flat, block_size)).all()
    blocks.next_table(mask, Layout(len(flat), block_size, 4, 2))
    # Nothing compiles or loads now, on what would be an op's communication thread.
    assert compiled() == before, (dtype, block_size, offset, writeable)
print("warm")
"""


def test_warm_takes_every_kind_of_flat_tensor() -> None:
    import subprocess
    import sys

    from tests.helpers import child_env

    # A process of its own: in this one, other tests compiled the kernels already.
    out = subprocess.run([sys.executable, "-c", _WARM_CASES], capture_output=True, text=True, timeout=300,
                         env=child_env())
    assert out.returncode == 0 and "warm" in out.stdout, out.stderr[-3000:]
