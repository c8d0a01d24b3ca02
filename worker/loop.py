"""The communication thread: one thread serving the sockets of one or more connections.

A :class:`CommLoop` owns one thread, one poller and one wake-up socket. Every
:class:`worker.connection.Connection` attached to it hands its op requests to
that thread, which polls all their sockets at once. A plain worker has a loop of
its own; a sharded or co-located worker shares one loop among its shards'
connections, so that an op split over ``S`` shards wakes one thread, not ``S``,
and the shards' halves of the op run one after the other without contending for
the GIL.

The thread can also serve a :class:`Service`: a co-located worker's aggregator
shard, whose sockets it polls with the connections' own. The rank's requests to
its own shard and the shard's answers then pass between the two on one thread,
with no thread of the shard's own to wake for every message.

If the thread dies (a bug), every op pending or queued on every attached
connection fails with :class:`omnireduce.errors.WorkerClosedError` naming the
cause, and every later submission is refused.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from omnireduce.errors import WorkerClosedError

if TYPE_CHECKING:
    from worker.connection import AbortRequest, Connection
    from worker.op import OpRequest

logger = logging.getLogger(__name__)

__all__ = ["CommLoop", "OpFuture", "Service", "fail_future"]

_wake_ids = itertools.count()
# The loops alive, closed at interpreter exit (see _close_at_exit).
_LOOPS: weakref.WeakSet[CommLoop] = weakref.WeakSet()
# How long exit waits for one loop's thread to finish its connections (BYE, queued ABORTs).
_EXIT_JOIN_S = 5.0


def _close_at_exit() -> None:
    """Stops every loop still running when the interpreter exits (a script that never closed
    its worker or destroyed its process group): its daemon thread would otherwise run on into
    the interpreter's teardown, where freeing a torch tensor there aborted the process
    (SIGABRT, "terminate called without an active exception")."""
    for loop in list(_LOOPS):
        try:
            loop._stop_at_exit()
        except Exception:  # noqa: BLE001 - exit goes on for the other loops
            logger.debug("a worker's communication thread did not stop at exit", exc_info=True)


atexit.register(_close_at_exit)
# Queue items: (connection, what): what is _ATTACH, an OpRequest or AbortRequest, or None (close the
# connection); (service, sockets) with _SERVE; a bare None stops the loop.
_ATTACH = object()
_SERVE = object()
_Item = tuple[Any, Any] | tuple[Any, Any, Any] | None


class Service(Protocol):
    """Something a :class:`CommLoop` serves besides its connections (an aggregator shard:
    :class:`aggregator.server.Aggregator` is one)."""

    #: The longest the loop may poll before calling :meth:`serve_step` again.
    serve_interval_ms: int

    def serve_sockets(self) -> list[zmq.Socket]:
        """The sockets to poll for input; called once, before the loop takes them over."""
        ...

    def serve_step(self, events: Mapping[Any, int]) -> None:
        """Handles what arrived (``events``: the poll's result, which may name none of its sockets)."""
        ...

    def serve_end(self) -> None:
        """Closes the sockets; called on the loop's thread when it stops."""
        ...


class CommLoop:
    """One communication thread for the connections attached to it.

    Args:
        context: ZeroMQ context of the wake-up socket pair; a private one by default.
            The connections' own sockets may belong to any context.
        name: the thread's name.
    """

    def __init__(self, context: zmq.Context | None = None, name: str = "omnireduce-worker") -> None:
        self._own_context = context is None
        self._ctx = context if context is not None else zmq.Context()
        wake = f"inproc://omnireduce-worker-wake-{id(self)}-{next(_wake_ids)}"
        self._wake_recv = self._ctx.socket(zmq.PAIR)
        self._wake_recv.bind(wake)
        self._wake_send = self._ctx.socket(zmq.PAIR)
        self._wake_send.connect(wake)
        self._wake_lock = threading.Lock()
        # Per calling thread: inside held_wakes (depth), and whether a wake-up is owed.
        self._held = threading.local()
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        # Guards _channels, _stopping and _dead: no connection attaches to a dead or stopped loop.
        self._lock = threading.Lock()
        self._channels: list[Connection] = []
        self._stopping = False
        self._dead: BaseException | None = None
        # Set when close() was called on the thread itself, which then cleans up on exit.
        self._closed_here = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _LOOPS.add(self)

    @property
    def on_thread(self) -> bool:
        """Whether the caller runs on this loop's thread (e.g. in a future's callback)."""
        return threading.current_thread() is self._thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def attach(self, conn: Connection) -> None:
        """Hands ``conn``'s socket to the thread.

        Raises:
            WorkerClosedError: the loop is closed or its thread died.
        """
        with self._lock:
            if self._stopping or self._dead is not None:
                raise WorkerClosedError("the worker's communication thread is closed") from self._dead
            self._channels.append(conn)
            self._queue.put((conn, _ATTACH))
        self.wake()

    def serve(self, service: Service) -> None:
        """Serves ``service`` on the thread until the loop closes (which ends it).

        Raises:
            WorkerClosedError: the loop is closed or its thread died.
            RuntimeError: ``service`` is served already.
        """
        with self._lock:
            if self._stopping or self._dead is not None:
                raise WorkerClosedError("the worker's communication thread is closed") from self._dead
            sockets = service.serve_sockets()
            self._queue.put((service, _SERVE, sockets))
        self.wake()

    def put(self, conn: Connection, what: OpRequest | AbortRequest | None) -> None:
        """Queues an op request of ``conn`` (or, with None, its close); the caller holds ``conn``'s lock."""
        self._queue.put((conn, what))

    @contextlib.contextmanager
    def held_wakes(self) -> Iterator[None]:
        """Within this block, :meth:`notify` by this thread wakes the loop once, at the end of
        the outermost such block of this thread.

        A sharded op queues one request per shard: woken by the first, the thread
        would start on it while the caller still queues the others, and the two
        would trade the GIL (a context switch each time) for the rest of the op.
        Do not wait inside the block for anything the loop must do first: what was
        queued in it is not served before the block ends.
        """
        held = self._held
        held.depth = getattr(held, "depth", 0) + 1
        try:
            yield
        finally:
            held.depth -= 1
            if held.depth == 0 and getattr(held, "pending", False):
                held.pending = False
                self.wake()

    def notify(self) -> None:
        """Wakes the thread for what was just queued: now, or at the end of :meth:`held_wakes`."""
        held = self._held
        if getattr(held, "depth", 0):
            held.pending = True
        else:
            self.wake()

    def wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_send.send(b"", flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already queued, or the thread is gone

    def close(self) -> None:
        """Stops the thread; connections still attached close as by their own ``close``."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._queue.put(None)
        self.wake()
        if self.on_thread:
            self._closed_here = True
            return  # the thread stops, and closes the wake-up socket, after the callback that closed it
        self._thread.join()
        self._close_wake_send()

    def join(self) -> None:
        """Waits for the thread to end (after :meth:`close`; not on the thread itself)."""
        self._thread.join()

    def _stop_at_exit(self) -> None:
        """:meth:`close`, its wait bounded (``_EXIT_JOIN_S``): exit must not hang on a stuck thread."""
        with self._lock:
            if self._stopping or not self._thread.is_alive():
                return
            self._stopping = True
            self._queue.put(None)
        self.wake()
        self._thread.join(_EXIT_JOIN_S)
        if not self._thread.is_alive():
            self._close_wake_send()

    def _close_wake_send(self) -> None:
        with self._wake_lock:
            if self._wake_send.closed:
                return
            self._wake_send.close()
        if self._own_context:
            self._ctx.term()

    # Everything below runs on the thread only.

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_recv, zmq.POLLIN)
        active: list[Connection] = []
        services: list[Service] = []
        try:
            while True:
                for ch in active:
                    ch._poll_out(poller)
                events = dict(poller.poll(_wait_ms(active, services)))
                for ch in active:
                    if ch._mon in events:
                        ch._on_monitor()
                if self._wake_recv in events:
                    while self._wake_recv.poll(0):
                        self._wake_recv.recv()
                    if self._take(active, services, poller):
                        return
                for ch in active:
                    if ch._sock in events:
                        ch._receive()
                for ch in active:
                    ch._flush()
                # After the flush: what this rank just sent its own shard is handled now.
                for svc in services:
                    svc.serve_step(events)
                for ch in active:
                    ch._expire()
        except BaseException as e:  # noqa: BLE001 - SystemExit from a callback too: no connection may stay attached
            logger.exception("worker communication thread %s died", self._thread.name)
            self._die(e, active, poller)
        finally:
            try:
                for ch in list(active):
                    self._finish(ch, active, poller, bye=True)
            finally:
                # Whatever happened above: a service's sockets left open would hang its context's term().
                for svc in services:
                    _end_quietly(svc)
                # Requests queued behind the stop, by connections of a shared loop that
                # were finished above: nothing would ever answer their futures.
                self._fail_queued(WorkerClosedError("the worker's communication thread is closed"))
            self._wake_recv.close()
            if self._closed_here:
                self._close_wake_send()

    def _take(self, active: list[Connection], services: list[Service], poller: zmq.Poller) -> bool:
        """Takes the queued items; True once the loop is told to stop."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return False
            if item is None:
                return True
            if item[1] is _SERVE:
                for sock in item[2]:
                    poller.register(sock, zmq.POLLIN)
                services.append(item[0])
                continue
            ch, what = item[:2]
            if what is _ATTACH:
                poller.register(ch._sock, zmq.POLLIN)
                poller.register(ch._mon, zmq.POLLIN)
                active.append(ch)
                ch._on_attach()
            elif what is None:
                self._finish(ch, active, poller, bye=True)
            else:
                ch._take(what)

    def _finish(self, ch: Connection, active: list[Connection], poller: zmq.Poller, bye: bool,
                error: BaseException | None = None) -> None:
        if ch in active:
            active.remove(ch)
            poller.unregister(ch._sock)
            poller.unregister(ch._mon)
        with self._lock:
            if ch in self._channels:
                self._channels.remove(ch)
        ch._finish(bye, error)

    def _die(self, error: BaseException, active: list[Connection], poller: zmq.Poller) -> None:
        closed = WorkerClosedError(f"communication thread died: {error!r}")
        with self._lock:
            self._dead = error
            channels = list(self._channels)
        for ch in channels:
            # Under each connection's lock: no submission can be queued after the drain below.
            ch._mark_dead(error)
        self._fail_queued(closed)
        for ch in channels:
            self._finish(ch, active, poller, bye=False, error=closed)

    def _fail_queued(self, error: BaseException) -> None:
        """Empties the queue: fails its op requests with ``error`` and ends its services."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None or item[1] is None or item[1] is _ATTACH:
                continue
            if item[1] is _SERVE:
                _end_quietly(item[0])  # never taken: its sockets are still to close
            else:
                fail_future(item[1].future, error)


def _wait_ms(active: list[Connection], services: list[Service]) -> int | None:
    waits = [w for w in (ch._wait_ms() for ch in active) if w is not None]
    waits += [svc.serve_interval_ms for svc in services]
    return min(waits) if waits else None


def _end_quietly(svc: Service) -> None:
    try:
        svc.serve_end()
    except Exception:
        logger.exception("ending the service %r failed", svc)


#: Why a blocking call made on a communication thread is refused.
WAITS_FOR_ITSELF = ("a blocking allreduce on the worker's communication thread (in an op's callback) would wait "
                    "for that thread itself: use allreduce_async there")


class OpFuture(Future):
    """The future of an op run by ``loop``: waiting for it on that loop's thread while it is
    pending raises at once.

    That thread completes the op (and times it out): a callback of another op that waited
    there for this one would wait for itself, for good, and every op of the loop with it.
    """

    def __init__(self, loop: CommLoop) -> None:
        super().__init__()
        self._loop = loop

    def _refuse_waiting_for_itself(self, timeout: float | None) -> None:
        # A zero timeout only polls (TimeoutError if pending); any wait there is for nothing.
        if (timeout is None or timeout > 0) and not self.done() and self._loop.on_thread:
            raise RuntimeError("waiting for an op's future on the worker's communication thread (in an op's "
                               "callback) would wait for that thread itself: chain a callback instead")

    def result(self, timeout: float | None = None) -> Any:
        self._refuse_waiting_for_itself(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._refuse_waiting_for_itself(timeout)
        return super().exception(timeout)


def fail_future(fut: Future, error: BaseException) -> None:
    """Fails ``fut`` with ``error`` unless it is done already (by another thread too: a close
    and a result may race to complete it)."""
    with contextlib.suppress(InvalidStateError):
        fut.set_exception(error)


def forward(src: Future, dst: Future, transform: Callable[[Any], Any] | None = None) -> None:
    """Completes ``dst`` as ``src`` completes: with ``transform(result)`` (or the result), or
    with its error; a cancelled ``src`` fails ``dst``."""
    def done(f: Future) -> None:
        if f.cancelled():
            fail_future(dst, WorkerClosedError("the op was cancelled"))
            return
        error = f.exception()
        if error is not None:
            fail_future(dst, error)
            return
        try:
            value = f.result() if transform is None else transform(f.result())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on dst
            logger.exception("forwarding an op's result failed")
            fail_future(dst, e)
            return
        with contextlib.suppress(InvalidStateError):  # completed already (a close that failed it)
            dst.set_result(value)

    src.add_done_callback(done)
