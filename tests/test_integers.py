"""Exact integer allreduce: wire types, zero-block detection, the aggregator's int64 sums and their wraparound."""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np
import pytest

from aggregator import Aggregator
from aggregator.engine import Engine
from omnireduce import blocks, kernels
from omnireduce.dtypes import DType, from_accumulator, to_accumulator
from omnireduce.errors import ConfigError, MismatchError, PeerRefusedError, ProtocolError
from omnireduce.layout import Layout
from omnireduce.protocol import Error, ErrorCode, Start, decode, encode
from tests.conftest import run_ranks
from tests.loopback import peer_of, run_allreduce, wire
from worker import Worker, connect
from worker.op import WorkerOp

INTS = [np.int8, np.uint8, np.int16, np.int32, np.int64]
_IDS = {"ids": lambda d: np.dtype(d).name}


def _ints(rng: np.random.Generator, n: int, dtype: Any, density: float, block: int) -> np.ndarray:
    """Full-range random values in a ``density`` fraction of the blocks (sums overflow)."""
    info = np.iinfo(dtype)
    nb = -(-n // block)
    x = np.zeros(nb * block, dtype)
    keep = rng.random(nb) < density
    x.reshape(nb, block)[keep] = rng.integers(info.min, info.max, (int(keep.sum()), block), dtype, endpoint=True)
    return x[:n]


def _wrapped_sum(xs: list[np.ndarray]) -> np.ndarray:
    """The elementwise sum wrapped to the inputs' type, computed in unsigned 64-bit (mod 2**64)."""
    dtype = xs[0].dtype
    total = np.zeros(xs[0].shape, np.uint64)
    for x in xs:
        total += x.astype(np.int64).view(np.uint64)  # sign-extended: congruent mod 2**64
    return total.view(np.int64).astype(dtype)


def _nonzero_blocks(x: np.ndarray, block: int) -> np.ndarray:
    padded = np.zeros(-(-len(x) // block) * block, x.dtype)
    padded[: len(x)] = x
    return padded.reshape(-1, block).any(axis=1)


# Types.


def test_wire_codes_and_types() -> None:
    codes = {DType.INT32: 5, DType.INT64: 6, DType.INT8: 7, DType.UINT8: 8, DType.INT16: 9}
    for d, code in codes.items():
        assert int(d) == code and d.is_integer
        assert d.accumulator == np.int64 and d.itemsize == d.storage.itemsize
        assert DType.of_numpy(d.storage) is d
    assert not any(d.is_integer for d in (DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16))
    assert DType.of_numpy(np.dtype(np.longlong)) is DType.INT64
    for unsupported in (np.uint16, np.uint32, np.uint64, np.bool_, np.complex64):
        with pytest.raises(KeyError):
            DType.of_numpy(unsupported)
    # The protocol takes the new codes, and still refuses unknown ones.
    for d in codes:
        msg, _ = decode(wire(encode(Start("j", 0, 2, 0, 10, int(d), 256, 1, 1))))
        assert msg.dtype == int(d)
    with pytest.raises(ProtocolError, match="dtype"):
        decode(wire(encode(Start("j", 0, 2, 0, 10, 10, 256, 1, 1))))


@pytest.mark.parametrize("dtype", INTS, **_IDS)
def test_accumulator_round_trip_wraps(dtype: Any) -> None:
    info = np.iinfo(dtype)
    d = DType.of_numpy(dtype)
    x = np.array([info.min, -1 if info.min else 0, 0, 1, info.max], dtype)
    acc = to_accumulator(x, d)
    assert acc.dtype == np.int64 and not np.shares_memory(acc, x)
    np.testing.assert_array_equal(from_accumulator(acc, d), x)
    # max + 1 wraps to min, min - 1 to max, as a sum in the type itself does (for int64 the
    # accumulator's own addition wraps; for the narrower types the narrowing does).
    acc = to_accumulator(np.array([info.max, info.min], dtype), d) + np.array([1, -1], np.int64)
    np.testing.assert_array_equal(from_accumulator(acc, d), np.array([info.min, info.max], dtype))


# Zero blocks and kernels.


@pytest.mark.parametrize("dtype", INTS, **_IDS)
@pytest.mark.parametrize("n,block", [(1000, 8), (999, 7), (1 << 17, 256), ((1 << 17) + 5, 13)])
def test_mask_sees_every_nonzero_integer(dtype: Any, n: int, block: int) -> None:
    """Each nonzero block holds one element, often the one with only the sign bit set
    (int16's -32768 is bfloat16's -0.0 pattern: it must count as nonzero here)."""
    rng = np.random.default_rng(n + block)
    info = np.iinfo(dtype)
    x = np.zeros(n, dtype)
    nb = -(-n // block)
    hit = np.flatnonzero(rng.random(nb) < 0.2)
    pos = np.minimum(hit * block + rng.integers(0, block, len(hit)), n - 1)
    x[pos] = rng.choice(np.array([info.min, 1, info.max, -1 if info.min else 2], dtype=dtype), len(pos))
    x[-1] = info.min if info.min else info.max  # the short last block too
    expect = _nonzero_blocks(x, block)
    np.testing.assert_array_equal(blocks.block_mask(x, block), expect)
    np.testing.assert_array_equal(blocks.block_mask_numpy(x, block), expect)
    np.testing.assert_array_equal(kernels.block_mask_cpu(x, block, parallel=False), expect)
    np.testing.assert_array_equal(kernels.block_mask_cpu(x, block, parallel=True), expect)
    np.testing.assert_array_equal(blocks.block_mask(np.zeros(n, dtype), block), np.zeros(nb, bool))


def test_integers_take_no_threshold_and_bfloat16_bits_keep_their_meaning() -> None:
    with pytest.raises(ConfigError, match="threshold"):
        blocks.block_mask(np.ones(8, np.int32), 4, threshold=1.0)
    with pytest.raises(ConfigError, match="threshold"):
        kernels.block_mask_cpu(np.ones(8, np.int64), 4, threshold=0.5)
    # uint16 is still bfloat16 bits: 0x8000 is -0.0, a zero block; as int16 it is -32768.
    neg_zero = np.array([0x8000, 0, 0, 0], np.uint16)
    assert not blocks.block_mask(neg_zero, 4)[0]
    assert blocks.block_mask(neg_zero.view(np.int16), 4)[0]
    # The CUDA kernels' view (no integers=True) still takes int16 as bfloat16 and refuses int32.
    assert kernels.bits_info(np.int16).kind == "bf16"
    with pytest.raises(ConfigError):
        kernels.bits_info(np.int32)
    assert kernels.bits_info(np.int32, integers=True).sign_mask == 0xFFFFFFFF


@pytest.mark.parametrize("dtype", INTS, **_IDS)
def test_compact_and_scatter_integers(dtype: Any) -> None:
    rng = np.random.default_rng(1)
    x = _ints(rng, 10_001, dtype, 0.3, 16)
    mask = kernels.block_mask_cpu(x, 16)
    ids, payload = kernels.compact_cpu(x, mask, 16)
    np.testing.assert_array_equal(ids, np.flatnonzero(_nonzero_blocks(x, 16)))
    out = np.full_like(x, 7)
    kernels.scatter_cpu(out, ids, payload, 16)
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("rows", [3, 64])  # below and above the Numba kernel's size
def test_add_rows_int64_wraps(rows: int) -> None:
    rng = np.random.default_rng(rows)
    big = np.iinfo(np.int64)
    acc = rng.integers(big.min, big.max, (rows * 2, 128), np.int64, endpoint=True)
    vals = rng.integers(big.min, big.max, (rows, 128), np.int64, endpoint=True)
    at = rng.permutation(rows * 2)[:rows]
    expect = acc.copy()
    expect[at] = (expect[at].view(np.uint64) + vals.view(np.uint64)).view(np.int64)
    blocks.add_rows(acc, at, vals)
    np.testing.assert_array_equal(acc, expect)


# The aggregator's sums (engine and worker ops, no sockets).


@pytest.mark.parametrize("dtype", INTS, **_IDS)
@pytest.mark.parametrize("density", [0.3, 1.0])
def test_engine_sums_wrap_exactly(dtype: Any, density: float) -> None:
    rng = np.random.default_rng(int(density * 10) + np.dtype(dtype).itemsize)
    inputs = [_ints(rng, 999, dtype, density, 8) for _ in range(3)]
    outs, ops, engine = run_allreduce(inputs, DType.of_numpy(dtype), block_size=8, message_blocks=5, streams=3,
                                      shuffle=random.Random(3))
    expect = _wrapped_sum(inputs)
    for out, op, x in zip(outs, ops, inputs, strict=True):
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, expect)
        assert op.stats.blocks_sent == int(_nonzero_blocks(x, 8).sum())
    assert engine.active_ops == 0 and engine.ops_completed == 1


def test_engine_int64_beyond_float_precision() -> None:
    # 2**53 + 1 is not a float64: a float accumulator would round these.
    a = np.array([2**53 + 1, 2**62 + 3, -(2**63), 2**63 - 1], np.int64)
    b = np.array([2**53 + 2, 2**62 + 5, -1, 1], np.int64)
    outs, _, _ = run_allreduce([a, b], DType.INT64, block_size=1, message_blocks=2, streams=2)
    expect = [2**54 + 3, 2**63 + 8 - 2**64, 2**63 - 1, -(2**63)]
    for out in outs:
        assert out.tolist() == expect


def test_engine_refuses_weighted_integer_ops() -> None:
    engine = Engine()
    layout = Layout(40, 4, 2, 2)
    x = np.arange(40, dtype=np.int32)

    def start(rank: int, weight: float | None) -> list[bytes]:
        return wire(WorkerOp("j", rank, 2, 0, x, DType.INT32, layout, weight=weight).start()[0])

    (peer, frames), = engine.handle(peer_of(0), start(0, 2.0))
    err, _ = decode(wire(frames))
    assert peer == peer_of(0) and isinstance(err, Error) and err.code == ErrorCode.MISMATCH
    assert "weighted mean of int32" in err.message and err.ranks == [0]
    # The other rank hears the same when it joins, weighted or not.
    (peer, frames), = engine.handle(peer_of(1), start(1, None))
    late, _ = decode(wire(frames))
    assert peer == peer_of(1) and late.code == ErrorCode.MISMATCH and late.message == err.message
    assert engine.active_ops == 0
    # The next op of the job works.
    outs, _, _ = run_allreduce([x, x], DType.INT32, block_size=4, op=1, job="j", engine=engine)
    np.testing.assert_array_equal(outs[0], 2 * x)


# Through the worker and a real aggregator.


def test_worker_sums_int32_and_int64_exactly(aggregator: Aggregator) -> None:
    rng = np.random.default_rng(42)
    world, n = 3, (1 << 18) + 77
    tensors = {
        "i32_sparse": [_ints(rng, n, np.int32, 0.05, 256) for _ in range(world)],
        "i32_dense": [_ints(rng, n, np.int32, 1.0, 256) for _ in range(world)],  # overflows nearly everywhere
        "i64_sparse": [_ints(rng, n, np.int64, 0.05, 256).reshape(-1, 1) for _ in range(world)],
        "i64_big": [(2**60 + rng.integers(0, 2**40, (64, 33))) * (-1) ** r for r in range(world)],
        "i32_empty": [np.zeros(0, np.int32) for _ in range(world)],
    }

    def rank(r: int) -> dict[str, Any]:
        with Worker(aggregator.address, rank=r, world_size=world, job="ints", timeout=20) as w:
            futures = {k: w.allreduce_async(v[r]) for k, v in tensors.items()}
            got = {k: f.result(timeout=30) for k, f in futures.items()}
        with Worker(aggregator.address, rank=r, world_size=world, job="ints-dense", timeout=20, mode="dense") as w:
            got["dense_path"] = w.allreduce(tensors["i32_sparse"][r])
        return got

    for got in run_ranks(world, rank):
        for key, xs in tensors.items():
            assert got[key].dtype == xs[0].dtype and got[key].shape == xs[0].shape, key
            np.testing.assert_array_equal(got[key], _wrapped_sum(xs), err_msg=key)
        # int32: NumPy's wraparound of the exact (int64) sum.
        exact = np.sum([x.astype(np.int64) for x in tensors["i32_dense"]], axis=0)
        assert (exact != exact.astype(np.int32)).any()  # the test does overflow
        np.testing.assert_array_equal(got["i32_dense"], exact.astype(np.int32))
        np.testing.assert_array_equal(got["dense_path"], got["i32_sparse"])
        big = sum(x.astype(object) for x in tensors["i64_big"])  # Python ints: no rounding, no wrap
        assert got["i64_big"].tolist() == big.tolist()


def test_small_integer_types_wrap(aggregator: Aggregator) -> None:
    rng = np.random.default_rng(8)
    inputs = [[_ints(rng, 5000, dt, 0.5, 64) for dt in (np.int8, np.uint8, np.int16)] for _ in range(2)]

    def rank(r: int) -> list[np.ndarray]:
        with Worker(aggregator.address, rank=r, world_size=2, job="small", block_size=64, timeout=20) as w:
            return [w.allreduce(x) for x in inputs[r]]

    for got in run_ranks(2, rank):
        for i, out in enumerate(got):
            np.testing.assert_array_equal(out, _wrapped_sum([inputs[0][i], inputs[1][i]]))


def test_weight_is_refused_on_the_rank_that_gives_it_and_fails_the_op_on_every_rank(aggregator: Aggregator) -> None:
    x = np.arange(-500, 500, dtype=np.int32)
    f = np.ones(1000, np.float32)

    def rank(r: int) -> tuple[np.ndarray, np.ndarray]:
        with Worker(aggregator.address, rank=r, world_size=2, job="weights", block_size=64, timeout=20) as w:
            if r == 0:
                with pytest.raises(ConfigError, match="weight is not supported for int32"):
                    w.allreduce(x, weight=3.0)
            else:
                with pytest.raises(PeerRefusedError, match="rank 0 refused the op: ConfigError: weight is not"):
                    w.allreduce(x)
            # The refused op took its number on both ranks: these pair up.
            return w.allreduce(x), w.allreduce(f * (r + 1), weight=float(r + 1))

    for ints, mean in run_ranks(2, rank):
        np.testing.assert_array_equal(ints, 2 * x)
        np.testing.assert_allclose(mean, np.full(1000, 5 / 3, np.float32))


def test_inplace_and_out(aggregator: Aggregator) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    arrays = [_ints(rng, 20_000, np.int64, 0.2, 256).reshape(100, 200) for _ in range(2)]
    tensors = [torch.from_numpy(_ints(rng, 3000, np.int32, 0.3, 256)).reshape(30, 100) for _ in range(2)]
    expect_a = _wrapped_sum(arrays)
    expect_t = tensors[0] + tensors[1]  # torch's own int32 add: wraps
    bufs = [np.zeros(20_000, np.int64) for _ in range(2)]

    def rank(r: int) -> tuple[Any, ...]:
        with Worker(aggregator.address, rank=r, world_size=2, job="inplace-int", timeout=20) as w:
            a = arrays[r].copy()
            a_out = w.allreduce(a, inplace=True)
            t = tensors[r].clone()
            t_out = w.allreduce(t, inplace=True)
            o = w.allreduce(arrays[r], out=bufs[r])
            with pytest.raises(ConfigError, match="out must be"):
                w.allreduce(arrays[r], out=np.zeros(20_000, np.int32))  # the storage type is int64
            after = w.allreduce(arrays[r])
            return a, a_out, t, t_out, o, after

    for r, (a, a_out, t, t_out, o, after) in enumerate(run_ranks(2, rank)):
        assert a_out is a and t_out is t
        np.testing.assert_array_equal(a, expect_a)
        assert torch.equal(t, expect_t)
        assert np.shares_memory(o, bufs[r]) and o.shape == (100, 200)
        np.testing.assert_array_equal(o, expect_a)
        np.testing.assert_array_equal(after, expect_a)


def test_torch_integer_tensors(aggregator: Aggregator) -> None:
    torch = pytest.importorskip("torch")
    dtypes = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
    rng = np.random.default_rng(4)
    world = 3
    inputs = [[torch.from_numpy(_ints(rng, 1500, nt, 0.5, 16)).reshape(3, 500) for nt in INTS] for _ in range(world)]

    def rank(r: int) -> list[Any]:
        with Worker(aggregator.address, rank=r, world_size=world, job="torch-int", block_size=16, timeout=20) as w:
            return [w.allreduce(t) for t in inputs[r]]

    for got in run_ranks(world, rank):
        for i, dt in enumerate(dtypes):
            out = got[i]
            assert isinstance(out, torch.Tensor) and out.dtype == dt and out.shape == (3, 500)
            # torch's own integer sum in the type (what gloo's SUM computes): wraps.
            assert torch.equal(out, functools.reduce(torch.add, [inputs[r][i] for r in range(world)]))
    with Worker(aggregator.address, rank=0, world_size=1, job="torch-bad") as w:
        with pytest.raises(ConfigError, match="torch.bool"):
            w.allreduce(torch.zeros(4, dtype=torch.bool))


def test_sharded_integer_sums(shards: list[Aggregator]) -> None:
    rng = np.random.default_rng(12)
    addresses = [a.address for a in shards[:2]]
    inputs = [[_ints(rng, 4099, np.int32, 0.4, 16), _ints(rng, 1000, np.int64, 1.0, 16)] for _ in range(2)]

    def rank(r: int) -> list[np.ndarray]:
        with connect(addresses, rank=r, world_size=2, job="sharded-int", block_size=16, timeout=20,
                     shard_bytes=0) as w:
            # Refused on every rank alike: the op takes its number on both shards of both.
            with pytest.raises(ConfigError, match="weight"):
                w.allreduce(inputs[r][0], weight=1.0)
            x = inputs[r][1].copy()
            return [w.allreduce(inputs[r][0]), w.allreduce(x, inplace=True), x]

    for got in run_ranks(2, rank):
        np.testing.assert_array_equal(got[0], _wrapped_sum([inputs[0][0], inputs[1][0]]))
        np.testing.assert_array_equal(got[1], _wrapped_sum([inputs[0][1], inputs[1][1]]))
        assert got[1] is got[2]


def test_integer_cuda_tensors_are_refused_clearly() -> None:
    torch = pytest.importorskip("torch")
    from worker.cuda import CudaOpData

    # Refused before any device work: the check needs no GPU.
    for dt in (torch.int16, torch.int32):
        with pytest.raises(ConfigError, match="CUDA torch.int"):
            CudaOpData(torch.zeros(8, dtype=dt), 4)


def test_mismatch_between_integer_and_float_ranks(aggregator: Aggregator) -> None:
    def rank(r: int) -> str:
        x = np.ones(100, np.int32 if r == 0 else np.float32)
        with Worker(aggregator.address, rank=r, world_size=2, job="mixed", timeout=20) as w:
            with pytest.raises(MismatchError) as e:
                w.allreduce(x)
            return str(e.value)

    for msg in run_ranks(2, rank):
        assert "dtype: 5 vs 1" in msg
