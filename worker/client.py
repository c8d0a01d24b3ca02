"""The worker client: sends a tensor's nonzero blocks to the aggregator and gets the sum back.

A :class:`Worker` owns one DEALER socket, used only by its communication thread.
Callers submit ops through a queue and an inproc wake-up socket, so several ops
(DDP buckets) are in flight at once while the caller keeps computing.

The thread watches the socket's connection through its monitor: on every new
connection it first sends HELLO (job, rank, generation, token), and only then the
messages waiting for it; a lost connection fails the ops in flight at once
(their state died with the connection) and ZeroMQ reconnects for the next ones.
The socket queues messages only on a live connection (``zmq.IMMEDIATE``), so
nothing of a dead connection reaches the next one ahead of its HELLO.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from omnireduce import auth, config
from omnireduce.errors import (
    AggregatorError,
    AuthError,
    ConfigError,
    ConnectionLostError,
    LimitError,
    MismatchError,
    OmniReduceError,
    OpError,
    OpTimeoutError,
    PeerLostError,
    ProtocolError,
    StaleGenerationError,
    WorkerClosedError,
)
from omnireduce.layout import Layout
from omnireduce.protocol import (
    MAX_ERROR_HEADER_BYTES,
    MAX_NAME,
    Bye,
    Error,
    ErrorCode,
    Hello,
    Result,
    decode,
    encode,
)
from worker.op import WorkerOp, check_destination
from worker.stats import Stats
from worker.auto import MODES, PathChooser
from worker.cuda import CudaOpData, is_cuda_tensor
from worker.rows import RowsOpData, SparseRows, is_sparse_torch, rows_op_data
from worker.tensors import shares_memory, to_flat

logger = logging.getLogger(__name__)

__all__ = ["Worker"]

_ERRORS: dict[int, type[OpError]] = {
    ErrorCode.MISMATCH: MismatchError,
    ErrorCode.TIMEOUT: OpTimeoutError,
    ErrorCode.AUTH: AuthError,
    ErrorCode.LIMIT: LimitError,
    ErrorCode.PEER_LOST: PeerLostError,
    ErrorCode.STALE: StaleGenerationError,
}
# Errors answering HELLO: this connection may not take part in the job at all.
_REFUSALS = frozenset({ErrorCode.AUTH, ErrorCode.LIMIT, ErrorCode.MISMATCH, ErrorCode.STALE})
_MONITORED = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "it refused this worker's CURVE key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol or security mechanism mismatch: is CURVE on at one end only?",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed: is the aggregator's public key right?",
}
_wake_ids = itertools.count()
# How long closing waits for BYE to leave, so the aggregator does not count the rank as lost.
_BYE_LINGER_MS = 500


@dataclass(slots=True)
class _Submission:
    op: int
    flat: np.ndarray | None
    dtype: Any
    restore: Any
    future: Future
    layout: Layout
    inplace: bool = False
    data: CudaOpData | RowsOpData | None = None
    out: np.ndarray | None = None
    weight: float | None = None
    compute: float | None = None
    dense: bool = False
    auto_key: Any = None


@dataclass(slots=True)
class _Pending:
    state: WorkerOp
    restore: Any
    future: Future
    started: float
    last_heard: float
    # Auto mode: the tensor's key, when this sparse op measures its union density.
    auto_key: Any = None


class Worker:
    """A client of the aggregator for one rank of one job.

    Args:
        address: the aggregator's endpoint; default ``$OMNIREDUCE_ADDRESS``. An
            ``inproc://`` endpoint reaches an aggregator in this process (it must
            share ``context``), without copies through the kernel.
        rank: this worker's rank; default ``$RANK``.
        world_size: the number of workers of the job; default ``$WORLD_SIZE``.
        job: the job id shared by its workers; default ``$OMNIREDUCE_JOB``, else "default".
        block_size: elements per block; default ``$OMNIREDUCE_BLOCK_SIZE``, else 256.
        message_blocks: blocks per message (columns per stream); default
            ``$OMNIREDUCE_MESSAGE_BLOCKS``, else 4096.
        streams: streams in parallel per op; default ``$OMNIREDUCE_STREAMS``, else 8.
        timeout: seconds an op may go without hearing from the aggregator;
            default ``$OMNIREDUCE_TIMEOUT``, else 60.
        context: ZeroMQ context; a private one by default.
        token: the job's shared secret (the job's first worker fixes it); default
            ``$OMNIREDUCE_TOKEN``, else none.
        generation: the job's generation: raise it when the job's workers restart;
            default ``$OMNIREDUCE_GENERATION``, else ``$TORCHELASTIC_RESTART_COUNT``, else 0.
        heartbeat: seconds between heartbeats; default ``$OMNIREDUCE_HEARTBEAT``, else 1; 0: off.
        heartbeat_timeout: seconds of silence after which the connection counts as
            lost; default ``$OMNIREDUCE_HEARTBEAT_TIMEOUT``, else 5.
        curve_server_key: the aggregator's CURVE public key (``.key`` file or Z85
            text); turns CURVE on. Default ``$OMNIREDUCE_CURVE_SERVER_KEY``.
        curve_client_key: this worker's ``.key_secret`` file; default
            ``$OMNIREDUCE_CURVE_CLIENT_KEY``, else a throwaway key pair.
        mode: "sparse" (the block protocol), "dense" (every block sent, no zero-block
            detection), or "auto" (per tensor length, the path :mod:`omnireduce.model`
            predicts faster from the union density the last sparse op of that length
            measured; see :mod:`worker.auto`). Default ``$OMNIREDUCE_MODE``, else sparse.

    Example::

        with Worker("tcp://127.0.0.1:5555", rank=0, world_size=2, job="demo") as w:
            y = w.allreduce(x)
    """

    def __new__(cls, address: str | list[str] | tuple[str, ...] | None = None, *args: Any, **kwargs: Any) -> Worker:
        """Makes a :class:`worker.sharded.ShardedWorker` when ``address`` (or, when it is None,
        ``$OMNIREDUCE_ADDRESS``) names several aggregator shards: a list or tuple, or a
        comma-separated string. One address makes a plain Worker; Python then calls the
        ``__init__`` of whichever class this returns.
        """
        if cls is Worker:
            value = address if address is not None else os.environ.get(config.OMNIREDUCE_ADDRESS)
            if isinstance(value, (list, tuple)) or (isinstance(value, str) and "," in value):
                from worker.sharded import ShardedWorker  # imports this module: not at the top

                return super().__new__(ShardedWorker)
        return super().__new__(cls)

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
        *,
        token: str | None = None,
        generation: int | None = None,
        heartbeat: float | None = None,
        heartbeat_timeout: float | None = None,
        curve_server_key: str | os.PathLike[str] | None = None,
        curve_client_key: str | os.PathLike[str] | None = None,
        mode: str | None = None,
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
        token = config.resolve(token, config.OMNIREDUCE_TOKEN, "", str)
        self.generation = config.resolve_generation(generation)
        heartbeat, heartbeat_timeout = config.resolve_heartbeat(heartbeat, heartbeat_timeout)
        server_key = config.resolve_optional(curve_server_key, config.OMNIREDUCE_CURVE_SERVER_KEY, str)
        client_key = config.resolve_optional(curve_client_key, config.OMNIREDUCE_CURVE_CLIENT_KEY, str)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not in a world of size {self.world_size}")
        if not self.job or len(self.job) > 200:
            raise ConfigError(f"job id must be 1 to 200 characters, got {self.job!r}")
        if len(token) > MAX_NAME:
            raise ConfigError(f"token must be at most {MAX_NAME} characters")
        if self.timeout <= 0:
            raise ConfigError(f"timeout must be positive, got {self.timeout}")
        if client_key is not None and server_key is None:
            raise ConfigError("curve_client_key needs curve_server_key (the aggregator's public key)")
        Layout(0, self.block_size, self.message_blocks, self.streams)  # validates the three
        self.curve = server_key is not None
        self.mode = config.resolve(mode, config.OMNIREDUCE_MODE, config.DEFAULT_MODE, str)
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        self._chooser = (
            PathChooser(self.world_size, ring_available=False, block_size=self.block_size,
                        message_blocks=self.message_blocks, streams=self.streams)
            if self.mode == "auto" else None
        )
        self._hello = encode(Hello(self.job, self.rank, self.world_size, self.generation, token))

        self.stats = Stats()
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Queue only on a live connection: a dead one's messages must not reach the next.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        if heartbeat:
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(heartbeat * 1000)))
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(heartbeat_timeout * 1000)))
        self._mon = self._sock.get_monitor_socket(_MONITORED)
        try:
            if server_key is not None:
                auth.configure_client(self._sock, server_key, client_key)
            self._sock.connect(self.address)
        except (zmq.ZMQError, ConfigError) as e:
            self._sock.disable_monitor()
            self._mon.close()
            self._sock.close()
            if self._own_context:
                self._ctx.term()
            if isinstance(e, ConfigError):
                raise
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
        # Ops submitted and not finished, and since when none has been: the compute time.
        self._outstanding = 0
        self._idle_since: float | None = None
        self._batches: list[float] | None = None
        self._thread = threading.Thread(target=self._run, name=f"omnireduce-worker-r{self.rank}", daemon=True)
        self._thread.start()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def allreduce_async(
        self,
        x: Any,
        inplace: bool = False,
        out: np.ndarray | None = None,
        weight: float | None = None,
        compute_time: float | None = None,
        key: Any = None,
    ) -> Future:
        """Starts a sum over all workers of the job; returns a future of the result.

        Ops are numbered in call order, so every worker must call in the same order.
        ``x`` is read until the future completes: do not modify it before then.

        Args:
            x: a NumPy array, a torch tensor (CPU or CUDA; a sparse COO tensor sums
                its rows: see :mod:`worker.rows`), :class:`worker.rows.SparseRows`, or a CUDA array (numba,
                ``__cuda_array_interface__``), any shape, float32/64, float16 or bfloat16.
                Of a CUDA tensor only the nonzero blocks are copied to the host.
            inplace: write the sum into ``x`` itself and return ``x`` (CPU tensors only);
                saves allocating and zeroing the result.
            out: a zero-filled, writeable, flat NumPy array of ``x``'s length and
                storage type (uint16 for bfloat16) to write the sum into, instead of
                a new array; the result is then a view of it (CPU tensors only).
            weight: this worker's sample count: the result is then the weighted mean
                ``sum(weight_i * x_i) / sum(weight_i)`` (summed in the aggregator's
                accumulator type). Every worker of the op must give one, or none.
            compute_time: seconds this worker computed for those samples, reported
                for batch balancing (:attr:`recommended_batches`). By default, for a
                weighted op submitted while no other op is in flight, the time since
                this worker's last op finished.
            key: in auto mode, what identifies this tensor from op to op (its
                density history); default its length and dtype.

        Returns:
            A future of an array or tensor of ``x``'s type, shape and dtype.

        Raises:
            ConfigError: ``x`` is not supported, or ``inplace`` is asked of a tensor
                that is not contiguous, writeable host memory.
        """
        for name, v, positive in (("weight", weight, True), ("compute_time", compute_time, False)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float, np.number))
                                  or not math.isfinite(v) or v < 0 or (positive and v == 0)):
                raise ConfigError(f"{name} must be a finite {'positive' if positive else 'non-negative'} number, "
                                  f"got {v!r}")
        data: CudaOpData | RowsOpData | None = None
        block_size = self.block_size
        if isinstance(x, SparseRows) or is_sparse_torch(x):
            if inplace or out is not None:
                raise ConfigError("an allreduce of sparse rows returns new rows: inplace and out are not supported")
            data = rows_op_data(x)
            flat, dtype, length, block_size = None, data.dtype, data.length, data.block_size
            restore = data.restore
        elif is_cuda_tensor(x):
            if inplace or out is not None:
                raise ConfigError("an in-place allreduce or out= of a CUDA tensor is not supported")
            data = CudaOpData(x, self.block_size)
            flat, dtype, length = None, data.dtype, data.length
            restore: Any = lambda _out: data.finish()  # noqa: E731
        else:
            flat, dtype, restore = to_flat(x)
            length = len(flat)
            check_destination(flat, dtype, inplace, out)
            if inplace and not shares_memory(x, flat):
                raise ConfigError("an in-place allreduce needs a contiguous tensor (this one would be copied)")
            if inplace:
                restore = lambda _out: x  # noqa: E731
        if weight is not None and dtype.is_integer:
            raise ConfigError(f"weight is not supported for {dtype.name.lower()} tensors: an integer allreduce is an "
                              "exact sum, and a weighted mean has no integer result")
        # Everything that can fail happens before the op takes its number: a number
        # taken by an op that is never sent would pair this rank's later ops with
        # the other ranks' earlier ones.
        layout = Layout(length, block_size, self.message_blocks, self.streams)
        dense, auto_key = False, None
        if data is None and self.mode == "dense":
            dense = True
        elif data is None and self._chooser is not None:
            auto_key = (length, int(dtype)) if key is None else key
            try:
                hash(auto_key)
            except TypeError:
                raise ConfigError(f"key must be hashable, got {type(auto_key).__name__}") from None
            dense = self._chooser.choose(auto_key, length, dtype.itemsize) == "dense"
        fut: Future = Future()
        with self._submit_lock:
            if self._closed or self._dead is not None:
                raise WorkerClosedError(f"worker rank {self.rank} of job {self.job!r} is closed") from self._dead
            op = next(self._op_counter)
            if weight is not None and compute_time is None and self._outstanding == 0 and self._idle_since is not None:
                compute_time = time.monotonic() - self._idle_since
            self._outstanding += 1
            fut.add_done_callback(self._op_finished)
            self._submissions.put(_Submission(
                op, flat, dtype, restore, fut, layout, inplace, data, out,
                None if weight is None else float(weight), None if compute_time is None else float(compute_time),
                dense, None if dense else auto_key,
            ))
        self._wake()
        return fut

    def allreduce(self, x: Any, **options: Any) -> Any:
        """Sums ``x`` over all workers of the job and returns the result.

        Args:
            x: the tensor (see :meth:`allreduce_async`).
            **options: :meth:`allreduce_async`'s options (``inplace``, ``out``,
                ``weight``, ``compute_time``, ``key``).

        Raises:
            OmniReduceError: the op failed (mismatch, timeout, aggregator error, closed worker).
        """
        return self.allreduce_async(x, **options).result()

    @property
    def recommended_batches(self) -> list[float] | None:
        """The aggregator's latest recommended batch size per rank, or None.

        Sent with every weighted op for which every rank reported a compute time:
        the op's total weight (the global batch) split in proportion to the ranks'
        smoothed speeds (samples per compute second). :mod:`worker.balance` turns
        it into integer batch sizes.
        """
        return self._batches

    def _op_finished(self, _fut: Future) -> None:
        with self._submit_lock:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle_since = time.monotonic()

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
        # Messages waiting for a live connection, oldest first: (op or None for HELLO, frames).
        self._outbox: collections.deque[tuple[int | None, list[Any]]] = collections.deque()
        self._connected = False
        # Set when the aggregator refused this connection's HELLO: new ops fail with it.
        self._refused: OpError | None = None
        self._handshake_failures = 0
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        poller.register(self._mon, zmq.POLLIN)
        stopping = False
        if self.address.startswith("inproc://"):
            # An inproc peer has no handshake (so no monitor event) to wait for: it is
            # there from connect on, and gone only with the process.
            self._connected = True
            self._outbox.appendleft((None, self._hello))
        try:
            while not stopping:
                writable = self._connected and bool(self._outbox)
                poller.modify(self._sock, zmq.POLLIN | (zmq.POLLOUT if writable else 0))
                events = dict(poller.poll(self._wait_ms(pending)))
                if self._mon in events:
                    self._on_monitor(pending)
                if self._wake_recv in events:
                    while self._wake_recv.poll(0):
                        self._wake_recv.recv()
                    stopping = self._take_submissions(pending)
                if self._sock in events:
                    self._receive(pending)
                self._flush()
                self._expire(pending)
        except Exception as e:
            logger.exception("worker rank %d of job %r: communication thread died", self.rank, self.job)
            with self._submit_lock:
                # Under the lock: no submission can be queued after the drains below.
                self._dead = e
            for p in pending.values():
                _fail(p.future, WorkerClosedError(f"communication thread died: {e!r}"))
            self._drain_submissions(WorkerClosedError(f"communication thread died: {e!r}"))
        finally:
            for p in pending.values():
                _fail(p.future, WorkerClosedError(
                    f"worker rank {self.rank} of job {self.job!r} closed with op {p.state.op} pending"
                ))
            self._drain_submissions(WorkerClosedError(f"worker rank {self.rank} of job {self.job!r} is closed"))
            if stopping and self._connected:
                self._say_bye()
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._mon.close()
            self._sock.close()
            self._wake_recv.close()

    def _say_bye(self) -> None:
        try:
            self._sock.send_multipart(encode(Bye(self.job, self.rank)), flags=zmq.NOBLOCK)
            self._sock.setsockopt(zmq.LINGER, _BYE_LINGER_MS)
        except zmq.ZMQError as e:
            logger.debug("worker rank %d of job %r: no BYE sent: %s", self.rank, self.job, e)

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

    def _post(self, op: int | None, frames: list[Any]) -> None:
        """Sends now if the connection is up and has room, else queues in order."""
        if self._connected and not self._outbox:
            try:
                self._sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
        self._outbox.append((op, frames))

    def _flush(self) -> None:
        while self._connected and self._outbox:
            try:
                self._sock.send_multipart(self._outbox[0][1], copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._outbox.popleft()

    def _drop(self, pending: dict[int, _Pending], op: int, error: BaseException) -> None:
        """Fails a pending op and forgets its queued messages."""
        p = pending.pop(op, None)
        if p is not None:
            _fail(p.future, error)
        if any(o == op for o, _ in self._outbox):
            self._outbox = collections.deque(item for item in self._outbox if item[0] != op)

    def _on_monitor(self, pending: dict[int, _Pending]) -> None:
        while True:
            try:
                event = parse_monitor_message(self._mon.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                logger.info("worker rank %d of job %r: connected to %s", self.rank, self.job, self.address)
                self._connected = True
                self._refused = None
                self._handshake_failures = 0
                # Every connection starts with HELLO, ahead of anything queued.
                self._outbox.appendleft((None, self._hello))
            elif kind == zmq.EVENT_DISCONNECTED:
                was, self._connected = self._connected, False
                # HELLO and messages of the lost ops must not go out on the next connection.
                self._outbox = collections.deque(item for item in self._outbox if item[0] is not None)
                if was:
                    logger.warning(
                        "worker rank %d of job %r: lost the connection to %s; failing ops %s",
                        self.rank, self.job, self.address, sorted(pending),
                    )
                    for op in list(pending):
                        self._drop(pending, op, ConnectionLostError(
                            f"lost the connection to the aggregator at {self.address}; the op's state is gone "
                            "(ZeroMQ reconnects for new ops)", job=self.job, op=op,
                        ))
            elif kind in _HANDSHAKE_FAILED:
                self._connected = False
                self._handshake_failures += 1
                why = f"the aggregator at {self.address} refused the connection: {_HANDSHAKE_FAILED[kind]}"
                if self._handshake_failures == 1:
                    logger.error("worker rank %d of job %r: %s", self.rank, self.job, why)
                # New ops fail at once too, until a handshake succeeds (ZeroMQ may not retry).
                self._refused = AuthError(why, job=self.job)
                for op in list(pending):
                    self._drop(pending, op, AuthError(why, job=self.job, op=op))

    def _take_submissions(self, pending: dict[int, _Pending]) -> bool:
        while True:
            try:
                sub = self._submissions.get_nowait()
            except queue.Empty:
                return False
            if sub is None:
                return True
            if not sub.future.set_running_or_notify_cancel():
                # Cancelled while queued: the op still runs (the other ranks wait for
                # its number), its result goes nowhere.
                sub.future = Future()
                sub.future.set_running_or_notify_cancel()
            if self._refused is not None:
                r = self._refused
                sub.future.set_exception(type(r)(r.reason, job=self.job, op=sub.op, ranks=r.ranks))
                continue
            now = time.monotonic()
            try:
                state = WorkerOp(
                    self.job, self.rank, self.world_size, sub.op, sub.flat, sub.dtype, sub.layout,
                    inplace=sub.inplace, data=sub.data, out=sub.out, weight=sub.weight, compute=sub.compute,
                    dense=sub.dense,
                )
                frames = state.start()
            except OmniReduceError as e:
                sub.future.set_exception(e)
                continue
            except Exception as e:  # e.g. MemoryError: fail this op, not the thread
                logger.exception("worker rank %d of job %r op %d: setting up the op failed", self.rank, self.job,
                                 sub.op)
                sub.future.set_exception(OpError(f"op {sub.op}: setting up the op failed: {e!r}",
                                                 job=self.job, op=sub.op))
                continue
            pending[sub.op] = _Pending(state, sub.restore, sub.future, now, now, sub.auto_key)
            self._post(sub.op, frames)

    def _receive(self, pending: dict[int, _Pending]) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg, data = decode(frames, max_header_bytes=MAX_ERROR_HEADER_BYTES)
            except ProtocolError as e:
                logger.error(
                    "worker rank %d of job %r: undecodable message from the aggregator: %s", self.rank, self.job, e
                )
                continue
            if msg.job != self.job and not (isinstance(msg, Error) and msg.job == "?"):
                logger.warning("worker rank %d of job %r: message for job %r ignored", self.rank, self.job, msg.job)
                continue
            if isinstance(msg, Error):
                self._on_error(msg, pending)
                continue
            if not isinstance(msg, Result):
                logger.warning(
                    "worker rank %d of job %r: unexpected %s from the aggregator", self.rank, self.job, msg.TYPE.name
                )
                continue
            p = pending.get(msg.op)
            if p is None:
                logger.debug(
                    "worker rank %d of job %r: result for op %d that is not pending", self.rank, self.job, msg.op
                )
                continue
            p.last_heard = time.monotonic()
            try:
                reply = p.state.on_result(msg, data)
            except OmniReduceError as e:
                self._drop(pending, msg.op, e)
                continue
            except Exception as e:  # a malformed result must fail its op, not the thread
                logger.exception("worker rank %d of job %r op %d: bad result from the aggregator", self.rank, self.job,
                                 msg.op)
                self._drop(pending, msg.op, ProtocolError(f"bad result from the aggregator for op {msg.op}: {e!r}"))
                continue
            if msg.batches is not None:  # checked by on_result
                self._batches = msg.batches
            if reply is not None:
                self._post(msg.op, reply)
            if p.state.done:
                del pending[msg.op]
                p.state.stats.seconds = time.monotonic() - p.started
                self.stats.add(p.state.stats)
                if p.auto_key is not None and self._chooser is not None:
                    self._chooser.record(p.auto_key, p.state.stats.union_density)
                # Who waits on the future can see what its op moved (e.g. the DDP hook's auto mode).
                p.future.op_stats = p.state.stats  # type: ignore[attr-defined]
                try:
                    result = p.restore(p.state.out)
                except Exception as e:  # e.g. a failed device copy: fail this op, not the thread
                    logger.exception("worker rank %d of job %r op %d: result conversion failed", self.rank, self.job,
                                     msg.op)
                    p.future.set_exception(e if isinstance(e, OmniReduceError) else OpError(f"op {msg.op}: {e!r}"))
                    continue
                p.future.set_result(result)

    def _on_error(self, msg: Error, pending: dict[int, _Pending]) -> None:
        cls = _ERRORS.get(msg.code, AggregatorError)
        if msg.op is None:
            logger.error("worker rank %d of job %r: the aggregator refused: %s", self.rank, self.job, msg.message)
            if msg.code in _REFUSALS:
                self._refused = cls(f"aggregator: {msg.message}", job=self.job, ranks=msg.ranks)
            for op in list(pending):
                self._drop(pending, op, cls(f"aggregator: {msg.message}", job=self.job, op=op, ranks=msg.ranks))
            return
        if msg.op in pending:
            logger.warning(
                "worker rank %d of job %r op %d: aggregator error: %s", self.rank, self.job, msg.op, msg.message
            )
            self._drop(pending, msg.op, cls(f"aggregator: {msg.message}", job=self.job, op=msg.op, ranks=msg.ranks))
        else:
            logger.debug("worker rank %d of job %r op %d (not pending): aggregator error: %s",
                         self.rank, self.job, msg.op, msg.message)

    def _expire(self, pending: dict[int, _Pending]) -> None:
        now = time.monotonic()
        for op, p in list(pending.items()):
            if now - p.last_heard > self.timeout:
                how = "" if self._connected else " (no connection to it)"
                self._drop(pending, op, OpTimeoutError(
                    f"no answer from the aggregator at {self.address} for {self.timeout:g} s{how}", job=self.job, op=op,
                ))


def _fail(fut: Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
