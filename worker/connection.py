"""One connection to one aggregator, served by a communication thread.

A :class:`Connection` owns one DEALER socket, used only by the thread of its
:class:`worker.loop.CommLoop` (its own, or one shared with the other shards of a
sharded worker). Callers submit op requests (:class:`worker.op.OpRequest`)
through the loop's queue and wake-up socket, so several ops (DDP buckets) are in
flight at once while the caller keeps computing; the connection numbers them in
submission order.

The thread watches the socket's connection through its monitor: on every new
connection it first sends HELLO (job, rank, generation, token), and only then the
messages waiting for it; a lost connection fails the ops in flight at once
(their state died with the connection) and ZeroMQ reconnects for the next ones.
The socket queues messages only on a live connection (``zmq.IMMEDIATE``), so
nothing of a dead connection reaches the next one ahead of its HELLO.

Heartbeats (:class:`omnireduce.protocol.Heartbeat`; ZeroMQ's own are off) find an
aggregator that is paused or unreachable: the thread sends one after ``heartbeat``
seconds without hearing anything (at most one per interval; the aggregator answers
it), and counts the connection as lost after ``heartbeat_timeout`` seconds without
hearing anything, or when the aggregator says
it dropped the connection (an ERROR of code DROPPED, after this worker was silent,
e.g. paused); the socket is then replaced by a new one, which connects anew.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import zmq

from omnireduce import config, memory, transport
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
    PeerRefusedError,
    ProtocolError,
    StaleGenerationError,
    WorkerClosedError,
)
from omnireduce.protocol import (
    MAX_ERROR_HEADER_BYTES,
    MAX_REASON,
    Abort,
    Bye,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Result,
    decode,
    encode,
)
from worker.loop import CommLoop, fail_future
from worker.op import OpRequest, WorkerOp
from worker.settings import WorkerSettings
from worker.stats import Stats

logger = logging.getLogger(__name__)

__all__ = ["Connection"]

_ERRORS: dict[int, type[OpError]] = {
    ErrorCode.MISMATCH: MismatchError,
    ErrorCode.TIMEOUT: OpTimeoutError,
    ErrorCode.AUTH: AuthError,
    ErrorCode.LIMIT: LimitError,
    ErrorCode.PEER_LOST: PeerLostError,
    ErrorCode.STALE: StaleGenerationError,
    ErrorCode.REFUSED: PeerRefusedError,
}
# Errors answering HELLO: this connection may not take part in the job at all.
_REFUSALS = frozenset({ErrorCode.AUTH, ErrorCode.LIMIT, ErrorCode.MISMATCH, ErrorCode.STALE})
# How long closing waits for BYE to leave, so the aggregator does not count the rank as lost.
_BYE_LINGER_MS = 500
# How long closing waits for a connection to come up to deliver the ABORTs still queued (a
# refusal made before the first handshake): without them the other ranks wait for their timeout.
_ABORT_FLUSH_S = 2.0
# Seconds between tries to open a new socket when opening one failed.
_RENEW_RETRY_S = 1.0


@dataclass(slots=True)
class AbortRequest:
    """An op this rank numbers but will not send: its arguments failed a check here.

    Attributes:
        reason: why, for the other ranks' errors (see :class:`omnireduce.protocol.Abort`).
        future: done once the ABORT is handed to the socket or queued for it.
        op: the op number, given by the connection when it queues the request.
    """

    reason: str
    future: Future = field(default_factory=Future)
    op: int = -1


def refusal_text(error: BaseException) -> str:
    """What an ABORT tells the other ranks of ``error``: its type and message, cut to fit."""
    # A message may hold what UTF-8 cannot encode (a surrogate-escaped file name): escaped here.
    text = f"{type(error).__name__}: {error}".encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


@dataclass(slots=True)
class _Pending:
    state: WorkerOp
    request: OpRequest
    started: float
    last_heard: float


class Connection:
    """A connection to one aggregator for one rank of one job, served by a communication thread.

    Args:
        address: the aggregator's endpoint; ``inproc://`` reaches an aggregator in
            this process (it must share ``context``).
        settings: the worker's settings (rank, job, timeouts, CURVE keys, ...).
        context: ZeroMQ context; a private one by default.
        loop: the communication thread to serve this connection, shared with other
            connections of this process (a sharded worker's shards share one); a
            private one by default.

    Attributes:
        stats: what this connection's ops moved.
        batches: the aggregator's latest recommended batch size per rank, or None.

    Raises:
        ConfigError: the address or the CURVE keys are unusable.
        WorkerClosedError: ``loop`` is closed.
    """

    def __init__(self, address: str, settings: WorkerSettings, context: zmq.Context | None = None,
                 loop: CommLoop | None = None) -> None:
        self.address = address
        self.settings = settings
        # Read by every log line of the thread.
        self.rank = settings.rank
        self.job = settings.job
        self.timeout = settings.timeout
        self.stats = Stats()
        self.batches: list[float] | None = None
        memory.tune_malloc()
        self._hello = encode(Hello(settings.job, settings.rank, settings.world_size, settings.generation,
                                   settings.token))
        self._heartbeat = encode(Heartbeat(settings.job))
        self._heartbeat_reply = encode(Heartbeat(settings.job, reply=True))
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        try:
            self._sock, self._mon = self._open_socket()
        except ConfigError:
            if self._own_context:
                self._ctx.term()
            raise
        self._op_counter = itertools.count()
        # Guards the op numbers, the queue's order and the closed/dead state together.
        self._lock = threading.Lock()
        self._closed = False
        self._dead: BaseException | None = None
        self._finished = threading.Event()
        # The thread's own state; every field is set here, before the thread sees the connection.
        self._pending: dict[int, _Pending] = {}
        # Messages waiting for a live connection, oldest first: (op or None for HELLO, frames).
        self._outbox: collections.deque[tuple[int | None, list[Any]]] = collections.deque()
        self._connected = False
        self._polling_out = False
        # Set when the aggregator refused this connection's HELLO: new ops fail with it.
        self._refused: OpError | None = None
        self._handshake_failures = 0
        # Heartbeats: when the thread last heard from the aggregator, sent it a heartbeat, and
        # looked; and whether the socket is to be replaced (the connection counted as lost).
        self._hb = settings.heartbeat
        self._hb_timeout = settings.heartbeat_timeout
        self._stall = config.heartbeat_stall(self._hb)
        now = time.monotonic()
        self._heard = self._pinged = self._looked = now
        self._renew = False
        self._renew_at = 0.0
        self._renew_failures = 0
        self._own_loop = loop is None
        self._loop = loop if loop is not None else CommLoop(self._ctx, name=f"omnireduce-worker-r{self.rank}")
        try:
            self._loop.attach(self)
        except BaseException:
            if self._own_loop:
                self._loop.close()
            self._close_sockets()
            raise

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, request: OpRequest | AbortRequest) -> int:
        """Numbers ``request`` (its ``op``) and queues it for the thread; returns the number.

        Raises:
            WorkerClosedError: the connection is closed or its thread died.
        """
        with self._lock:
            if self._closed or self._dead is not None or self._finished.is_set():
                if self._dead is not None:
                    why = f" (its communication thread died: {self._dead!r})"
                elif not self._closed:
                    why = " (the communication thread it shared was closed)"
                else:
                    why = ""
                raise WorkerClosedError(f"worker rank {self.rank} of job {self.job!r} is closed{why}") from self._dead
            if request.op < 0:  # else numbered by its caller: a sharded op's part (see worker.op.PartOf)
                request.op = next(self._op_counter)
            self._loop.put(self, request)
        self._loop.notify()
        return request.op

    def set_timeout(self, seconds: float) -> None:
        """Sets the op timeout (already checked: :meth:`WorkerSettings.with_timeout`); the
        communication thread is woken to wait by the new deadlines."""
        self.settings = self.settings.with_timeout(seconds)
        self.timeout = self.settings.timeout
        self._loop.notify()

    @property
    def loop(self) -> CommLoop:
        """The communication thread that runs this connection."""
        return self._loop

    @property
    def on_loop_thread(self) -> bool:
        """Whether the caller runs on the communication thread (an op's callback)."""
        return self._loop.on_thread

    def abort(self, error: BaseException, op: int = -1) -> int | None:
        """Numbers an op that this rank refuses (``error``: why) and tells the aggregator, which
        fails it on every rank; returns its number, or None if the connection is closed.
        ``op``: the number, where the caller numbers the op (a sharded op's part).

        For a refusal raised before :meth:`submit`: the other ranks' op of that number
        fails at once (:class:`~omnireduce.errors.PeerRefusedError`) instead of at its
        timeout, and every rank's later ops keep their numbers in step.
        """
        try:
            return self.submit(AbortRequest(refusal_text(error), op=op))
        except WorkerClosedError:
            return None  # nothing more goes out: the other ranks' ops fail by the lost peer

    def close(self) -> None:
        """Closes the connection; pending ops fail with WorkerClosedError.

        Called on the communication thread itself (from an op's callback), it only
        asks: the thread closes the connection after the callback. Called again (from
        another thread) while the first call closes, it returns once the connection is closed.
        """
        with self._lock:
            again = self._closed
            self._closed = True
            if self._dead is None and not again:
                self._loop.put(self, None)
        if again:
            if not self._loop.on_thread:
                self._wait_finished()
            return
        self._loop.wake()
        if self._loop.on_thread:
            if self._own_loop:
                self._loop.close()
            if self._own_context:
                # Ended once the thread has closed its sockets, after this callback: by another
                # thread, as term() waits for them (else the context and its threads would leak).
                threading.Thread(target=self._term_when_finished, name=f"omnireduce-term-r{self.rank}",
                                 daemon=True).start()
            return
        # The thread finishes the connection, or is gone (having failed its ops).
        self._wait_finished()
        if self._own_loop:
            self._loop.close()
        if self._own_context and self._finished.is_set():
            self._ctx.term()

    def _wait_finished(self) -> None:
        """Waits until the thread has closed this connection's sockets, or is gone."""
        while not self._finished.wait(0.1) and self._loop.alive:
            pass

    def _term_when_finished(self) -> None:
        """Terminates the context once the thread closed this connection's sockets (and, for a
        thread of its own, its wake-up sockets): a context terminated before that makes the
        thread's poll raise, which killed it before it said BYE (the rank then counted as lost)."""
        self._wait_finished()
        if self._own_loop:
            self._loop.join()
        self._ctx.term()

    def _open_socket(self) -> tuple[zmq.Socket, zmq.Socket]:
        """A new DEALER connecting to the aggregator, and its monitor.

        Raises:
            ConfigError: the address or the CURVE keys are unusable.
        """
        sock = transport.new_socket(self._ctx, zmq.DEALER)
        mon = None
        try:
            # Queue only on a live connection: a dead one's messages must not reach the next.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            # Never pause reading: what arrives is bounded anyway (the answers to this worker's
            # own ops), and a paused connection is where libzmq's heartbeats once aborted.
            sock.setsockopt(zmq.RCVHWM, 0)
            mon = transport.watch(sock, zmq.EVENT_HANDSHAKE_SUCCEEDED)
            transport.curve_client(sock, self.settings.curve_server_key, self.settings.curve_client_key)
            if "[" in self.address:
                sock.setsockopt(zmq.IPV6, 1)  # an IPv6 address: "tcp://[::1]:5555"
            sock.connect(self.address)
        except zmq.ZMQError as e:
            transport.close_monitored(sock, mon)
            raise ConfigError(f"cannot connect to aggregator address {self.address!r}: {e} (expected "
                              "tcp://host:port, e.g. tcp://127.0.0.1:5555)") from None
        except BaseException:
            transport.close_monitored(sock, mon)
            raise
        return sock, mon

    def _close_sockets(self) -> None:
        transport.close_monitored(self._sock, self._mon)
        if self._own_context:
            self._ctx.term()

    # Everything below runs on the communication thread only (worker.loop.CommLoop).

    def _on_attach(self) -> None:
        if self.address.startswith("inproc://"):
            # An inproc peer has no handshake (so no monitor event) to wait for: it is
            # there from connect on, and gone only with the process.
            self._on_connected()

    def _on_connected(self) -> None:
        self._connected = True
        self._refused = None
        self._handshake_failures = 0
        self._heard = self._pinged = time.monotonic()
        # Every connection starts with HELLO, ahead of anything queued.
        self._outbox.appendleft((None, self._hello))

    def _poll_out(self, poller: zmq.Poller) -> None:
        if self._renew and time.monotonic() >= self._renew_at:
            self._renew_socket(poller)
        writable = self._connected and bool(self._outbox)
        if writable != self._polling_out:
            poller.modify(self._sock, zmq.POLLIN | (zmq.POLLOUT if writable else 0))
            self._polling_out = writable

    def _renew_socket(self, poller: zmq.Poller) -> None:
        """Replaces the socket of a connection counted as lost: ZeroMQ would keep the old
        TCP connection, which the aggregator dropped (or which leads nowhere)."""
        try:
            sock, mon = self._open_socket()
        except Exception as e:  # e.g. a CURVE key file gone, out of descriptors: try again later
            self._renew_failures += 1
            if self._renew_failures == 1:
                logger.exception("worker rank %d of job %r: cannot open a new socket to %s; retrying every %g s",
                                 self.rank, self.job, self.address, _RENEW_RETRY_S)
            elif self._renew_failures % 60 == 0:
                logger.error("worker rank %d of job %r: still cannot open a new socket to %s (%d tries): %r",
                             self.rank, self.job, self.address, self._renew_failures, e)
            # New ops fail at once meanwhile, rather than at their timeout.
            self._refused = ConnectionLostError(
                f"cannot open a new connection to the aggregator at {self.address}: {e!r}", job=self.job)
            self._renew_at = time.monotonic() + _RENEW_RETRY_S
            return
        self._renew = False
        self._renew_failures = 0
        self._refused = None
        poller.unregister(self._sock)
        poller.unregister(self._mon)
        transport.close_monitored(self._sock, self._mon)
        self._sock, self._mon = sock, mon
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._mon, zmq.POLLIN)
        self._polling_out = False
        logger.info("worker rank %d of job %r: connecting anew to %s", self.rank, self.job, self.address)
        self._on_attach()

    def _mark_dead(self, error: BaseException) -> None:
        with self._lock:
            self._dead = error

    def _finish(self, bye: bool, error: BaseException | None = None) -> None:
        """Fails what is pending (with ``error``, else as closed), says goodbye if asked and
        connected, and closes the socket."""
        try:
            if error is None:
                error = WorkerClosedError(
                    f"worker rank {self.rank} of job {self.job!r} closed with ops {sorted(self._pending)} pending")
            for p in self._pending.values():
                fail_future(p.request.future, error)
            failed = set(self._pending)
            self._pending.clear()
            # What is left queued once the failed ops' messages go: HELLO and ABORTs of ops refused here.
            self._outbox = collections.deque(item for item in self._outbox if item[0] not in failed)
            if bye and any(op is not None for op, _ in self._outbox):
                self._deliver_aborts()
            if bye and self._connected:
                self._say_bye()
            transport.close_monitored(self._sock, self._mon)
        finally:
            # Under the lock: a submission either sees it set, or was queued before it,
            # where the loop's last drain (CommLoop._fail_queued) fails it.
            with self._lock:
                self._finished.set()

    def _deliver_aborts(self) -> None:
        """Waits (at most ``_ABORT_FLUSH_S``, or the op timeout) for the connection, and sends
        what is queued: the ABORTs of ops this rank refused before its first handshake, which
        the other ranks would otherwise wait for until their timeout."""
        deadline = time.monotonic() + min(_ABORT_FLUSH_S, self.timeout)
        poller = zmq.Poller()
        poller.register(self._mon, zmq.POLLIN)
        while self._outbox and not self._renew and time.monotonic() < deadline:
            if self._connected:
                self._flush()
                if self._outbox:
                    time.sleep(0.005)  # a full socket: it drains
                continue
            if poller.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                self._on_monitor()
        if self._outbox:
            logger.warning("worker rank %d of job %r: closed before %d queued message(s) (refusals) reached the "
                           "aggregator at %s", self.rank, self.job, len(self._outbox), self.address)

    def _say_bye(self) -> None:
        try:
            self._sock.send_multipart(encode(Bye(self.job, self.rank)), flags=zmq.NOBLOCK)
            self._sock.setsockopt(zmq.LINGER, _BYE_LINGER_MS)
        except zmq.ZMQError as e:
            logger.debug("worker rank %d of job %r: no BYE sent: %s", self.rank, self.job, e)

    def _wait_ms(self) -> int | None:
        deadlines = []
        if self._pending:
            deadlines.append(min(p.last_heard for p in self._pending.values()) + self.timeout)
        if self._renew:
            deadlines.append(self._renew_at)
        if self._hb and self._connected:
            # Looking every interval at least is what tells this thread's own stalls from
            # the aggregator's silence (see _check_heartbeats).
            deadlines += (self._heard + self._hb_timeout, self._looked + self._hb,
                          max(self._heard, self._pinged) + self._hb)
        if not deadlines:
            return None
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def _post(self, op: int | None, frames: list[Any]) -> None:
        """Sends now if the connection is up and has room, else queues in order."""
        if self._connected and not self._outbox:
            try:
                transport.send_frames(self._sock, frames)
                return
            except zmq.Again:
                pass
        self._outbox.append((op, frames))

    def _flush(self) -> None:
        sent = False
        while self._connected and self._outbox:
            try:
                transport.send_frames(self._sock, self._outbox[0][1])
            except zmq.Again:
                break
            self._outbox.popleft()
            sent = True
        if sent:
            # A backed-up socket that drains: the aggregator is reading what this worker sends
            # (beyond what the kernels' buffers hold), while this worker's heartbeats, and so
            # their answers, wait behind it.
            self._heard = time.monotonic()

    def _beat(self, reply: bool = False) -> None:
        """Sends a heartbeat (or the answer to one), unless the socket is backed up (then the
        aggregator hears the rest)."""
        if self._connected and not self._outbox:
            try:
                self._sock.send_multipart(self._heartbeat_reply if reply else self._heartbeat, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the socket is full of what this worker sent: the aggregator hears that

    def _connection_lost(self, why: str, renew: bool, unexplained: bool = False) -> None:
        """Fails the ops in flight on a connection that is gone; ``renew``: replace the socket
        (ZeroMQ reconnects by itself only where the TCP connection closed); ``unexplained``:
        it closed without a word from the aggregator."""
        was, self._connected = self._connected, False
        self._renew = self._renew or renew
        # HELLO and messages of the lost ops must not go out on the next connection.
        self._outbox = collections.deque(item for item in self._outbox if item[0] is not None)
        if not was:
            return
        pending = self._pending
        logger.warning("worker rank %d of job %r: %s; failing ops %s", self.rank, self.job, why, sorted(pending))
        for op in list(pending):
            hint = ""
            if unexplained:
                # The aggregator cuts a connection that sends a frame above its --max-message-bytes
                # without a word: the op's largest message says whether that may be why.
                state = pending[op].state
                layout = state.layout
                largest = min(min(layout.message_blocks, max(layout.num_columns, 1)) * layout.block_size,
                              layout.length) * state.dtype.itemsize
                hint = (f" Its messages carry up to {largest} bytes: an aggregator cuts the connection of a message "
                        "above its --max-message-bytes")
            # The ABORT goes out after the next HELLO: an op this rank never STARTed (its START
            # lost with the connection) would otherwise wait at the aggregator for it, once the
            # rank is back, until the other ranks' timeout.
            self._give_up(op, ConnectionLostError(
                f"{why}; the op's state is gone (new ops use a new connection).{hint}", job=self.job, op=op,
            ))

    def _give_up(self, op: int, error: BaseException) -> None:
        """Fails a pending op that failed on this worker alone, and tells the aggregator (an
        ABORT, now or once connected), which fails it on every rank: theirs raise at once, not
        at their timeout, and a rank's late messages do not pair with this dead op."""
        if op in self._pending:
            self._drop(op, error)
            self._post_abort(op, refusal_text(error))

    def _drop(self, op: int, error: BaseException) -> None:
        """Fails a pending op and forgets its queued messages."""
        p = self._pending.pop(op, None)
        if p is not None:
            fail_future(p.request.future, error)
        if any(o == op for o, _ in self._outbox):
            self._outbox = collections.deque(item for item in self._outbox if item[0] != op)

    def _on_monitor(self) -> None:
        pending = self._pending
        for kind, _ in transport.monitor_events(self._mon):
            if self._renew:  # the socket is to be closed: whatever its connection does no longer counts
                continue
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                logger.info("worker rank %d of job %r: connected to %s", self.rank, self.job, self.address)
                self._on_connected()
            elif kind == zmq.EVENT_DISCONNECTED:
                self._connection_lost(f"lost the connection to the aggregator at {self.address}", renew=False,
                                      unexplained=True)
            elif kind in transport.HANDSHAKE_FAILURES:
                self._connected = False
                self._handshake_failures += 1
                failure = transport.HANDSHAKE_FAILURES[kind]
                if self._handshake_failures < failure.strikes:
                    logger.info("worker rank %d of job %r: handshake with %s broke off; retrying", self.rank,
                                self.job, self.address)
                    continue
                why = f"the aggregator at {self.address} refused the connection: {failure.connector}"
                if self._refused is None:
                    logger.error("worker rank %d of job %r: %s", self.rank, self.job, why)
                # New ops fail at once too, until a handshake succeeds (ZeroMQ may not retry).
                self._refused = AuthError(why, job=self.job)
                for op in list(pending):
                    self._drop(op, AuthError(why, job=self.job, op=op))

    def _take(self, sub: OpRequest | AbortRequest) -> None:
        """Starts a submitted op: its first messages go out (or wait for the connection)."""
        if isinstance(sub, AbortRequest):
            if _start_future(sub.future):
                sub.future.set_result(None)
            self._post_abort(sub.op, sub.reason)
            return
        if not _start_future(sub.future):
            # Cancelled while queued (or completed by its caller): the op still runs (the other
            # ranks wait for its number), its result goes nowhere.
            sub.future = Future()
            sub.future.set_running_or_notify_cancel()
        if isinstance(self._refused, LimitError) and not self._renew:
            # A cap of the aggregator (its jobs) may have room again, once another job ended:
            # this connection asks anew, ahead of the op, which fails as before if it has not.
            self._refused = None
            self._post(None, self._hello)
        if self._refused is not None:
            r = self._refused
            sub.future.set_exception(type(r)(r.reason, job=self.job, op=sub.op, ranks=r.ranks))
            # Refused only until a new socket opens (see _post_abort): the op is ABORTed on it.
            self._post_abort(sub.op, refusal_text(r))
            return
        now = time.monotonic()
        try:
            state = WorkerOp.from_request(self.settings, sub)
            messages = state.start()
        except OmniReduceError as e:
            # The caller's future first: a send that fails (the socket torn down) must not leave it waiting.
            sub.future.set_exception(e)
            self._post_abort(sub.op, refusal_text(e))
            return
        except Exception as e:  # e.g. MemoryError: fail this op, not the thread
            logger.exception("worker rank %d of job %r op %d: setting up the op failed", self.rank, self.job,
                             sub.op)
            error = OpError(f"op {sub.op}: setting up the op failed: {e!r}", job=self.job, op=sub.op)
            sub.future.set_exception(error)
            self._post_abort(sub.op, refusal_text(error))
            return
        self._pending[sub.op] = _Pending(state, sub, now, now)
        for frames in messages:
            self._post(sub.op, frames)

    def _post_abort(self, op: int, reason: str) -> None:
        if self._refused is not None and not self._renew:
            return  # this connection may not take part in the job: the others hear that instead
        # (While a new socket cannot be opened, the ABORT waits in the outbox for the next one.)
        logger.info("worker rank %d of job %r op %d: refused here, telling the aggregator: %s", self.rank,
                    self.job, op, reason)
        try:
            frames = encode(Abort(self.job, self.rank, op, reason))
        except Exception:  # the refusal is raised to the caller anyway; the thread goes on
            logger.exception("worker rank %d of job %r op %d: the ABORT could not be encoded", self.rank, self.job,
                             op)
            frames = encode(Abort(self.job, self.rank, op, "(a reason that could not be encoded)"))
        self._post(op, frames)

    def _receive(self) -> None:
        pending = self._pending
        # Called when a message is in: the aggregator was heard (a lost connection's messages
        # do not count, and are read only to be dropped).
        self._heard = time.monotonic()
        while True:
            frames = transport.recv_frames(self._sock)
            if frames is None:
                return
            if self._renew:  # read, or the poll wakes at once: a lost connection's messages are of its lost ops
                continue
            try:
                msg, body = decode(frames, max_header_bytes=MAX_ERROR_HEADER_BYTES)
            except ProtocolError as e:
                logger.error(
                    "worker rank %d of job %r: undecodable message from the aggregator: %s", self.rank, self.job, e
                )
                continue
            if isinstance(msg, Heartbeat):
                if not msg.reply:  # answered whatever this worker's own settings
                    self._beat(reply=True)
                continue
            if msg.job != self.job and not (isinstance(msg, Error) and msg.job == "?"):
                logger.warning("worker rank %d of job %r: message for job %r ignored", self.rank, self.job, msg.job)
                continue
            if isinstance(msg, Error):
                self._on_error(msg)
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
                reply = p.state.on_result(msg, body)
            except OmniReduceError as e:
                self._give_up(msg.op, e)
                continue
            except Exception as e:  # a malformed result must fail its op, not the thread
                logger.exception("worker rank %d of job %r op %d: bad result from the aggregator", self.rank, self.job,
                                 msg.op)
                self._give_up(msg.op, ProtocolError(f"bad result from the aggregator for op {msg.op}: {e!r}"))
                continue
            if msg.batches is not None:  # checked by on_result
                self.batches = msg.batches
            if reply is not None:
                self._post(msg.op, reply)
            if p.state.done:
                del pending[msg.op]
                p.state.stats.seconds = time.monotonic() - p.started
                self.stats.add(p.state.stats)
                # Who waits on the future can see what its op moved (e.g. the DDP hook's auto mode).
                p.request.future.op_stats = p.state.stats  # type: ignore[attr-defined]
                try:
                    if p.request.measured is not None:
                        p.request.measured(p.state.stats)
                    result = p.request.restore(p.state.out)
                except Exception as e:  # e.g. a failed device copy: fail this op, not the thread
                    logger.exception("worker rank %d of job %r op %d: result conversion failed", self.rank, self.job,
                                     msg.op)
                    failure = e if isinstance(e, OmniReduceError) else OpError(f"op {msg.op}: {e!r}")
                    fail_future(p.request.future, failure)
                    continue
                # A caller that completed its future itself (a timeout wrapper) must not stop this thread.
                with contextlib.suppress(InvalidStateError):
                    p.request.future.set_result(result)

    def _on_error(self, msg: Error) -> None:
        pending = self._pending
        if msg.code == ErrorCode.DROPPED:
            self._connection_lost(f"the aggregator at {self.address} dropped the connection ({msg.message})",
                                  renew=True)
            return
        cls = _ERRORS.get(msg.code, AggregatorError)
        if msg.op is None:
            logger.error("worker rank %d of job %r: the aggregator refused: %s", self.rank, self.job, msg.message)
            if msg.code in _REFUSALS:
                self._refused = cls(f"aggregator: {msg.message}", job=self.job, ranks=msg.ranks)
            for op in list(pending):
                # Refused as a connection (then no ABORT goes out), or one message of it was:
                # the aggregator failed none of these ops on the other ranks.
                self._give_up(op, cls(f"aggregator: {msg.message}", job=self.job, op=op, ranks=msg.ranks))
            return
        if msg.op in pending:
            logger.warning(
                "worker rank %d of job %r op %d: aggregator error: %s", self.rank, self.job, msg.op, msg.message
            )
            self._drop(msg.op, cls(f"aggregator: {msg.message}", job=self.job, op=msg.op, ranks=msg.ranks))
        else:
            logger.debug("worker rank %d of job %r op %d (not pending): aggregator error: %s",
                         self.rank, self.job, msg.op, msg.message)

    def _expire(self) -> None:
        pending = self._pending
        now = time.monotonic()
        if self._hb and self._connected:
            self._check_heartbeats(now)
        for op, p in list(pending.items()):
            if now - p.last_heard > self.timeout:
                how = "" if self._connected else " (no connection to it)"
                error = OpTimeoutError(
                    f"no answer from the aggregator at {self.address} for {self.timeout:g} s{how}", job=self.job, op=op,
                )
                # The aggregator may wait longer than this worker (its own timeout): told, it fails
                # the op on every rank now, where it would otherwise still pair a late rank's
                # message with this dead op (a send "delivered" to a recv that gave up).
                self._give_up(op, error)

    def _check_heartbeats(self, now: float) -> None:
        if now - self._looked > self._stall:
            # This thread did not run for a while: the aggregator's messages since then are
            # unread, so its silence starts again now.
            self._heard = now
        self._looked = now
        if now - self._heard > self._hb_timeout:
            self._connection_lost(
                f"heard nothing from the aggregator at {self.address} for {self._hb_timeout:g} s (no heartbeat)",
                renew=True,
            )
        elif now - self._heard > self._hb and now - self._pinged > self._hb:
            self._pinged = now
            self._beat()


def _start_future(future: Future) -> bool:
    """Marks a submitted op's future running; False if its caller cancelled or completed it already."""
    try:
        return future.set_running_or_notify_cancel()
    except RuntimeError:  # "in unexpected state: FINISHED": completed by its caller
        return False
