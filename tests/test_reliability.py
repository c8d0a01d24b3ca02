"""Faults with real processes: workers killed or paused, the aggregator killed and restarted;
and, in-process at the end, how the engine treats ranks that go away or leave.

Each test checks that the others get a clear error (naming the job, op and rank)
well within the stated time, that the aggregator is still serving, and that the
next job (a restart with a new generation, as torchelastic does) sums correctly.
Detection times are printed (``pytest -s``) for the record; the bounds asserted
are loose because this machine is shared and noisy.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aggregator import Aggregator, Engine
from omnireduce.errors import ConnectionLostError, OpTimeoutError, PeerLostError, StaleGenerationError
from omnireduce.protocol import Bye, ErrorCode, Hello, encode
from tests.faults import Proc, expected, start_daemon, tensor
from tests.helpers import error_replies, peer_of, start_frames, wire
from worker import Worker

N = 20_000
# Heartbeats on the test aggregators: a silent connection is dropped after HB_TIMEOUT.
HB, HB_TIMEOUT = 0.2, 1.0
OP_TIMEOUT = 20.0


def _aggregator(**kw: Any) -> Aggregator:
    kw.setdefault("timeout", OP_TIMEOUT)
    kw.setdefault("heartbeat", HB)
    kw.setdefault("heartbeat_timeout", HB_TIMEOUT)
    return Aggregator(**kw).start()


def _until(pred: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def _members(agg: Aggregator, job: str) -> list[int]:
    info = agg.engine.job_info(job)
    return info["ranks"] if info else []


def _workers(address: str, job: str, ranks: tuple[int, ...], world: int, generation: int = 0) -> list[Worker]:
    return [Worker(address, rank=r, world_size=world, job=job, generation=generation, timeout=30) for r in ranks]


@contextlib.contextmanager
def _ranks(agg: Aggregator, job: str, generation: int = 0, **env: str) -> Iterator[tuple[Proc, list[Worker]]]:
    """Ranks 0 and 1 as Workers in this process, rank 2 as a process the test can signal."""
    victim = Proc(agg.address, 2, 3, job, generation, **env)
    ws: list[Worker] = []
    try:
        ws = _workers(agg.address, job, (0, 1), 3, generation)
        yield victim, ws
    finally:
        for w in ws:
            w.close()
        victim.close()


def _submit(ws: list[Worker], seed: int) -> list[Any]:
    """Ranks 0 and 1 start an op of the seed's tensors."""
    return [w.allreduce_async(tensor(seed, r, N)) for r, w in enumerate(ws)]


def _exact_round(victim: Proc, ws: list[Worker], seed: int) -> None:
    """One op of all three ranks; every rank gets the exact sum."""
    futs = _submit(ws, seed)
    assert victim.allreduce(seed, N) == {"ok": True, "exact": True}
    for f in futs:
        np.testing.assert_array_equal(f.result(30), expected(seed, 3, N))


def _restart_job_and_check(agg: Aggregator, job: str, generation: int) -> None:
    """The torchelastic pattern: every rank restarts with a new generation; the job sums correctly."""
    with _ranks(agg, job, generation) as (victim, ws):
        _exact_round(victim, ws, 50)
        assert agg.engine.job_info(job)["generation"] == generation


def _expect_peer_lost(futs: list[Any], job: str, op: int, rank: int, since: float, what: str) -> float:
    for f in futs:
        with pytest.raises(PeerLostError) as info:
            f.result(OP_TIMEOUT)
        assert (info.value.job, info.value.op, info.value.ranks) == (job, op, (rank,)), str(info.value)
    took = time.monotonic() - since
    print(f"\n{what}: survivors failed {took * 1000:.0f} ms after the fault")
    return took


@pytest.mark.slow
def test_worker_killed_before_an_op() -> None:
    job = "kill-before"
    with _aggregator() as agg:
        with _ranks(agg, job) as (victim, ws):
            _until(lambda: _members(agg, job) == [0, 1, 2])  # every rank said HELLO
            t0 = time.monotonic()
            victim.signal(signal.SIGKILL)
            assert _expect_peer_lost(_submit(ws, 1), job, 0, 2, t0, "SIGKILL before an op") < 5
        _restart_job_and_check(agg, job, generation=1)


@pytest.mark.slow
def test_worker_killed_during_an_op(monkeypatch: pytest.MonkeyPatch) -> None:
    job = "kill-during"
    # Columns for only part of the tensor's blocks: the op has rounds after its START
    # (a one-row op is eager, done as soon as every START is in).
    monkeypatch.setenv("OMNIREDUCE_MESSAGE_BLOCKS", "4")
    with _aggregator() as agg:
        with _ranks(agg, job) as (victim, ws):
            futs = _submit(ws, 2)
            victim.send(cmd="allreduce", seed=2, n=N, hang=True)
            victim.wait_for(lambda m: m.get("hanging"), 15)  # round 0 done: the op is in flight
            assert agg.engine.job_info(job)["ops"] == [0]
            t0 = time.monotonic()
            victim.signal(signal.SIGKILL)
            assert _expect_peer_lost(futs, job, 0, 2, t0, "SIGKILL during an op") < 5
            assert agg.engine.active_ops == 0 and agg.engine.held_bytes == 0  # the op's state is freed
        _restart_job_and_check(agg, job, generation=1)


@pytest.mark.slow
def test_worker_killed_after_an_op() -> None:
    job = "kill-after"
    with _aggregator() as agg:
        with _ranks(agg, job) as (victim, ws):
            _exact_round(victim, ws, 3)
            t0 = time.monotonic()
            victim.signal(signal.SIGKILL)
            # The next op cannot complete without rank 2: it fails fast instead of timing out.
            assert _expect_peer_lost(_submit(ws, 4), job, 1, 2, t0, "SIGKILL after an op") < 5
        _restart_job_and_check(agg, job, generation=1)


@pytest.mark.slow
def test_worker_paused_past_heartbeat_timeout_then_resumed() -> None:
    job = "paused"
    with _aggregator() as agg:
        with _ranks(agg, job) as (victim, ws):
            _exact_round(victim, ws, 5)
            victim.signal(signal.SIGSTOP)
            t0 = time.monotonic()
            futs = _submit(ws, 6)
            # Noticed by the heartbeats (1 s), long before the op timeout (20 s). The earliest a
            # heartbeat timeout can fire is HB_TIMEOUT - HB after the pause (a PING just before it).
            took = _expect_peer_lost(futs, job, 1, 2, t0, "SIGSTOP (heartbeat timeout 1 s)")
            assert (HB_TIMEOUT - HB) * 0.6 < took < OP_TIMEOUT / 2
            victim.signal(signal.SIGCONT)
            # The resumed worker learns its op 1 failed too, and comes back as rank 2.
            late = victim.allreduce(6, N)
            assert late["ok"] is False and late["error"] in ("PeerLostError", "ConnectionLostError"), late
            _until(lambda: _members(agg, job) == [0, 1, 2] and not agg.engine.job_info(job)["lost"])
            _exact_round(victim, ws, 7)


@pytest.mark.slow
def test_worker_paused_without_heartbeats_times_out_naming_it() -> None:
    job = "paused-nohb"
    with _aggregator(timeout=1.5, heartbeat=0) as agg:
        with _ranks(agg, job, OMNIREDUCE_HEARTBEAT="0") as (victim, ws):
            _until(lambda: _members(agg, job) == [0, 1, 2])
            victim.signal(signal.SIGSTOP)
            t0 = time.monotonic()
            for f in _submit(ws, 8):
                with pytest.raises(OpTimeoutError) as info:
                    f.result(15)
                assert (info.value.job, info.value.op, info.value.ranks) == (job, 0, (2,))
            took = time.monotonic() - t0
            print(f"\nSIGSTOP without heartbeats: op timeout (1.5 s) after {took * 1000:.0f} ms")
            assert 1.4 < took < 6
        _restart_job_and_check(agg, job, generation=1)


@pytest.mark.slow
def test_restarted_generation_fails_the_old_ones_ops() -> None:
    with _aggregator() as agg:
        old = Worker(agg.address, rank=0, world_size=2, job="gen", timeout=30)
        fut = old.allreduce_async(np.ones(10, np.float32))  # waits for rank 1, which never comes
        _until(lambda: agg.engine.job_info("gen") and agg.engine.job_info("gen")["ops"] == [0])
        new = _workers(agg.address, "gen", (0, 1), 2, generation=1)
        with pytest.raises(StaleGenerationError, match="generation 1"):
            fut.result(10)
        # The old generation's connection is refused from now on; the new one works.
        with pytest.raises(StaleGenerationError):
            old.allreduce(np.ones(10, np.float32))
        futs = [w.allreduce_async(np.full(10, r + 1.0, np.float32)) for r, w in enumerate(new)]
        for f in futs:
            np.testing.assert_array_equal(f.result(30), np.full(10, 3.0))
        for w in [old, *new]:
            w.close()


# The aggregator daemon as a process, killed and started again on the same port.


def _daemon(listen: str) -> tuple[subprocess.Popen, str]:
    return start_daemon(listen, "--timeout", "20", "--heartbeat", str(HB), "--heartbeat-timeout", str(HB_TIMEOUT))


@pytest.fixture
def daemons() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


@pytest.mark.slow
def test_aggregator_killed_and_restarted(daemons: list[subprocess.Popen]) -> None:
    proc, address = _daemon("tcp://127.0.0.1:0")
    daemons.append(proc)
    ws = _workers(address, "agg-restart", (0, 1, 2), 3)
    try:
        futs = _submit(ws, 9)
        for f in futs:
            np.testing.assert_array_equal(f.result(30), expected(9, 3, N))
        # Freeze it so op 1 is surely in flight when it dies.
        proc.send_signal(signal.SIGSTOP)
        futs = _submit(ws, 10)
        time.sleep(0.2)
        t0 = time.monotonic()
        proc.kill()
        for f in futs:
            with pytest.raises(ConnectionLostError) as info:
                f.result(15)
            assert (info.value.job, info.value.op) == ("agg-restart", 1)
        took = time.monotonic() - t0
        print(f"\naggregator SIGKILL: workers failed {took * 1000:.0f} ms after it")
        assert took < 5
        proc.wait(10)
        proc, again = _daemon(address)  # same port
        daemons.append(proc)
        assert again == address
        # The same Worker objects reconnect and work for new ops.
        futs = _submit(ws, 11)
        for f in futs:
            np.testing.assert_array_equal(f.result(30), expected(11, 3, N))
        assert proc.poll() is None
    finally:
        for w in ws:
            w.close()


# The engine's view of ranks that go away (in-process, no sockets: fast).


def test_a_lost_rank_fails_ops_now_and_later_until_it_returns() -> None:
    engine = Engine()
    assert engine.handle(peer_of(1), wire(encode(Hello("j", 1, 3, 0, "")))) == []
    engine.handle(peer_of(0), start_frames(0, 3, op=0))
    errs = error_replies(engine.peer_gone(peer_of(1), "disconnected"))
    assert errs == [(peer_of(0), ErrorCode.PEER_LOST, "rank 1 disconnected")]
    assert engine.job_info("j")["lost"] == {1: "disconnected"}
    (_, code, message), = error_replies(engine.handle(peer_of(2), start_frames(2, 3, op=1)))
    assert code == ErrorCode.PEER_LOST and "rank 1 disconnected" in message
    # Rank 1 comes back on a new connection: new ops work again.
    engine.handle(b"rank1-again", wire(encode(Hello("j", 1, 3, 0, ""))))
    assert engine.job_info("j")["lost"] == {}
    assert engine.handle(peer_of(0), start_frames(0, 3, op=2)) == []


def test_bye_leaves_without_counting_as_lost() -> None:
    engine = Engine()
    for r in range(2):
        engine.handle(peer_of(r), wire(encode(Hello("j", r, 2, 0, ""))))
    engine.handle(peer_of(0), start_frames(0, 2, op=0))
    # Rank 0 closes its worker on purpose: the op it joined fails; rank 0 is not "lost".
    errs = error_replies(engine.handle(peer_of(0), wire(encode(Bye("j", 0)))))
    assert errs == [(peer_of(0), ErrorCode.PEER_LOST, "rank 0 left (its worker was closed)")]
    assert engine.job_info("j")["lost"] == {} and engine.job_info("j")["ranks"] == [1]
    assert engine.peer_gone(peer_of(0)) == []
    # An op rank 0 never joins fails at once (it waited for the timeout), until rank 0 is back.
    (_, code, message), = error_replies(engine.handle(peer_of(1), start_frames(1, 2, op=1)))
    assert code == ErrorCode.PEER_LOST and message == "rank 0 left (its worker was closed)"
    engine.handle(b"rank0-again", wire(encode(Hello("j", 0, 2, 0, ""))))
    assert engine.handle(peer_of(1), start_frames(1, 2, op=2)) == []
    engine.handle(b"rank0-again", wire(encode(Bye("j", 0))))
    engine.handle(peer_of(1), wire(encode(Bye("j", 1))))
    assert engine.job_info("j") is None  # nobody left: the job (and its token) is forgotten


def test_workers_made_anew_one_rank_at_a_time_still_pair_their_first_ops() -> None:
    # Two phases of `with Worker(job=...)` in a row: rank 0's new worker says HELLO before rank
    # 1's old one says goodbye, so the job stays. The new workers number from 0 again: their
    # ops up to the ones the old workers began wait for each other, as before (they failed at
    # once, "rank 1 left"); beyond them, one that a departed rank never joins fails at once.
    from omnireduce.protocol import Abort, Result, decode

    one = dict(length=16, block_size=8, message_blocks=2, streams=1)  # one START each: done when both came
    engine = Engine()
    for r in range(2):
        engine.handle(b"old%d" % r, wire(encode(Hello("j", r, 2, 0, ""))))
    for op in range(3):
        for r in range(2):
            engine.handle(b"old%d" % r, start_frames(r, 2, op=op, **one))
    engine.handle(b"old0", wire(encode(Bye("j", 0))))
    engine.handle(b"new0", wire(encode(Hello("j", 0, 2, 0, ""))))
    engine.handle(b"old1", wire(encode(Bye("j", 1))))
    assert engine.handle(b"new0", start_frames(0, 2, op=0, **one)) == []  # waits for rank 1's new worker
    engine.handle(b"new1", wire(encode(Hello("j", 1, 2, 0, ""))))
    out = [decode(wire(f))[0] for _, f in engine.handle(b"new1", start_frames(1, 2, op=0, **one))]
    assert out and all(isinstance(m, Result) for m in out), out
    engine.handle(b"new1", wire(encode(Bye("j", 1))))
    assert engine.handle(b"new0", start_frames(0, 2, op=1, **one)) == []  # up to the mark (op 2): waits
    engine.handle(b"new0", wire(encode(Abort("j", 0, 1, "done"))))
    engine.handle(b"new0", wire(encode(Abort("j", 0, 2, "done"))))
    (_, code, message), = error_replies(engine.handle(b"new0", start_frames(0, 2, op=3, **one)))
    assert code == ErrorCode.PEER_LOST and message == "rank 1 left (its worker was closed)"


def test_the_daemon_exits_non_zero_when_its_serving_loop_dies(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A daemon whose loop died must exit (for its supervisor to restart it), not sleep on as if healthy."""
    from aggregator import cli, server

    def broken_step(self: Aggregator, events: Any) -> None:
        raise RuntimeError("injected serving failure")

    monkeypatch.setattr(server.Aggregator, "serve_step", broken_step)
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)  # the test's thread is not the main one
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(cli.main(["--listen", "tcp://127.0.0.1:0"])), daemon=True)
    t.start()
    t.join(15)
    assert not t.is_alive(), "the daemon kept running after its serving loop died"
    assert result == [1]
    assert "injected serving failure" in caplog.text


def test_a_worker_refused_for_the_aggregators_job_cap_is_served_once_there_is_room() -> None:
    # The refusal of its HELLO stuck to the connection: every later op failed at once,
    # though the aggregator had room again (a new worker of the job was served).
    from aggregator.limits import Limits
    from omnireduce.errors import LimitError

    agg = Aggregator(listen="tcp://127.0.0.1:0", timeout=5, limits=Limits(max_jobs=1)).start()
    a = Worker(agg.address, rank=0, world_size=1, job="cap-a", timeout=5)
    np.testing.assert_array_equal(a.allreduce(np.ones(4, np.float32)), np.ones(4, np.float32))
    b = Worker(agg.address, rank=0, world_size=1, job="cap-b", timeout=5)  # its HELLO after a's job is made
    try:
        for _ in range(2):
            with pytest.raises(LimitError, match="limit of 1 jobs"):
                b.allreduce(np.ones(4, np.float32))
        a.close()
        deadline = time.monotonic() + 5
        while agg.engine.active_jobs and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(2):
            np.testing.assert_array_equal(b.allreduce(np.full(4, 3.0, np.float32)), np.full(4, 3.0, np.float32))
    finally:
        a.close()
        b.close()
        agg.close()
