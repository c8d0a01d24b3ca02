"""The worker client: sends a tensor's nonzero blocks to the aggregator and gets the sum back.

A :class:`Worker` owns one DEALER socket, used only by its communication thread.
Callers submit ops through a queue and an inproc wake-up socket, so several ops
(DDP buckets) are in flight at once while the caller keeps computing.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from omnireduce import config
from omnireduce.errors import (
    AggregatorError,
    ConfigError,
    MismatchError,
    OmniReduceError,
    OpError,
    OpTimeoutError,
    ProtocolError,
    WorkerClosedError,
)
from omnireduce.layout import Layout
from omnireduce.protocol import Error, ErrorCode, Result, decode
from worker.op import WorkerOp
from worker.stats import Stats
from worker.tensors import to_flat

logger = logging.getLogger(__name__)

__all__ = ["Worker"]

_ERRORS: dict[int, type[OpError]] = {
    ErrorCode.MISMATCH: MismatchError,
    ErrorCode.TIMEOUT: OpTimeoutError,
}
_wake_ids = itertools.count()


@dataclass(slots=True)
class _Submission:
    op: int
    flat: np.ndarray
    dtype: Any
    restore: Any
    future: Future


@dataclass(slots=True)
class _Pending:
    state: WorkerOp
    restore: Any
    future: Future
    started: float
    last_heard: float


class Worker:
    """A client of the aggregator for one rank of one job.

    Args:
        address: the aggregator's endpoint; default ``$OMNIREDUCE_ADDRESS``.
        rank: this worker's rank; default ``$RANK``.
        world_size: the number of workers of the job; default ``$WORLD_SIZE``.
        job: the job id shared by its workers; default ``$OMNIREDUCE_JOB``, else "default".
        block_size: elements per block; default ``$OMNIREDUCE_BLOCK_SIZE``, else 256.
        message_blocks: blocks per message (columns per stream); default
            ``$OMNIREDUCE_MESSAGE_BLOCKS``, else 256.
        streams: streams in parallel per op; default ``$OMNIREDUCE_STREAMS``, else 4.
        timeout: seconds an op may go without hearing from the aggregator;
            default ``$OMNIREDUCE_TIMEOUT``, else 60.
        context: ZeroMQ context; a private one by default.

    Example::

        with Worker("tcp://127.0.0.1:5555", rank=0, world_size=2, job="demo") as w:
            y = w.allreduce(x)
    """

    def __init__(
        self,
        address: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        job: str | None = None,
        block_size: int | None = None,
        message_blocks: int | None = None,
        streams: int | None = None,
        timeout: float | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.address = config.resolve(address, config.OMNIREDUCE_ADDRESS, None, str)
        self.rank = config.resolve(rank, config.RANK, None, int)
        self.world_size = config.resolve(world_size, config.WORLD_SIZE, None, int)
        self.job = config.resolve(job, config.OMNIREDUCE_JOB, config.DEFAULT_JOB, str)
        self.block_size = config.resolve(block_size, config.OMNIREDUCE_BLOCK_SIZE, config.DEFAULT_BLOCK_SIZE, int)
        self.message_blocks = config.resolve(
            message_blocks, config.OMNIREDUCE_MESSAGE_BLOCKS, config.DEFAULT_MESSAGE_BLOCKS, int
        )
        self.streams = config.resolve(streams, config.OMNIREDUCE_STREAMS, config.DEFAULT_STREAMS, int)
        self.timeout = config.resolve(timeout, config.OMNIREDUCE_TIMEOUT, config.DEFAULT_TIMEOUT, float)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not in a world of size {self.world_size}")
        if not self.job or len(self.job) > 200:
            raise ConfigError(f"job id must be 1 to 200 characters, got {self.job!r}")
        if self.timeout <= 0:
            raise ConfigError(f"timeout must be positive, got {self.timeout}")
        Layout(0, self.block_size, self.message_blocks, self.streams)  # validates the three

        self.stats = Stats()
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.connect(self.address)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ConfigError(f"cannot connect to aggregator address {self.address!r}: {e}") from None
        wake = f"inproc://omnireduce-worker-wake-{id(self)}-{next(_wake_ids)}"
        self._wake_recv = self._ctx.socket(zmq.PAIR)
        self._wake_recv.bind(wake)
        self._wake_send = self._ctx.socket(zmq.PAIR)
        self._wake_send.connect(wake)
        self._wake_lock = threading.Lock()
        self._submissions: queue.SimpleQueue[_Submission | None] = queue.SimpleQueue()
        self._op_counter = itertools.count()
        self._submit_lock = threading.Lock()
        self._closed = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"omnireduce-worker-r{self.rank}", daemon=True)
        self._thread.start()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def allreduce_async(self, x: Any) -> Future:
        """Starts a sum over all workers of the job; returns a future of the result.

        Ops are numbered in call order, so every worker must call in the same order.
        ``x`` is read until the future completes: do not modify it before then.

        Args:
            x: a NumPy array or CPU torch tensor, any shape, float32/64, float16 or bfloat16.

        Returns:
            A future of an array or tensor of ``x``'s type, shape and dtype.
        """
        flat, dtype, restore = to_flat(x)
        fut: Future = Future()
        with self._submit_lock:
            if self._closed or self._dead is not None:
                raise WorkerClosedError(f"worker rank {self.rank} of job {self.job!r} is closed") from self._dead
            op = next(self._op_counter)
            self._submissions.put(_Submission(op, flat, dtype, restore, fut))
        self._wake()
        return fut

    def allreduce(self, x: Any) -> Any:
        """Sums ``x`` over all workers of the job and returns the result (see :meth:`allreduce_async`).

        Raises:
            OmniReduceError: the op failed (mismatch, timeout, aggregator error, closed worker).
        """
        return self.allreduce_async(x).result()

    def close(self) -> None:
        """Stops the communication thread; pending ops fail with WorkerClosedError."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._submissions.put(None)
        self._wake()
        self._thread.join()
        self._wake_send.close()
        if self._own_context:
            self._ctx.term()

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_send.send(b"", flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already queued, or the thread is gone

    # Everything below runs on the communication thread only.

    def _run(self) -> None:
        pending: dict[int, _Pending] = {}
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        stopping = False
        try:
            while not stopping:
                wait_ms = self._wait_ms(pending)
                events = dict(poller.poll(wait_ms))
                if self._wake_recv in events:
                    while self._wake_recv.poll(0):
                        self._wake_recv.recv()
                    stopping = self._take_submissions(pending)
                if self._sock in events:
                    self._receive(pending)
                self._expire(pending)
        except Exception as e:
            logger.exception("worker rank %d of job %r: communication thread died", self.rank, self.job)
            self._dead = e
            for p in pending.values():
                _fail(p.future, WorkerClosedError(f"communication thread died: {e!r}"))
            self._drain_submissions(WorkerClosedError(f"communication thread died: {e!r}"))
        finally:
            for p in pending.values():
                _fail(p.future, WorkerClosedError(f"worker rank {self.rank} of job {self.job!r} closed with op {p.state.op} pending"))
            self._drain_submissions(WorkerClosedError(f"worker rank {self.rank} of job {self.job!r} is closed"))
            self._sock.close()
            self._wake_recv.close()

    def _drain_submissions(self, error: BaseException) -> None:
        while True:
            try:
                sub = self._submissions.get_nowait()
            except queue.Empty:
                return
            if sub is not None:
                _fail(sub.future, error)

    def _wait_ms(self, pending: dict[int, _Pending]) -> int | None:
        if not pending:
            return None
        deadline = min(p.last_heard for p in pending.values()) + self.timeout
        return max(0, int((deadline - time.monotonic()) * 1000) + 1)

    def _take_submissions(self, pending: dict[int, _Pending]) -> bool:
        while True:
            try:
                sub = self._submissions.get_nowait()
            except queue.Empty:
                return False
            if sub is None:
                return True
            if not sub.future.set_running_or_notify_cancel():
                continue
            now = time.monotonic()
            try:
                layout = Layout(len(sub.flat), self.block_size, self.message_blocks, self.streams)
                state = WorkerOp(self.job, self.rank, self.world_size, sub.op, sub.flat, sub.dtype, layout)
                frames = state.start()
            except OmniReduceError as e:
                sub.future.set_exception(e)
                continue
            pending[sub.op] = _Pending(state, sub.restore, sub.future, now, now)
            self._sock.send_multipart(frames, copy=False)

    def _receive(self, pending: dict[int, _Pending]) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg, data = decode(frames)
            except ProtocolError as e:
                logger.error("worker rank %d: undecodable message from the aggregator: %s", self.rank, e)
                continue
            if msg.job != self.job and not (isinstance(msg, Error) and msg.job == "?"):
                logger.warning("worker rank %d: message for job %r ignored", self.rank, msg.job)
                continue
            if isinstance(msg, Error):
                self._on_error(msg, pending)
                continue
            if not isinstance(msg, Result):
                logger.warning("worker rank %d: unexpected %s from the aggregator", self.rank, msg.TYPE.name)
                continue
            p = pending.get(msg.op)
            if p is None:
                logger.debug("worker rank %d: result for op %d that is not pending", self.rank, msg.op)
                continue
            p.last_heard = time.monotonic()
            try:
                reply = p.state.on_result(msg, data)
            except OmniReduceError as e:
                del pending[msg.op]
                _fail(p.future, e)
                continue
            if reply is not None:
                self._sock.send_multipart(reply, copy=False)
            if p.state.done:
                del pending[msg.op]
                p.state.stats.seconds = time.monotonic() - p.started
                self.stats.add(p.state.stats)
                p.future.set_result(p.restore(p.state.out))

    def _on_error(self, msg: Error, pending: dict[int, _Pending]) -> None:
        cls = _ERRORS.get(msg.code, AggregatorError)
        targets = list(pending) if msg.op is None else [msg.op]
        for op in targets:
            p = pending.pop(op, None)
            if p is not None:
                _fail(p.future, cls(f"aggregator: {msg.message}", job=self.job, op=op, ranks=msg.ranks))
        if msg.op is None or msg.op not in targets:
            logger.error("worker rank %d: aggregator error: %s", self.rank, msg.message)

    def _expire(self, pending: dict[int, _Pending]) -> None:
        now = time.monotonic()
        for op, p in list(pending.items()):
            if now - p.last_heard > self.timeout:
                del pending[op]
                _fail(
                    p.future,
                    OpTimeoutError(
                        f"no answer from the aggregator at {self.address} for {self.timeout:g} s",
                        job=self.job, op=op,
                    ),
                )


def _fail(fut: Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
