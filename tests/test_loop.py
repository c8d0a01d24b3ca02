"""The communication loop: one thread serves every shard of a sharded worker, and its failure reaches every caller."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from aggregator import Aggregator
from omnireduce import ConfigError, WorkerClosedError
from tests.helpers import run_ranks
from tests.test_sharding import _reduce_all
from worker import ShardedWorker, Worker, connect
from worker.connection import Connection
from worker.loop import CommLoop

# shard_bytes=0: every op goes to every shard, however small.
ONE = dict(block_size=16, message_blocks=4, streams=2)  # a plain worker's
SMALL = {**ONE, "shard_bytes": 0}


def _worker_threads(rank: int) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"omnireduce-worker-r{rank}"]


def test_sharded_worker_has_one_thread(shards: list[Aggregator]) -> None:
    addresses = [a.address for a in shards]
    before = len(_worker_threads(7))
    w = connect(addresses, rank=7, world_size=8, job="one-thread", timeout=10, **SMALL)
    try:
        assert isinstance(w, ShardedWorker)
        assert len(_worker_threads(7)) == before + 1
        assert {s._connection._loop for s in w.shards} == {w._loop}
    finally:
        w.close()
    deadline = time.monotonic() + 5
    while len(_worker_threads(7)) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_worker_threads(7)) == before


def test_shared_loop_sums_like_separate_threads(shards: list[Aggregator]) -> None:
    rng = np.random.default_rng(3)
    inputs = [[rng.standard_normal(1000).astype(np.float32) * (rng.random(1000) < 0.3) for _ in range(5)]
              for _ in range(2)]
    results = _reduce_all([a.address for a in shards], 2, "shared-loop", inputs)
    for k in range(5):
        np.testing.assert_array_equal(results[0][k], inputs[0][k] + inputs[1][k])
        np.testing.assert_array_equal(results[1][k], results[0][k])


def test_loop_death_fails_every_shard_and_later_ops(shards: list[Aggregator],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the thread fails the ops pending on every shard, refuses later ops, and close returns."""
    addresses = [a.address for a in shards[:2]]
    w = connect(addresses, rank=0, world_size=2, job="loop-death", timeout=10, **SMALL)
    try:
        boom = RuntimeError("injected bug")
        calls = {"n": 0}
        original = Connection._take

        def take(self: Connection, sub: Any) -> None:
            calls["n"] += 1
            original(self, sub)
            if calls["n"] == 2:  # after both shards' halves of the op started
                raise boom

        monkeypatch.setattr(Connection, "_take", take)
        fut = w.allreduce_async(np.ones(100, np.float32))
        with pytest.raises(WorkerClosedError, match="communication thread died"):
            fut.result(timeout=10)
        # A later submission says why the worker is closed.
        with pytest.raises(WorkerClosedError, match="thread died: RuntimeError\\('injected bug'\\)"):
            w.allreduce_async(np.ones(100, np.float32))
    finally:
        t0 = time.monotonic()
        w.close()
        assert time.monotonic() - t0 < 5


def test_close_from_a_callback_does_not_deadlock(aggregator: Aggregator) -> None:
    """A callback on the communication thread may close the worker; the close happens after it."""

    def rank(r: int) -> BaseException | None:
        w = Worker(aggregator.address, rank=r, world_size=2, job="cb-close", timeout=10, **ONE)
        closed = threading.Event()
        fut: Future = w.allreduce_async(np.ones(50, np.float32))
        fut.add_done_callback(lambda _f: (w.close(), closed.set()))
        fut.result(timeout=10)
        assert closed.wait(5)
        with pytest.raises(WorkerClosedError):
            w.allreduce_async(np.ones(50, np.float32))
        w.close()
        return None

    before = len(_worker_threads(0)) + len(_worker_threads(1))
    run_ranks(2, rank)
    deadline = time.monotonic() + 5
    while len(_worker_threads(0)) + len(_worker_threads(1)) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_worker_threads(0)) + len(_worker_threads(1)) == before


@pytest.mark.parametrize("sharded", [False, True])
def test_close_from_a_callback_says_goodbye(shards: list[Aggregator], sharded: bool,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """The context was terminated while the thread still polled its sockets: the thread died
    before its BYE, and the aggregator counted the rank as lost, which ends the job."""
    addresses = [a.address for a in shards[:2]] if sharded else shards[0].address
    for i in range(4):  # it raced: 5 in 8 plain workers, every sharded one
        job = f"cb-bye-{sharded}-{i}"
        ws = [connect(addresses, rank=r, world_size=2, job=job, timeout=10, **(SMALL if sharded else ONE))
              for r in range(2)]
        try:
            futs = [w.allreduce_async(np.ones(50, np.float32)) for w in ws]
            futs[0].add_done_callback(lambda _f, w=ws[0]: w.close())
            for f in futs:
                f.result(timeout=10)
            used = range(2 if sharded else 1)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(
                    (shards[k].engine.job_info(job) or {"ranks": [0, 1]})["ranks"] == [0, 1] for k in used):
                time.sleep(0.01)
            for k in used:
                info = shards[k].engine.job_info(job)
                assert info is not None and info["lost"] == {} and info["ranks"] == [1], (i, k, info)
        finally:
            for w in ws:
                w.close()
    assert "communication thread" not in caplog.text


@pytest.mark.parametrize("sharded", [False, True])
def test_waiting_for_a_pending_op_in_a_callback_raises_instead_of_blocking_the_thread(
        aggregator: Aggregator, shards: list[Aggregator], sharded: bool) -> None:
    """A callback that waited there for another op blocked the communication thread for good:
    that op never completed, nor timed out (the thread does that too), nor did any other."""
    address = [a.address for a in shards[:2]] if sharded else aggregator.address
    second_sent = threading.Event()

    def rank(r: int) -> tuple[list[str], np.ndarray]:
        with connect(address, rank=r, world_size=2, job=f"cb-wait-{sharded}", timeout=10, **ONE) as w:
            seen: list[str] = []
            first = w.allreduce_async(np.ones(50, np.float32))
            if r == 0:
                second = w.allreduce_async(np.full(50, 2.0, np.float32))

                def wait_for_second(_f: Future) -> None:
                    with pytest.raises(TimeoutError):
                        second.result(timeout=0)  # a poll is no wait
                    for call in (second.result, second.exception):
                        try:
                            call()
                        except RuntimeError as e:
                            seen.append(str(e))
                    # Still pending: rank 1 sends it once this callback returned.
                    second_sent.set()

                first.add_done_callback(wait_for_second)
            else:
                assert second_sent.wait(10)
                second = w.allreduce_async(np.full(50, 2.0, np.float32))
            first.result(timeout=10)
            return seen, second.result(timeout=10)

    (seen, y0), (_, y1) = run_ranks(2, rank, timeout=30)
    assert len(seen) == 2 and all("would wait for that thread itself" in e for e in seen), seen
    np.testing.assert_array_equal(y0, np.full(50, 4.0, np.float32))
    np.testing.assert_array_equal(y1, y0)


def test_attach_to_closed_loop_is_refused(aggregator: Aggregator) -> None:
    loop = CommLoop(name="omnireduce-worker-test")
    loop.close()
    with pytest.raises(WorkerClosedError):
        Worker(aggregator.address, rank=0, world_size=1, job="closed-loop", loop=loop, **ONE)


def test_ops_after_the_shared_loop_closed_fail_instead_of_hanging(aggregator: Aggregator) -> None:
    loop = CommLoop(name="omnireduce-worker-test")
    w = Worker(aggregator.address, rank=0, world_size=1, job="loop-closed-under", timeout=10, loop=loop, **ONE)
    try:
        np.testing.assert_array_equal(w.allreduce(np.ones(50, np.float32)), np.ones(50, np.float32))
        loop.close()
        with pytest.raises(WorkerClosedError, match="shared was closed"):
            w.allreduce_async(np.ones(50, np.float32))
    finally:
        w.close()


def test_ops_racing_the_shared_loop_close_all_end(aggregator: Aggregator) -> None:
    """Every op submitted while the loop closes is refused, answered or failed: none is left waiting."""
    for attempt in range(5):
        loop = CommLoop(name="omnireduce-worker-test")
        w = Worker(aggregator.address, rank=0, world_size=1, job=f"loop-race-{attempt}", timeout=10, loop=loop, **ONE)
        futures: list[Future] = []
        stop = threading.Event()

        def submit(w: Worker, futures: list[Future], stop: threading.Event) -> None:
            while not stop.is_set() and len(futures) < 300:
                try:
                    futures.append(w.allreduce_async(np.ones(8, np.float32)))
                except WorkerClosedError:
                    return

        t = threading.Thread(target=submit, args=(w, futures, stop))
        t.start()
        time.sleep(0.005 * attempt)
        loop.close()
        t.join(5)
        stop.set()
        t.join()
        try:
            assert futures
            for f in futures:
                try:
                    f.result(timeout=5)
                except WorkerClosedError:
                    pass
        finally:
            w.close()


def test_held_wakes_wake_the_loop_once_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = CommLoop(name="held-wakes")
    try:
        woken: list[str] = []
        monkeypatch.setattr(loop, "wake", lambda: woken.append(threading.current_thread().name))
        loop.notify()
        assert len(woken) == 1
        with loop.held_wakes():
            loop.notify()
            with loop.held_wakes():
                loop.notify()
            assert len(woken) == 1  # the inner block's end is not the outermost
            # Another thread's notify is not held by this thread's block.
            other = threading.Thread(target=loop.notify, name="other")
            other.start()
            other.join()
            assert woken[1:] == ["other"]
        assert len(woken) == 3 and woken[2] == threading.current_thread().name
        with loop.held_wakes():
            pass
        assert len(woken) == 3  # nothing queued, no wake-up owed
        with pytest.raises(ValueError), loop.held_wakes():
            loop.notify()
            raise ValueError
        assert len(woken) == 4  # what was queued before the error is still served
        loop.notify()
        assert len(woken) == 5  # the error left no block open on this thread
        # Blocks ended out of order (an ExitStack, coroutines) still end holding.
        outer, inner = loop.held_wakes(), loop.held_wakes()
        outer.__enter__()
        inner.__enter__()
        loop.notify()
        outer.__exit__(None, None, None)
        inner.__exit__(None, None, None)
        assert len(woken) == 6
        loop.notify()
        assert len(woken) == 7
    finally:
        monkeypatch.undo()
        loop.close()


def test_a_sharded_op_wakes_its_loop_once(shards: list[Aggregator], monkeypatch: pytest.MonkeyPatch) -> None:
    w = connect([a.address for a in shards], rank=0, world_size=1, job="one-wake", timeout=10, **SMALL)
    try:
        assert isinstance(w, ShardedWorker) and len(w.shards) > 1
        w.allreduce(np.ones(64, np.float32))
        loop = w._loop
        wakes = 0
        wake = loop.wake

        def counting() -> None:
            nonlocal wakes
            wakes += 1
            wake()

        monkeypatch.setattr(loop, "wake", counting)
        # An op refused inside the held block sends its shards' ABORTs in one wake-up, and
        # leaves nothing held for the next op.
        with pytest.raises(ConfigError):
            w.allreduce_async(np.ones(64, np.float32), weight=-1.0)
        assert wakes == 1
        y = w.allreduce(np.ones(64, np.float32))
        np.testing.assert_array_equal(y, np.ones(64, np.float32))
        assert wakes == 2
    finally:
        monkeypatch.undo()
        w.close()


class _RacedFuture(Future):
    """A future that another thread completes just before this thread's first attempt to:
    the window between a check of ``done()`` and the set that two completing threads race through."""

    def __init__(self, racer: Any) -> None:
        super().__init__()
        self._racer = racer

    def _race(self) -> None:
        racer, self._racer = self._racer, None
        if racer is not None:
            racer(self)

    def set_result(self, result: Any) -> None:
        self._race()
        super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        self._race()
        super().set_exception(exception)


def _racer_result(f: Future) -> None:
    Future.set_result(f, 1)


def _racer_failure(f: Future) -> None:
    Future.set_exception(f, RuntimeError("closed"))


def test_completing_a_future_that_another_thread_completed_is_a_no_op(caplog: pytest.LogCaptureFixture) -> None:
    from worker.loop import fail_future, forward

    raced = _RacedFuture(_racer_result)
    fail_future(raced, RuntimeError("late"))  # must not raise InvalidStateError
    assert raced.result() == 1
    src: Future = Future()
    dst = _RacedFuture(_racer_failure)  # a close gets there first
    forward(src, dst)
    with caplog.at_level("ERROR"):
        src.set_result(5)  # the forward's callback must not raise (concurrent.futures would log it)
    assert isinstance(dst.exception(), RuntimeError) and not caplog.records


def test_a_recv_from_any_source_closed_during_its_pass_posts_nothing() -> None:
    """close() while the any-source thread reads the senders' counters: the receive fails as
    closed, and the pass does not post it (it would take a sender's message nobody receives)."""
    from omnireduce.errors import WorkerClosedError
    from worker.anysource import AnySource

    posted: list[tuple[int, int]] = []
    holder: dict[str, AnySource] = {}

    class Links:
        rank = 0
        job = "fake"

        def __init__(self) -> None:
            self.lock = threading.RLock()

        def sent_counts(self, keys: set[tuple[int, int]]) -> dict[tuple[int, int], int]:
            holder["any"].close()  # the group shuts down while this pass runs
            return {key: 1 for key in keys}

        def posting(self) -> threading.RLock:
            return self.lock

        def posted(self, src: int, tag: int) -> int:
            return 0

        def post(self, x: object, src: int, tag: int) -> Future:
            posted.append((src, tag))
            return Future()

    holder["any"] = any_source = AnySource(Links(), timeout=5)  # type: ignore[arg-type]
    result = any_source.receive(object(), 0, [1, 2])
    assert isinstance(result.exception(5), WorkerClosedError)
    time.sleep(0.2)
    assert posted == []


def test_a_blocking_allreduce_in_an_ops_callback_raises_instead_of_waiting_for_itself() -> None:
    from worker import Worker, connect

    with Aggregator(timeout=10).start() as a, Aggregator(timeout=10).start() as b:
        kinds = {
            "plain": lambda r: Worker(a.address, rank=r, world_size=2, job="cb-plain", timeout=5),
            "sharded": lambda r: connect([a.address, b.address], rank=r, world_size=2, job="cb-sharded", timeout=5),
        }
        for make in kinds.values():
            with make(0) as w, make(1) as peer:
                seen: list[BaseException] = []

                def callback(_f: Future, w: Any = w, seen: list[BaseException] = seen) -> None:
                    try:
                        w.allreduce(np.ones(4, np.float32))
                    except RuntimeError as e:
                        seen.append(e)

                fut = w.allreduce_async(np.ones(4, np.float32))
                fut.add_done_callback(callback)  # before the peer's op: it runs on the communication thread
                peer.allreduce(np.ones(4, np.float32))
                fut.result(5)
                deadline = time.monotonic() + 5
                while not seen and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert seen and "would wait for that thread itself" in str(seen[0])
                both = [w.allreduce_async(np.ones(4, np.float32)), peer.allreduce_async(np.ones(4, np.float32))]
                for f in both:
                    np.testing.assert_array_equal(f.result(5), np.full(4, 2, np.float32))


def test_a_future_its_caller_completed_does_not_stop_the_communication_thread() -> None:
    from worker import Worker

    with Aggregator(timeout=10).start() as a:
        with (Worker(a.address, rank=0, world_size=2, job="caller-completed", timeout=5) as w,
              Worker(a.address, rank=1, world_size=2, job="caller-completed", timeout=5) as peer):
            for delay in (0.0, 0.3):  # before the thread takes the op, and once its START went out
                fut = w.allreduce_async(np.ones(4, np.float32))
                time.sleep(delay)
                fut.set_exception(TimeoutError("the caller's own deadline"))  # as some timeout wrappers do
                peer.allreduce(np.ones(4, np.float32))
                both = [w.allreduce_async(np.ones(4, np.float32)), peer.allreduce_async(np.ones(4, np.float32))]
                for f in both:
                    np.testing.assert_array_equal(f.result(5), np.full(4, 2, np.float32))


def test_workers_closed_in_an_ops_callback_leave_no_context_or_thread_behind() -> None:
    import os

    from worker import ShardedWorker, Worker

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    with Aggregator(timeout=10).start() as a, Aggregator(timeout=10).start() as b:
        before = threads()
        made = [lambda i: Worker(a.address, rank=0, world_size=1, job=f"cb-close-{i}", timeout=5),
                lambda i: ShardedWorker([a.address, b.address], rank=0, world_size=1, job=f"cb-close-s{i}",
                                        timeout=5, shard_bytes=0)]
        for i in range(6):
            w = made[i % 2](i)
            closed = threading.Event()
            fut = w.allreduce_async(np.ones(8, np.float32))
            fut.add_done_callback(lambda _f, w=w, closed=closed: (w.close(), closed.set()))
            assert closed.wait(10)
        deadline = time.monotonic() + 10
        while threads() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threads() <= before


def test_loops_still_running_at_exit_are_stopped() -> None:
    # A script that neither closed its worker nor destroyed its process group: the daemon
    # communication thread ran on into the interpreter's teardown, where freeing a torch
    # tensor aborted the process (SIGABRT) about one exit in five.
    import worker.loop as loop_module
    from aggregator import Aggregator
    from worker import Worker

    with Aggregator(listen="tcp://127.0.0.1:0").start() as agg:
        w = Worker(agg.address, rank=0, world_size=1, job="exit", timeout=10)
        w.allreduce(np.ones(4, np.float32))
        loop = w._connection._loop
        assert loop in loop_module._LOOPS and loop.alive
        loop_module._close_at_exit()  # what atexit runs
        assert not loop.alive
        w.close()


def test_a_second_close_returns_once_the_first_has_closed(aggregator: Aggregator) -> None:
    """It returned at once, while the first was still closing: the ops could still be pending."""
    for _ in range(3):
        w = Worker(aggregator.address, rank=0, world_size=2, job="close-twice", timeout=10, **ONE)
        fut = w.allreduce_async(np.ones(50, np.float32))  # rank 1 never comes: pending until closed
        seen: list[bool] = []
        def close(w: Worker = w, fut: Future = fut, seen: list[bool] = seen) -> None:
            w.close()
            seen.append(fut.done())

        threads = [threading.Thread(target=close) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert seen == [True, True]
        with pytest.raises(WorkerClosedError):
            fut.result(timeout=0)
