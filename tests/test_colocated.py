"""Co-located aggregators: every rank serves one shard (``worker.colocated``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import zmq

from aggregator import Aggregator
from omnireduce import ConfigError, OmniReduceError, WorkerClosedError
from omnireduce.protocol import decode
from tests.helpers import ThreadExchange, run_ranks, sparse
from worker import Worker
from worker.colocated import ColocatedWorker

# shard_bytes=0: every op is split over every shard, however small (the split is what is tested).
ONE = dict(block_size=16, message_blocks=4, streams=2, timeout=20)  # a plain worker's
SMALL = {**ONE, "shard_bytes": 0}


def _inputs(world: int, n: int, density: float, seed: int) -> list[np.ndarray]:
    """Small integers in random 16-element blocks: every float sum is exact."""
    rng = np.random.default_rng(seed)
    return [sparse(rng, n, density, block=16) for _ in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sums_exact_over_every_ranks_shard(world: int) -> None:
    ex = ThreadExchange(world)
    shapes = [(1000, 0.3), (4099, 1.0), (17, 0.5), (100_003, 0.05), (0, 0.0)]
    cases = [(n, d, seed) for seed, (n, d) in enumerate(shapes)]
    inputs = {c: _inputs(world, *c) for c in cases}

    def rank(r: int) -> list[np.ndarray]:
        with ColocatedWorker(ex(r), r, world, job="coloc", **SMALL) as w:
            assert w.addresses[r].startswith("inproc://")
            assert w.shard_addresses[r] == w.aggregator.address and w.aggregator.address.startswith("tcp://")
            # Several ops in flight at once, then one at a time in place.
            futures = [w.allreduce_async(inputs[c][r]) for c in cases]
            results = [f.result(timeout=30) for f in futures]
            x = inputs[cases[0]][r].copy()
            assert w.allreduce(x, inplace=True) is x
            return [*results, x]

    got = run_ranks(world, rank)
    for r in range(world):
        for k, c in enumerate(cases):
            np.testing.assert_array_equal(got[r][k], np.sum(inputs[c], axis=0, dtype=np.float32))
        np.testing.assert_array_equal(got[r][-1], np.sum(inputs[cases[0]], axis=0, dtype=np.float32))


def test_exchange_results_are_checked_and_nothing_leaks() -> None:
    before = threading.active_count()
    with pytest.raises(ConfigError, match="expected 2 addresses"):
        ColocatedWorker(lambda a: [a], 0, 2, **SMALL)
    with pytest.raises(ConfigError, match="at rank 1"):
        ColocatedWorker(lambda a: [a, "tcp://127.0.0.1:1"], 1, 2, **SMALL)
    with pytest.raises(ConfigError, match="own context"):
        ColocatedWorker(lambda a: [a], 0, 1, context=zmq.Context.instance())
    with pytest.raises(ConfigError, match="not in a world"):
        ColocatedWorker(lambda a: [a], 2, 2)
    # The shard of every refused worker was closed with it.
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before


def test_close_waits_for_the_other_ranks_then_gives_up() -> None:
    ex = ThreadExchange(2)
    workers: list[Any] = [None, None]

    def rank(r: int) -> None:
        workers[r] = ColocatedWorker(ex(r), r, 2, job="closing", close_timeout=0.3, **SMALL)
        workers[r].allreduce(np.ones(100, np.float32))

    run_ranks(2, rank)
    w0, w1 = workers
    # Rank 1 still uses rank 0's shard: rank 0's close waits for it, up to close_timeout.
    t0 = time.monotonic()
    w0.close()
    assert 0.25 < time.monotonic() - t0 < 5
    w1.close()  # rank 0 left already: no wait
    assert time.monotonic() - t0 < 5


def test_aggregator_listens_on_several_endpoints() -> None:
    ctx = zmq.Context()
    with Aggregator(listen="tcp://127.0.0.1:0, inproc://coloc-test-agg", context=ctx) as agg:
        agg.start()
        assert len(agg.addresses) == 2 and agg.addresses[1] == "inproc://coloc-test-agg"
        assert agg.address == agg.addresses[0] and agg.address.startswith("tcp://127.0.0.1:")
        x = np.arange(40, dtype=np.float32)

        def rank(r: int) -> np.ndarray:
            # Rank 0 over TCP, rank 1 in memory: one job across both endpoints.
            if r == 0:
                with Worker(agg.addresses[0], rank=0, world_size=2, job="two", **ONE) as w:
                    return w.allreduce(x)
            with Worker(agg.addresses[1], rank=1, world_size=2, job="two", context=ctx, **ONE) as w:
                return w.allreduce(x)

        for y in run_ranks(2, rank):
            np.testing.assert_array_equal(y, 2 * x)
    ctx.term()
    with pytest.raises(ConfigError, match="no endpoint"):
        Aggregator(listen=" , ")


def test_curve_across_colocated_shards(keys: dict[str, Any]) -> None:
    # Every rank's shard holds the job's server key; the TCP connections between ranks
    # are encrypted and checked, a rank's own shard is reached in memory.
    ex = ThreadExchange(2)
    x = np.arange(100, dtype=np.float32)

    def rank(r: int) -> np.ndarray:
        agg_options = dict(curve_secret_key=keys["server_secret"], curve_client_keys=keys["allowed"])
        with ColocatedWorker(ex(r), r, 2, job="coloc-curve", aggregator_options=agg_options,
                             curve_server_key=keys["server_public"], curve_client_key=keys[f"w{r}"], **SMALL) as w:
            assert w.aggregator.curve
            return w.allreduce(x)

    for y in run_ranks(2, rank):
        np.testing.assert_array_equal(y, 2 * x)


def test_a_rank_that_leaves_fails_the_others_ops_without_a_hang() -> None:
    # The others' next op fails naming a shard and does not hang: at once where rank 0's own
    # shard, which heard rank 1's goodbye, answers first ("rank 1 left"), else at the worker's
    # timeout for rank 1's shard, which went with it.
    ex = ThreadExchange(2)
    left = threading.Event()
    timeout = 2.0

    def rank(r: int) -> Any:
        w = ColocatedWorker(ex(r), r, 2, job="leaving", close_timeout=0.5, **{**SMALL, "timeout": timeout})
        try:
            if r == 1:
                return None  # closes at once: its workers say goodbye, its shard goes
            assert left.wait(10)
            t0 = time.monotonic()
            with pytest.raises(OmniReduceError) as e:
                w.allreduce(np.ones(1000, np.float32))
            return time.monotonic() - t0, e.value
        finally:
            w.close()
            if r == 1:
                left.set()

    took, error = run_ranks(2, rank)[0]
    assert took < timeout + 3, (took, error)
    assert str(error).startswith("shard "), error
    assert "rank 1 left (its worker was closed)" in str(error) or (
        "no answer from the aggregator" in str(error) and took > timeout - 0.5), (took, error)


def test_the_input_may_change_once_the_op_returned() -> None:
    # Only rank 0 has blocks in its own shard's chunk, which reaches that shard in memory;
    # rank 0 overwrites its input as soon as its allreduce returns, while the shard may
    # still be sending the sums to rank 1: rank 1 must get the values of the op.
    n = 1 << 21
    ex = ThreadExchange(2)
    step = threading.Barrier(2, timeout=30)

    def rank(r: int) -> list[float]:
        seen = []
        with ColocatedWorker(ex(r), r, 2, job="overwrite", timeout=30) as w:
            for _ in range(30):
                x = np.zeros(n, np.float32)
                if r == 0:
                    x[: n // 2] = 1.0
                step.wait()
                y = w.allreduce(x)
                if r == 0:
                    x[:] = 7.0
                else:
                    seen.append(float(np.abs(y[: n // 2] - 1.0).max()))
                step.wait()
        return seen

    assert run_ranks(2, rank)[1] == [0.0] * 30


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_shard_never_writes_into_its_own_ranks_input(dtype: type) -> None:
    # Every rank sends every block, so each shard sums a payload it received over TCP (which
    # it may write into) with its own rank's, handed over in memory: that one is the rank's
    # tensor and must come back unchanged from an op that is not in place.
    world = 3
    ex = ThreadExchange(world)
    # 160 kB per shard: larger frames than pyzmq copies anyway (64 kB).
    xs = [np.random.default_rng(r).integers(-50, 50, 120_000).astype(dtype) for r in range(world)]

    def rank(r: int) -> tuple[np.ndarray, np.ndarray]:
        x = xs[r].copy()
        # One row of blocks (eager): a rank's payload is a view of its input, not a gather.
        with ColocatedWorker(ex(r), r, world, job="untouched", **{**SMALL, "message_blocks": 2048}) as w:
            return x, w.allreduce(x)

    for r, (x, y) in enumerate(run_ranks(world, rank)):
        np.testing.assert_array_equal(y, np.sum(xs, axis=0, dtype=np.float32).astype(dtype))
        np.testing.assert_array_equal(x, xs[r])


def _threads(name: str) -> int:
    return sum(t.name == name for t in threading.enumerate())


def test_the_shard_is_served_by_the_ranks_communication_thread() -> None:
    """No thread of the shard's own: the rank's communication thread polls its sockets too."""
    ex = ThreadExchange(2)
    x = np.arange(64, dtype=np.float32)
    before = _threads("omnireduce-aggregator"), _threads("omnireduce-worker-r0"), _threads("omnireduce-worker-r1")

    def rank(r: int) -> np.ndarray:
        with ColocatedWorker(ex(r), r, 2, job="one-thread-coloc", **SMALL) as w:
            y = w.allreduce(x)
            assert _threads("omnireduce-aggregator") == before[0]
            assert _threads(f"omnireduce-worker-r{r}") == before[1 + r] + 1
            with pytest.raises(RuntimeError, match="already served"):
                w.aggregator.serve_sockets()
            with pytest.raises(RuntimeError, match="already served"):
                w.aggregator.start()
            return y

    for y in run_ranks(2, rank):
        np.testing.assert_array_equal(y, 2 * x)


def test_a_bug_in_a_ranks_shard_fails_every_ranks_op() -> None:
    """The shard's failure kills its rank's communication thread: that rank's op raises at
    once; the other rank's op raises too, at its timeout at the latest (a rank that went
    away may come back, so it is waited for), never hangs."""
    ex = ThreadExchange(2)
    ready = threading.Barrier(2)
    timeout = 2.0

    def rank(r: int) -> tuple[float, BaseException]:
        w = ColocatedWorker(ex(r), r, 2, job="shard-bug", close_timeout=0.5, **{**SMALL, "timeout": timeout})
        try:
            w.allreduce(np.ones(100, np.float32))
            if r == 0:
                handle = w.aggregator.engine.handle

                def boom(peer: bytes, frames: list[Any], owned: bool = False) -> Any:
                    # Only op 1's messages: one of op 0's (or a late HELLO) may still be on its way.
                    if getattr(decode(frames)[0], "op", -1) >= 1:
                        raise RuntimeError("injected shard bug")
                    return handle(peer, frames, owned=owned)

                w.aggregator.engine.handle = boom  # type: ignore[method-assign]
            # Rank 0 submits first: a message of rank 1 reaching the broken shard earlier
            # would kill rank 0's thread before its op was taken.
            if r == 1:
                ready.wait(10)
            t0 = time.monotonic()
            try:
                # The shard's thread may die before the op reaches the second shard: then
                # the submission itself raises.
                fut = w.allreduce_async(np.ones(100, np.float32))
            except OmniReduceError as err:
                return time.monotonic() - t0, err
            finally:
                if r == 0:
                    ready.wait(10)
            with pytest.raises(OmniReduceError) as e:
                fut.result(timeout=timeout + 5)
            return time.monotonic() - t0, e.value
        finally:
            w.close()

    (took0, e0), (took1, e1) = run_ranks(2, rank)
    assert isinstance(e0, WorkerClosedError) and "injected shard bug" in str(e0), e0
    assert took0 < 1 and took1 < timeout + 3, (took0, e0, took1, e1)


def test_closing_on_the_communication_thread_is_refused() -> None:
    ex = ThreadExchange(1)
    with ColocatedWorker(ex(0), 0, 1, job="cb-close-coloc", **SMALL) as w:
        errors: list[BaseException] = []

        ran = threading.Event()

        def close(_f: Any) -> None:
            try:
                if w._loop.on_thread:  # else the op was done before its callback was added: try again
                    w.close()
            except RuntimeError as e:
                errors.append(e)
            finally:
                ran.set()

        for _ in range(50):
            ran.clear()
            fut = w.allreduce_async(np.ones(10, np.float32))
            fut.add_done_callback(close)
            fut.result(timeout=10)
            assert ran.wait(5)
            if errors:
                break
        assert errors and "communication thread" in str(errors[0])
        np.testing.assert_array_equal(w.allreduce(np.ones(10, np.float32)), np.ones(10, np.float32))


def test_a_close_that_raises_part_way_still_ends_the_shard_and_context(monkeypatch: pytest.MonkeyPatch) -> None:
    ex = ThreadExchange(1)
    w = ColocatedWorker(ex(0), 0, 1, job="close-raises", timeout=5)
    np.testing.assert_array_equal(w.allreduce(np.ones(4, np.float32)), np.ones(4, np.float32))
    real_close = w.aggregator.close

    def failing_close() -> None:
        real_close()
        raise OSError("a step of close failed")

    monkeypatch.setattr(w.aggregator, "close", failing_close)
    errors: list[BaseException] = []

    def close() -> None:
        try:
            w.close()
        except OSError as e:
            errors.append(e)

    closers = [threading.Thread(target=close) for _ in range(2)]
    for t in closers:
        t.start()
    for t in closers:
        t.join(30)
    assert len(errors) == 1  # the one closer that ran the steps; the other found it done
    assert w._shared_ctx.closed and not w._loop.alive
    w.close()  # and again: nothing left to do
