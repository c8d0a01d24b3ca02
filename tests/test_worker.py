"""Workers and an aggregator over real ZeroMQ sockets on loopback, in one process."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from aggregator import Aggregator
from omnireduce import (
    ConfigError,
    MismatchError,
    OmniReduceError,
    OpTimeoutError,
    PeerRefusedError,
    WorkerClosedError,
)
from tests.helpers import run_ranks, sparse
from worker import Worker


def test_allreduce_numpy_shapes_and_several_ops(aggregator: Aggregator) -> None:
    rng = np.random.default_rng(0)
    shapes = [(1000,), (7, 13, 5), (1,), (0,), (300_000,)]
    inputs = [[sparse(rng, int(np.prod(s)), 0.2).reshape(s) for s in shapes] for _ in range(3)]

    def rank(r: int) -> list[np.ndarray]:
        with Worker(aggregator.address, rank=r, world_size=3, job="shapes", timeout=20) as w:
            out = [w.allreduce(x) for x in inputs[r]]
            assert w.stats.ops == len(shapes)
            return out

    results = run_ranks(3, rank)
    for i, s in enumerate(shapes):
        expected = inputs[0][i] + inputs[1][i] + inputs[2][i]
        for r in range(3):
            assert results[r][i].shape == s and results[r][i].dtype == np.float32
            np.testing.assert_array_equal(results[r][i], expected)


def test_many_ops_in_flight(aggregator: Aggregator) -> None:
    rng = np.random.default_rng(1)
    inputs = [[sparse(rng, 5000 + 37 * i, 0.1) for i in range(16)] for _ in range(2)]

    def rank(r: int) -> list[np.ndarray]:
        with Worker(aggregator.address, rank=r, world_size=2, job="inflight", streams=3, message_blocks=4) as w:
            futures = [w.allreduce_async(x) for x in inputs[r]]
            return [f.result(timeout=30) for f in futures]

    results = run_ranks(2, rank)
    for i in range(16):
        np.testing.assert_array_equal(results[0][i], inputs[0][i] + inputs[1][i])
        np.testing.assert_array_equal(results[1][i], results[0][i])


def test_two_jobs_share_one_aggregator(aggregator: Aggregator) -> None:
    def rank(i: int) -> np.ndarray:
        job, r = divmod(i, 2)
        with Worker(aggregator.address, rank=r, world_size=2, job=f"job{job}") as w:
            return w.allreduce(np.full(1000, 10.0 * job + r, np.float64))

    results = run_ranks(4, rank)
    np.testing.assert_array_equal(results[0], np.full(1000, 1.0))
    np.testing.assert_array_equal(results[3], np.full(1000, 21.0))


def test_length_mismatch_is_an_error_on_every_worker(aggregator: Aggregator) -> None:
    def rank(r: int) -> str:
        with Worker(aggregator.address, rank=r, world_size=2, job="mismatch", timeout=10) as w:
            with pytest.raises(MismatchError) as info:
                w.allreduce(np.ones(100 + r, np.float32))
            # The worker is still usable after a failed op.
            np.testing.assert_array_equal(w.allreduce(np.ones(3, np.float32)), [2, 2, 2])
            return str(info.value)

    for msg in run_ranks(2, rank):
        assert "length: 100 vs 101" in msg and "job='mismatch'" in msg and "op=0" in msg


def test_aggregator_timeout_names_missing_rank() -> None:
    with Aggregator(timeout=0.5).start() as agg:
        with Worker(agg.address, rank=0, world_size=2, job="lonely", timeout=10) as w:
            t = time.monotonic()
            with pytest.raises(OpTimeoutError) as info:
                w.allreduce(np.ones(10, np.float32))
            assert time.monotonic() - t < 5
            assert info.value.ranks == (1,) and info.value.job == "lonely"


def test_worker_times_out_without_aggregator() -> None:
    with Worker("tcp://127.0.0.1:1", rank=0, world_size=1, job="nobody", timeout=0.5) as w:
        with pytest.raises(OpTimeoutError, match="no answer from the aggregator"):
            w.allreduce(np.ones(10, np.float32))


def test_closed_worker_raises() -> None:
    w = Worker("tcp://127.0.0.1:1", rank=0, world_size=2, timeout=30)
    fut = w.allreduce_async(np.ones(4, np.float32))
    w.close()
    with pytest.raises(WorkerClosedError):
        fut.result(timeout=5)
    with pytest.raises(WorkerClosedError):
        w.allreduce(np.ones(4, np.float32))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=2, world_size=2), "rank 2"),
        (dict(rank=0, world_size=1, block_size=0), "block_size"),
        (dict(rank=0, world_size=1, timeout=-1), "timeout"),
        # inf / NaN used to pass and kill the communication thread at the first op.
        (dict(rank=0, world_size=1, timeout=float("inf")), "timeout"),
        (dict(rank=0, world_size=1, timeout=float("nan")), "timeout"),
        (dict(rank=0, world_size=1, heartbeat=float("inf")), "heartbeat"),
        (dict(rank=0, world_size=1, heartbeat_timeout=float("nan")), "heartbeat"),
        (dict(rank=0, world_size=1, heartbeat_timeout=3e6), "heartbeat"),
        # An answer to a heartbeat could not come back in time: every quiet connection dropped.
        (dict(rank=0, world_size=1, heartbeat=5, heartbeat_timeout=5), "shorter than heartbeat_timeout"),
        (dict(rank=0, world_size=1, job=""), "job"),
        # A float or string rank used to pass (and reach the aggregator) or raise a raw TypeError.
        (dict(rank=0.5, world_size=2), "rank must be an integer"),
        (dict(rank="0", world_size=2), "rank must be an integer"),
        (dict(rank=0, world_size=2.0), "world_size must be an integer"),
        (dict(rank=0, world_size=1, job=5), "job must be a string"),  # a bare TypeError before
        (dict(rank=0, world_size=1, token=5), "token must be a string"),
    ],
)
def test_bad_config(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        Worker("tcp://127.0.0.1:1", **kwargs)


def test_config_from_torchrun_environment(monkeypatch, aggregator: Aggregator) -> None:
    monkeypatch.setenv("OMNIREDUCE_ADDRESS", aggregator.address)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("OMNIREDUCE_BLOCK_SIZE", "16")
    with Worker() as w:
        assert (w.rank, w.world_size, w.block_size, w.address) == (0, 1, 16, aggregator.address)
        np.testing.assert_array_equal(w.allreduce(np.arange(40, dtype=np.float32)), np.arange(40))
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        Worker()


def test_generation_and_token_precedence(monkeypatch) -> None:
    from worker.settings import WorkerSettings

    # torchelastic's restart count is read only when nothing above it is given: a bad one
    # does not win over generation= or OMNIREDUCE_GENERATION.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "abc")
    assert WorkerSettings.resolve(0, 1, generation=3).generation == 3
    assert WorkerSettings.resolve(0, 1, generation=np.int64(3)).generation == 3
    monkeypatch.setenv("OMNIREDUCE_GENERATION", "2")
    assert WorkerSettings.resolve(0, 1).generation == 2
    monkeypatch.delenv("OMNIREDUCE_GENERATION")
    with pytest.raises(ConfigError, match="TORCHELASTIC_RESTART_COUNT"):
        WorkerSettings.resolve(0, 1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "4")
    assert WorkerSettings.resolve(0, 1).generation == 4
    # A secret is taken as it is, from either source: its spaces are part of it.
    monkeypatch.setenv("OMNIREDUCE_TOKEN", " s3cret ")
    assert WorkerSettings.resolve(0, 1).token == " s3cret "
    assert WorkerSettings.resolve(0, 1, token="other").token == "other"
    monkeypatch.setenv("OMNIREDUCE_TOKEN", "")
    assert WorkerSettings.resolve(0, 1).token == ""


def test_unsupported_inputs_are_clear_errors(aggregator: Aggregator) -> None:
    with Worker(aggregator.address, rank=0, world_size=1) as w:
        with pytest.raises(ConfigError, match="uint32"):
            w.allreduce(np.ones(4, np.uint32))
        with pytest.raises(ConfigError, match="uint16"):
            w.allreduce(np.ones(4, np.uint16))  # bfloat16's storage, not a wire type of its own
        with pytest.raises(ConfigError, match="list"):
            w.allreduce([1.0, 2.0])
        assert isinstance(ConfigError("x"), OmniReduceError)


def test_torch_tensors_keep_type_shape_and_dtype(aggregator: Aggregator) -> None:
    torch = pytest.importorskip("torch")
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    inputs = [[torch.randint(-8, 9, (3, 50)).to(dt) for dt in dtypes] for _ in range(2)]

    def rank(r: int) -> list[Any]:
        with Worker(aggregator.address, rank=r, world_size=2, job="torch") as w:
            return [w.allreduce(t) for t in inputs[r]]

    results = run_ranks(2, rank)
    for i, dt in enumerate(dtypes):
        out = results[0][i]
        assert isinstance(out, torch.Tensor) and out.dtype == dt and out.shape == (3, 50)
        torch.testing.assert_close(out, inputs[0][i] + inputs[1][i], rtol=0, atol=0)


def test_inplace_and_out_write_the_sum_where_asked(aggregator: Aggregator) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    arrays = [sparse(rng, 40_000, 0.05).reshape(200, 200) for _ in range(2)]
    tensors = [torch.from_numpy(sparse(rng, 3000, 0.1)).reshape(30, 100) for _ in range(2)]
    expect_a, expect_t = arrays[0] + arrays[1], tensors[0] + tensors[1]
    bufs = [np.zeros(40_000, np.float32) for _ in range(2)]

    def rank(r: int) -> tuple[Any, ...]:
        with Worker(aggregator.address, rank=r, world_size=2, job="inplace", timeout=20) as w:
            a = w.allreduce(arrays[r].copy(), inplace=True)
            t = tensors[r].clone()
            t_out = w.allreduce(t, inplace=True)
            o = w.allreduce(arrays[r], out=bufs[r])
            # Refused before the op is numbered, so the ranks stay in step afterwards.
            with pytest.raises(ConfigError, match="contiguous"):
                w.allreduce(t.t(), inplace=True)
            with pytest.raises(ConfigError, match="out must be"):
                w.allreduce(arrays[r], out=np.zeros(5, np.float32))
            after = w.allreduce(arrays[r])
            return a, t, t_out, o, after

    for r, (a, t, t_out, o, after) in enumerate(run_ranks(2, rank)):
        np.testing.assert_array_equal(a, expect_a)
        assert t_out is t
        torch.testing.assert_close(t, expect_t, rtol=0, atol=0)
        assert np.shares_memory(o, bufs[r]) and o.shape == (200, 200)
        np.testing.assert_array_equal(o, expect_a)
        np.testing.assert_array_equal(after, expect_a)


def test_dense_and_auto_modes_are_exact_and_pick_by_density(aggregator: Aggregator, tmp_path, monkeypatch) -> None:
    from omnireduce.model import CostParams

    # Loopback-like fixed parameters, so the choice does not depend on this host's calibration.
    costs = CostParams(alpha=20e-6, beta=2e-10, scattered_s_per_byte=1.5e-9).save(str(tmp_path / "costs.json"))
    monkeypatch.setenv("OMNIREDUCE_COSTS", costs)
    rng = np.random.default_rng(11)
    n = 1 << 20
    dense = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    sparse_x = [sparse(rng, n, 0.01) for _ in range(2)]

    def rank(r: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        with Worker(aggregator.address, rank=r, world_size=2, job="mode-dense", timeout=20, mode="dense") as w:
            out["dense_mode"] = w.allreduce(sparse_x[r])
            out["dense_mode_sent"] = w.stats.last.blocks_sent
        with Worker(aggregator.address, rank=r, world_size=2, job="mode-auto", timeout=20, mode="auto") as w:
            sent = {"d": [], "s": []}
            for _ in range(3):
                out["auto_dense"] = w.allreduce(dense[r], key="d")
                sent["d"].append(w.stats.last.path)
                out["auto_sparse"] = w.allreduce(sparse_x[r], key="s")
                sent["s"].append((w.stats.last.path, w.stats.last.blocks_sent))
            out["auto_sent"] = sent
        return out

    blocks = n // 256
    for r, out in enumerate(run_ranks(2, rank)):
        np.testing.assert_array_equal(out["dense_mode"], sparse_x[0] + sparse_x[1])
        assert out["dense_mode_sent"] == blocks  # every block, zero or not
        np.testing.assert_array_equal(out["auto_dense"], dense[0] + dense[1])
        np.testing.assert_array_equal(out["auto_sparse"], sparse_x[0] + sparse_x[1])
        own = int(np.count_nonzero(sparse_x[r].reshape(-1, 256).any(1)))
        # The first op of each tensor measures (sparse); then dense goes dense, sparse stays sparse.
        assert out["auto_sent"]["s"] == [("sparse", own)] * 3
        assert out["auto_sent"]["d"] == ["sparse", "dense", "dense"]
    with pytest.raises(ConfigError, match="mode"):
        Worker(aggregator.address, rank=0, world_size=1, mode="fast")


def test_calls_refused_on_every_rank_and_cancelled_futures_keep_the_ranks_in_step(aggregator: Aggregator) -> None:
    """Whatever fails on every rank alike, or is cancelled, the op numbers of the ranks stay aligned."""
    x = np.arange(1000, dtype=np.float32)

    def rank(r: int) -> np.ndarray:
        with Worker(aggregator.address, rank=r, world_size=2, job="in-step", timeout=20, mode="auto") as w:
            with pytest.raises(ConfigError, match="hashable"):
                w.allreduce(x, key=["bucket", 0])
            with pytest.raises(ConfigError, match="together"):
                w.allreduce(x.copy(), inplace=True, out=np.zeros(1000, np.float32))
            frozen = x.copy()
            frozen.flags.writeable = False
            with pytest.raises(ConfigError, match="writeable"):
                w.allreduce(frozen, inplace=True)
            with pytest.raises(ConfigError, match="out must be"):
                w.allreduce(x, out=np.zeros(3, np.float32))
            # A cancelled op still runs (the other rank waits for it); its result goes nowhere.
            f = w.allreduce_async(x)
            f.cancel()
            return w.allreduce(x * 2)

    for y in run_ranks(2, rank):
        np.testing.assert_array_equal(y, x * 4)


def test_a_call_refused_on_one_rank_fails_at_once_on_every_rank_and_keeps_them_in_step(
    aggregator: Aggregator,
) -> None:
    """Bad arguments on one rank: that rank raises their error, the others a PeerRefusedError
    naming it and why, long before their timeout; the next ops pair up as before."""
    x = np.arange(1000, dtype=np.float32)

    def rank(r: int) -> tuple[float, str, np.ndarray]:
        with Worker(aggregator.address, rank=r, world_size=3, job="one-refuses", timeout=30) as w:
            t = time.monotonic()
            if r == 1:
                with pytest.raises(ConfigError, match="weight must be"):
                    w.allreduce(x, weight=-2.0)
                text = ""
            else:
                with pytest.raises(PeerRefusedError) as info:
                    w.allreduce(x, weight=1.0)
                assert info.value.ranks == (1,) and info.value.op == 0
                text = str(info.value)
            took = time.monotonic() - t
            return took, text, w.allreduce(x * (r + 1))

    results = run_ranks(3, rank)
    for r, (took, text, y) in enumerate(results):
        assert took < 5, (r, took)
        np.testing.assert_array_equal(y, x * 6)
        if r != 1:
            assert "rank 1 refused the op: ConfigError: weight must be" in text, text
    assert aggregator.engine.counters.errors.get("refused") == 1


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "30"])
def test_aggregator_refuses_a_timeout_that_would_fail_or_never_end_every_op(timeout) -> None:
    # 0 used to fail every op at its first expiry check (the CLI's "0 disables" is None here).
    with pytest.raises(ConfigError, match="timeout"):
        Aggregator(listen="tcp://127.0.0.1:0", timeout=timeout)


def test_serve_forever_returns_cleanly_when_closed_from_another_thread(caplog) -> None:
    # The documented use: close() used to terminate the context under the serving thread's
    # poll, which ended serve_forever with ContextTerminated, logged as a crash.
    import threading

    agg = Aggregator(listen="tcp://127.0.0.1:0")
    ended: list[BaseException | None] = []

    def serve() -> None:
        try:
            agg.serve_forever()
            ended.append(None)
        except BaseException as e:  # noqa: BLE001 - the test checks that there was none
            ended.append(e)

    thread = threading.Thread(target=serve)
    thread.start()
    with Worker(agg.address, rank=0, world_size=1, job="forever", timeout=10) as w:
        np.testing.assert_array_equal(w.allreduce(np.ones(4, np.float32)), np.ones(4))
    agg.close()
    thread.join(10)
    assert ended == [None] and agg.failure is None
    assert "loop died" not in caplog.text


@pytest.mark.parametrize("own_context", [True, False])
def test_serve_forever_ends_when_a_signal_handler_on_its_thread_closes_it(own_context: bool) -> None:
    # A daemon's SIGTERM handler runs on the serving thread: close() must not wait for that
    # loop (it would wait for itself); the loop ends, closing the sockets and the context.
    import signal

    import zmq

    ctx = None if own_context else zmq.Context()
    agg = Aggregator(listen="tcp://127.0.0.1:0", context=ctx)
    old = signal.signal(signal.SIGALRM, lambda *_: agg.close())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        agg.serve_forever()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert agg.failure is None and not agg.alive
    if ctx is not None:
        ctx.term()


@pytest.mark.parametrize("kwargs, match", [
    (dict(listen="tcp://127.0.0.1:99999"), "must be 0-65535"),  # ZeroMQ took it modulo 65536
    (dict(listen="tcp://127.0.0.1:-1"), "must be 0-65535"),
    (dict(metrics_port=70000), "metrics_port must be 0-65535"),
])
def test_aggregator_refuses_bad_ports_and_leaves_no_thread(kwargs, match) -> None:
    import threading

    before = set(threading.enumerate())
    with pytest.raises(ConfigError, match=match):
        Aggregator(**{"listen": "tcp://127.0.0.1:0", **kwargs})
    assert set(threading.enumerate()) <= before


def test_limits_beyond_what_zeromq_takes_are_a_config_error() -> None:
    from aggregator.limits import Limits

    with pytest.raises(ConfigError, match="max_queued_messages must be at most 2147483647"):
        Limits(max_queued_messages=3_000_000_000)


def test_an_ipv6_endpoint_serves_workers() -> None:
    try:
        agg = Aggregator(listen="tcp://[::1]:0").start()
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    with agg:
        assert agg.address.startswith("tcp://[::1]:")
        with Worker(agg.address, rank=0, world_size=1, job="v6", timeout=10) as w:
            np.testing.assert_array_equal(w.allreduce(np.ones(4, np.float32)), np.ones(4))
    # An IPv4 endpoint keeps its IPv4 address (not an IPv4-mapped IPv6 one).
    with Aggregator(listen="tcp://127.0.0.1:0") as v4:
        assert v4.address.startswith("tcp://127.0.0.1:")


def test_a_refusal_whose_text_utf8_cannot_encode_is_sent_escaped(aggregator: Aggregator) -> None:
    # A surrogate-escaped file name in the error once killed the communication thread.
    x = np.ones(10, np.float32)

    def rank(r: int) -> tuple[str, np.ndarray]:
        with Worker(aggregator.address, rank=r, world_size=2, job="surrogate", timeout=20) as w:
            if r == 0:
                w.refuse(ValueError("cannot read /data/\udcff.npy"))
                text = ""
            else:
                with pytest.raises(PeerRefusedError) as info:
                    w.allreduce(x)
                text = str(info.value)
            return text, w.allreduce(x)

    (_, y0), (text, y1) = run_ranks(2, rank)
    assert "rank 0 refused the op: ValueError: cannot read /data/\\udcff.npy" in text, text
    np.testing.assert_array_equal(y0, 2 * x)
    np.testing.assert_array_equal(y1, 2 * x)


def test_a_refusal_made_before_the_first_handshake_reaches_the_others_when_closing_at_once() -> None:
    # Rank 0 refuses its first op and closes right away, before its connection is up: the
    # ABORT waited in the outbox and was dropped with the socket, so rank 1 waited for its timeout.
    with Aggregator(listen="tcp://127.0.0.1:0", timeout=30).start() as agg:
        with Worker(agg.address, rank=1, world_size=2, job="refuse-early", timeout=10) as w1:
            deadline = time.monotonic() + 5
            while (agg.engine.job_info("refuse-early") or {}).get("ranks") != [1] and time.monotonic() < deadline:
                time.sleep(0.01)
            w0 = Worker(agg.address, rank=0, world_size=2, job="refuse-early", timeout=10)
            with pytest.raises(ConfigError):
                w0.allreduce(np.ones(8, np.float32), weight=-1.0)
            w0.close()
            started = time.monotonic()
            with pytest.raises(PeerRefusedError, match="rank 0 refused the op: ConfigError: weight must be"):
                w1.allreduce(np.ones(8, np.float32))
            assert time.monotonic() - started < 5


def test_stats_sum_every_counter() -> None:
    """Every integer counter of OpStats adds up in merge_parallel and Stats.add (a field added
    to OpStats and left out of the sums would read 0 in the totals)."""
    import dataclasses

    from worker.stats import OpStats, Stats, merge_parallel

    counters = [f.name for f in dataclasses.fields(OpStats) if f.type == "int" and f.name not in ("op", "rounds")]
    a = OpStats(op=7, rounds=2, seconds=0.5, **{n: i + 1 for i, n in enumerate(counters)})
    # Both sparse: a dense part counts its blocks in the union (its own test below).
    b = OpStats(op=7, rounds=3, seconds=0.25, **{n: 10 * (i + 1) for i, n in enumerate(counters)})
    merged = merge_parallel([a, b], seconds=0.6)
    assert merged.op == 7 and merged.rounds == 3 and merged.seconds == 0.6 and merged.path == "sparse"
    for i, n in enumerate(counters):
        assert getattr(merged, n) == 11 * (i + 1), n
    stats = Stats()
    stats.add(a)
    stats.add(b)
    assert stats.ops == 2 and stats.last is b
    assert stats.total.rounds == 5 and stats.total.seconds == 0.75
    for i, n in enumerate(counters):
        assert getattr(stats.total, n) == 11 * (i + 1), n


def test_an_op_timed_out_on_one_rank_fails_at_once_on_the_others() -> None:
    """Rank 0's own timeout (1 s) ends its op before rank 1 starts it; the aggregator's is 30 s.
    Told (an ABORT), the aggregator fails the op for rank 1 at once, naming rank 0's timeout,
    and the next op pairs up as before."""
    with Aggregator(timeout=30).start() as agg:
        w0 = Worker(agg.address, rank=0, world_size=2, job="local-timeout", timeout=1)
        w1 = Worker(agg.address, rank=1, world_size=2, job="local-timeout", timeout=20)
        try:
            x = np.arange(16, dtype=np.float32)
            with pytest.raises(OpTimeoutError):
                w0.allreduce(x)
            # Rank 0's START is in: a START of rank 1 that overtook its ABORT would complete the op
            # (rightly: every rank's data is there). The test looks at the ABORT arriving first.
            deadline = time.monotonic() + 5
            while agg.engine.ops_failed == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert agg.engine.ops_failed == 1
            started = time.monotonic()
            with pytest.raises(PeerRefusedError, match=r"rank 0 refused the op: OpTimeoutError.*the op still waited "
                                                        r"for ranks \[1\] here\)"):
                w1.allreduce(x)
            assert time.monotonic() - started < 5
            futures = [w.allreduce_async(x * (r + 1)) for r, w in enumerate((w0, w1))]
            for f in futures:
                np.testing.assert_array_equal(f.result(10), x * 3)
        finally:
            w0.close()
            w1.close()


def test_a_part_sent_the_dense_way_counts_every_block_in_the_union() -> None:
    # A sharded op in auto mode: rank 0's first part went dense (its host's cost file), rank 1's
    # sparse; rank 1 measures that part's union as every block (rank 0 sent them all). Both must
    # record the same union density, or they size the key's next op apart (a MismatchError).
    from worker.stats import OpStats, merge_parallel

    rank0 = merge_parallel([OpStats(blocks=100, union_blocks=0, path="dense"),
                            OpStats(blocks=100, union_blocks=30, path="sparse")], 0.1)
    rank1 = merge_parallel([OpStats(blocks=100, union_blocks=100, path="sparse"),
                            OpStats(blocks=100, union_blocks=30, path="sparse")], 0.1)
    assert rank0.union_density == rank1.union_density == 0.65
    assert (rank0.path, rank1.path) == ("dense", "sparse")


def test_an_address_without_its_scheme_or_port_says_which_form_is_expected() -> None:
    import socket

    for address in ("127.0.0.1:5555", "tcp://127.0.0.1"):
        with pytest.raises(ConfigError, match=r"expected tcp://host:port, e\.g\. tcp://127\.0\.0\.1:5555"):
            Worker(address, rank=0, world_size=1, job="form")
    with pytest.raises(OSError, match=r"cannot listen on '0\.0\.0\.0:5555'.*expected tcp://host:port"):
        Aggregator(listen="0.0.0.0:5555")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # Not taken for the listening port.
        with pytest.raises(OSError, match=f"cannot serve metrics on port {port}"):
            Aggregator(listen="tcp://127.0.0.1:0", metrics_port=port)


def test_the_default_job_is_one_per_torch_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two runs of one script on one aggregator both took "default": the second took over the
    # first's ranks, which failed. A launch's rendezvous address is the same on its ranks only.
    from worker.settings import WorkerSettings

    monkeypatch.delenv("OMNIREDUCE_JOB", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert WorkerSettings.resolve(0, 1).job == "default"
    monkeypatch.setenv("MASTER_ADDR", "198.18.0.2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert WorkerSettings.resolve(0, 1).job == "torchrun-198.18.0.2:29500"
    monkeypatch.setenv("OMNIREDUCE_JOB", "mine")
    assert WorkerSettings.resolve(0, 1).job == "mine"
    assert WorkerSettings.resolve(0, 1, job="given").job == "given"
