"""Weighted means, speed-proportional batch recommendations and the batch splitting of worker.balance."""

from __future__ import annotations

import time

import numpy as np
import pytest

from aggregator import Aggregator
from aggregator.engine import Engine
from omnireduce import ConfigError, MismatchError
from omnireduce.dtypes import DType
from omnireduce.layout import Layout
from omnireduce.protocol import Error, ErrorCode, decode
from tests.helpers import peer_of, run_allreduce, run_ranks, sparse, wire
from worker import Worker
from worker.balance import Balancer, ProportionalSampler, batch_sizes
from worker.op import WorkerOp

DTYPES = {DType.FLOAT32: np.float32, DType.FLOAT64: np.float64, DType.FLOAT16: np.float16}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_weighted_mean_equals_the_reference(dtype: DType, world: int) -> None:
    rng = np.random.default_rng(world)
    inputs = [sparse(rng, 1000, 0.3, block=8).astype(DTYPES[dtype]) for _ in range(world)]
    weights = [float(w) for w in rng.integers(1, 64, world)]
    outs, _, _ = run_allreduce(inputs, dtype, block_size=8, message_blocks=4, streams=3, weights=weights)
    ref = sum(w * x.astype(np.float64) for w, x in zip(weights, inputs, strict=True)) / sum(weights)
    tol = 1e-3 if dtype == DType.FLOAT16 else 1e-6
    for out in outs:
        assert out.dtype == inputs[0].dtype
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)


def test_equal_weights_are_the_plain_mean_bit_for_bit() -> None:
    rng = np.random.default_rng(7)
    inputs = [sparse(rng, 999, 0.5, block=16) for _ in range(3)]
    summed, _, _ = run_allreduce(inputs, DType.FLOAT32, block_size=16, message_blocks=8, streams=2)
    outs, _, _ = run_allreduce(inputs, DType.FLOAT32, block_size=16, message_blocks=8, streams=2, weights=[1.0] * 3)
    np.testing.assert_array_equal(outs[0], summed[0] / np.float32(3))


def test_weighted_and_plain_workers_mismatch() -> None:
    x = np.ones(64, np.float32)
    engine = Engine()
    layout = Layout(64, 8, 4, 2)
    weighted = WorkerOp("j", 0, 2, 0, x, DType.FLOAT32, layout, weight=2.0).start()[0]
    assert engine.handle(peer_of(0), wire(weighted)) == []
    out = engine.handle(peer_of(1), wire(WorkerOp("j", 1, 2, 0, x, DType.FLOAT32, layout).start()[0]))
    assert {peer for peer, _ in out} == {peer_of(0), peer_of(1)}
    for _, frames in out:
        msg, _ = decode(wire(frames))
        assert isinstance(msg, Error) and msg.code == ErrorCode.MISMATCH
        assert "weighted: True vs False" in msg.message


def test_recommended_batches_follow_speeds() -> None:
    engine = Engine(balance_smoothing=0.0)
    x = [np.zeros(10, np.float32)] * 3
    # Rank speeds 10, 20, 40 samples/s (rank 2 twice as fast as rank 1).
    _, ops, _ = run_allreduce(x, DType.FLOAT32, block_size=4, engine=engine,
                              weights=[10.0, 20.0, 30.0], compute=[1.0, 1.0, 0.75])
    assert all(op.batches == pytest.approx([60 / 7, 120 / 7, 240 / 7]) for op in ops)
    # Without every compute time there is no recommendation.
    _, ops, _ = run_allreduce(x, DType.FLOAT32, block_size=4, engine=engine, op=1, weights=[1.0, 1.0, 1.0])
    assert all(op.batches is None for op in ops)


def test_speeds_that_overflow_give_no_recommendation_and_start_afresh() -> None:
    # Weights near float64's end made the batches inf/NaN: every worker refused that RESULT as
    # undecodable (the op timed out), and the job's speeds stayed so for every later op.
    engine = Engine(balance_smoothing=0.5)
    x = [np.zeros(10, np.float32)] * 2
    _, ops, _ = run_allreduce(x, DType.FLOAT32, block_size=4, engine=engine, weights=[1e308, 1e308],
                              compute=[1.0, 1.0])
    assert all(op.batches is None for op in ops)
    _, ops, _ = run_allreduce(x, DType.FLOAT32, block_size=4, engine=engine, op=1, weights=[3.0, 3.0],
                              compute=[0.1, 0.1])
    assert all(op.batches == pytest.approx([3.0, 3.0]) for op in ops)


def test_recommendations_are_smoothed_towards_new_speeds() -> None:
    engine = Engine(balance_smoothing=0.5)
    x = [np.zeros(10, np.float32)] * 2
    got = []
    for op in range(8):
        # Both start at equal speed; from op 1 rank 1 runs at half speed.
        compute = [1.0, 1.0] if op == 0 else [1.0, 2.0]
        _, ops, _ = run_allreduce(x, DType.FLOAT32, block_size=4, engine=engine, op=op,
                                  weights=[8.0, 8.0], compute=compute)
        got.append(ops[0].batches)
    assert got[0] == pytest.approx([8, 8])
    shares = [b[0] / sum(b) for b in got]
    assert all(a < b for a, b in zip(shares, shares[1:], strict=False))  # moves monotonically
    assert shares[-1] == pytest.approx(2 / 3, abs=0.01)  # to the speed ratio 2:1


def test_batch_sizes_round_by_largest_remainder() -> None:
    assert batch_sizes([1, 1, 1], 10) == [4, 3, 3]
    assert batch_sizes([2 / 3, 1 / 3], 64) == [43, 21]
    assert batch_sizes([0, 5], 10, minimum=1) == [1, 9]
    assert sum(batch_sizes([0.1, 0.7, 0.2, 3.3], 1001)) == 1001
    # Shares whose sum overflows float64 (every exact share was 0: sizes summing to 2).
    assert batch_sizes([1e308, 1e308], 10) == [5, 5]
    assert batch_sizes([1.7e308, 1.7e308 / 4], 10) == [8, 2]
    for bad in ([], [-1, 2], [0, 0], [float("nan")]):
        with pytest.raises(ConfigError):
            batch_sizes(bad, 10)
    with pytest.raises(ConfigError):
        batch_sizes([1, 1], 1, minimum=1)


def test_sampler_splits_disjointly_by_shares() -> None:
    samplers = [ProportionalSampler(1000, r, 3, seed=4) for r in range(3)]
    for epoch, shares in [(0, None), (1, [10, 20, 70])]:
        parts = []
        for s in samplers:
            s.set_epoch(epoch, shares)
            parts.append(list(s))
            assert len(s) == len(parts[-1])
        assert sorted(i for p in parts for i in p) == list(range(1000))
        if shares:
            assert [len(p) for p in parts] == [100, 200, 700]
    s = samplers[0]
    s.set_epoch(2)
    a = list(s)
    s.set_epoch(3)
    assert list(s) != a  # a new permutation each epoch
    with pytest.raises(ConfigError):
        s.set_epoch(4, [1, 2])


class _FakeWorker:
    rank, world_size, recommended_batches = 1, 2, None


def test_balancer_is_equal_until_recommended() -> None:
    w = _FakeWorker()
    b = Balancer(w, global_batch=63)
    assert b.batch_sizes() == [32, 31] and b.batch_size() == 31
    w.recommended_batches = [42.0, 21.0]
    assert b.batch_sizes() == [42, 21] and b.batch_size(0) == 42


def test_balancer_says_once_when_no_recommendation_ever_comes(caplog: pytest.LogCaptureFixture) -> None:
    # The DDP hook's buckets through gloo (mode dense) bring none: the batches silently stayed equal.
    from worker.balance import WARN_AFTER

    b = Balancer(_FakeWorker(), global_batch=8)
    for _ in range(2 * WARN_AFTER):
        assert b.batch_sizes() == [4, 4]
    assert caplog.text.count("no batch recommendation after") == 1


def test_workers_slowed_by_known_factors_get_proportional_batches(aggregator: Aggregator) -> None:
    """Rank r "computes" 2 ms per sample times slowdown[r]; batches converge to 1/slowdown."""
    slowdown = [1.0, 2.0, 4.0]
    world, global_batch = len(slowdown), 70

    def rank(r: int) -> list[int]:
        sizes = []
        with Worker(aggregator.address, rank=r, world_size=world, job="balance", block_size=16, timeout=30) as w:
            balancer = Balancer(w, global_batch)
            g = np.zeros(256, np.float32)
            for _ in range(12):
                n = balancer.batch_size()
                time.sleep(0.002 * n * slowdown[r])
                g[:] = r + 1
                w.allreduce(g, weight=n)
                sizes.append(balancer.batch_size())
        return sizes

    got = run_ranks(world, rank)
    final = [got[r][-1] for r in range(world)]
    assert sum(final) == global_batch
    ideal = [global_batch * (1 / s) / sum(1 / v for v in slowdown) for s in slowdown]  # 40, 20, 10
    for f, i in zip(final, ideal, strict=True):
        assert abs(f - i) <= 0.25 * i + 1, (final, ideal)


def test_worker_weighted_allreduce_and_bad_weights(aggregator: Aggregator) -> None:
    rng = np.random.default_rng(3)
    xs = [sparse(rng, 5000, 0.1) for _ in range(2)]
    weights = [3, 29]

    def rank(r: int) -> np.ndarray:
        with Worker(aggregator.address, rank=r, world_size=2, job="weighted", timeout=20) as w:
            for bad in (0, -1, float("inf"), "2", True):
                with pytest.raises(ConfigError):
                    w.allreduce(xs[r], weight=bad)
            y = w.allreduce(xs[r], weight=weights[r])
            # One weighted, one not: refused on both, with the difference named.
            with pytest.raises(MismatchError, match="weighted"):
                w.allreduce(xs[r], weight=1.0 if r == 0 else None)
            return y

    ref = (weights[0] * xs[0].astype(np.float64) + weights[1] * xs[1]) / sum(weights)
    for y in run_ranks(2, rank):
        np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-7)
