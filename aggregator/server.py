"""The aggregator daemon as a library object: a ROUTER socket around :class:`Engine`.

Besides moving messages, the socket loop notices workers that go away: the
socket's monitor reports every closed connection (a killed process closes its
TCP connection at once), heartbeats (:mod:`aggregator.liveness`) find a paused or
unreachable one, and the engine then fails the ops that needed it. The monitor
names connections by file descriptor, so the loop remembers which connection
each routing id arrived on (:mod:`aggregator.connections`, which also keeps a closed
connection's late messages from being taken for those of the next connection on
its descriptor).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from aggregator.connections import Connections, seed_generated_ids
from aggregator.engine import Engine, Outgoing
from aggregator.limits import Limits, RateLimitedLog
from aggregator.liveness import Liveness
from omnireduce import config, memory, transport
from omnireduce.errors import ConfigError
from omnireduce.protocol import Error, ErrorCode, Heartbeat, encode

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)

__all__ = ["Aggregator"]

_POLL_MS = 50
# A closed connection's last messages (a BYE) are read before it is declared gone;
# under a flood that keeps the socket busy, after this many seconds regardless.
_DEPARTURE_GRACE_S = 1.0
# Messages handled before the loop looks at timeouts, the monitor and the stop flag again.
_BATCH = 256
# serve_step's marks for an id without a tracked connection: a late message to drop, and
# one whose connection has ended (its frames were still the socket's own copy).
_UNTRACKED = object()
_CLOSED = (-1, -1)
# Far above what the protocol keeps in flight (streams x ops per worker), so a
# full queue means a peer that stopped reading, which ROUTER_MANDATORY reports.
_SNDHWM = 100_000
# A connection whose sent data goes unacknowledged this many heartbeat timeouts (at least
# _MIN_MAXRT_S) is closed by the kernel (TCP_USER_TIMEOUT): a ROUTER cannot close one
# connection itself, so that of a worker dropped for silence and unreachable (a partition)
# would hold its descriptor until TCP's retransmissions give up, about 15 minutes.
_MAXRT_TIMEOUTS = 2
_MIN_MAXRT_S = 2.0
_HEARTBEAT = encode(Heartbeat("?"))
# Why a connection whose end the monitor told of is gone.
_DEPARTED = "disconnected (connection closed)"


def _bindable(listen: str) -> str:
    """ZeroMQ spells "any free port" as ``*``; accept the conventional port 0 too.

    Raises:
        ConfigError: a TCP port outside 0-65535 (ZeroMQ would take it modulo 65536).
    """
    tcp = re.fullmatch(r"tcp://(.+):([^:\]]*)", listen)
    if tcp is not None and tcp.group(2) != "*":
        port = tcp.group(2)
        if not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"the port of {listen!r} must be 0-65535 (0 or * for any free one)")
        if int(port) == 0:
            return f"tcp://{tcp.group(1)}:*"
    return listen


class Aggregator:
    """Sums the blocks of every job's workers and tells them which block comes next.

    Args:
        listen: ZeroMQ endpoint to bind, e.g. ``tcp://0.0.0.0:5555``; port 0 picks a free port.
            A sequence (or comma-separated string) binds each: a co-located worker
            reaches its own shard over ``inproc://`` while the others use TCP.
        timeout: seconds after an op's first message at which it is failed on all its
            workers; None waits forever.
        context: ZeroMQ context to use; a private one by default (CURVE needs its
            authenticator, one per context). It must have one I/O thread (the default).
        limits: caps on jobs, world size, ops in flight, bytes held and message size.
        heartbeat: seconds without hearing from a connection after which it gets a
            heartbeat (at most one per interval); default ``$OMNIREDUCE_HEARTBEAT``, else 1;
            0 turns them off (the aggregator still answers the workers' heartbeats).
        heartbeat_timeout: seconds without a message from a connection after which it
            is dropped and its worker counted as lost; default
            ``$OMNIREDUCE_HEARTBEAT_TIMEOUT``, else 5.
        curve_secret_key: the aggregator's ``.key_secret`` file; turns CURVE on.
            Default ``$OMNIREDUCE_CURVE_SECRET_KEY``.
        curve_client_keys: directory of the workers' ``.key`` files that may connect;
            None accepts any key. Default ``$OMNIREDUCE_CURVE_CLIENT_KEYS``.
        metrics_port: serve Prometheus metrics over HTTP on this port (0 picks a
            free one); None serves none.
        metrics_addr: address the metrics endpoint binds.

    Example::

        agg = Aggregator(listen="tcp://127.0.0.1:0")
        agg.start()
        print(agg.address)
        agg.close()
    """

    def __init__(
        self,
        listen: str | Sequence[str] = "tcp://127.0.0.1:0",
        timeout: float | None = None,
        context: zmq.Context | None = None,
        *,
        limits: Limits | None = None,
        heartbeat: float | None = None,
        heartbeat_timeout: float | None = None,
        curve_secret_key: str | os.PathLike[str] | None = None,
        curve_client_keys: str | os.PathLike[str] | None = None,
        metrics_port: int | None = None,
        metrics_addr: str = "127.0.0.1",
    ) -> None:
        self.limits = limits or Limits()
        heartbeat, heartbeat_timeout = config.resolve_heartbeat(heartbeat, heartbeat_timeout)
        secret = config.resolve_optional(curve_secret_key, config.OMNIREDUCE_CURVE_SECRET_KEY, str)
        allowed = config.resolve_optional(curve_client_keys, config.OMNIREDUCE_CURVE_CLIENT_KEYS, str)
        if allowed is not None and secret is None:
            raise ConfigError("curve_client_keys needs curve_secret_key (CURVE is off without a server key)")
        endpoints = config.split_addresses(listen)
        if not endpoints:
            raise ConfigError("no endpoint to listen on")
        self.heartbeat_timeout = heartbeat_timeout if heartbeat else None
        # Read and written by the serving thread only.
        self._liveness = Liveness(heartbeat, heartbeat_timeout) if heartbeat else None
        self._dropped_error = encode(Error(
            "?", None, ErrorCode.DROPPED,
            f"the aggregator heard nothing from this connection for {heartbeat_timeout:g} s and dropped it", [],
        ))
        memory.tune_malloc()
        if context is not None and context.get(zmq.IO_THREADS) != 1:
            # aggregator.connections relies on one I/O thread's order of events and messages.
            raise ConfigError(f"the aggregator needs a context of one I/O thread, got {context.get(zmq.IO_THREADS)}")
        # Before the context: a bad timeout leaves nothing to tear down.
        self.engine = Engine(timeout=timeout, limits=self.limits)
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self.counters = self.engine.counters
        self._auth: ThreadAuthenticator | None = None
        self._metrics: Any = None
        self._mon: zmq.Socket | None = None
        seed_generated_ids()
        self._sock = transport.new_socket(self._ctx, zmq.ROUTER)
        #: Every endpoint bound, as resolved (port 0 replaced by the port chosen).
        self.addresses: list[str] = []
        try:
            self._configure(heartbeat, heartbeat_timeout, secret, allowed)
            for endpoint in endpoints:
                # On for an IPv6 endpoint ("tcp://[::1]:5555") only: with it on, an IPv4 one is
                # bound and reported as an IPv4-mapped address ("[::ffff:127.0.0.1]").
                self._sock.setsockopt(zmq.IPV6, int("[" in endpoint))
                self._sock.bind(_bindable(endpoint))
                self.addresses.append(self._sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except BaseException as e:
            self._teardown()
            if isinstance(e, zmq.ZMQError):
                hint = "" if e.errno == zmq.EADDRINUSE else " (expected tcp://host:port, e.g. tcp://0.0.0.0:5555)"
                raise OSError(f"cannot listen on {listen!r}: {e}{hint}") from e
            raise
        #: The first endpoint bound, as resolved.
        self.address: str = self.addresses[0]
        self._inproc = any(a.startswith("inproc://") for a in self.addresses)
        self.curve = secret is not None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: What ended the serving loop, if an error did (it logs it too).
        self.failure: BaseException | None = None
        self._closed = False
        self._serving = False
        # Set once serve_forever returns (None unless it was called), and its thread.
        self._forever: threading.Event | None = None
        self._forever_thread: int | None = None
        # close() ran on serve_forever's thread: the context is termed once that loop ends.
        self._term_later = False
        # Connection bookkeeping for the monitor (see the module docstring).
        self._conns = Connections()
        # Departing ids (see Connections), with when, until declared gone.
        self._departed: list[tuple[float, bytes]] = []
        self._log = RateLimitedLog(logger)
        self.metrics_address: str | None = None
        if metrics_port is not None:
            from aggregator.metrics import serve_metrics  # prometheus-client only when asked for

            try:
                if type(metrics_port) is not int or not 0 <= metrics_port <= 65535:
                    raise ConfigError(f"metrics_port must be 0-65535 (0: any free port), got {metrics_port!r}")
                self._metrics = serve_metrics(self, metrics_port, metrics_addr)
            except OSError as e:
                self._teardown()
                raise OSError(f"cannot serve metrics on port {metrics_port}: {e}") from e
            except BaseException:
                self._teardown()
                raise
            host, port = self._metrics.server_address[:2]
            host = f"[{host}]" if ":" in host else host
            self.metrics_address = f"http://{host}:{port}/metrics"
            logger.info("metrics on %s", self.metrics_address)
        logger.info(
            "omnireduce aggregator listening on %s%s", ", ".join(self.addresses), " (CURVE)" if self.curve else ""
        )

    def _configure(self, heartbeat: float, heartbeat_timeout: float, secret: str | None, allowed: str | None) -> None:
        s = self._sock
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.SNDHWM, _SNDHWM)
        # Inbound queues apply back-pressure (nothing is dropped), so this bounds memory safely.
        s.setsockopt(zmq.RCVHWM, self.limits.max_queued_messages)
        s.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        # No ZeroMQ heartbeats (see omnireduce.protocol.Heartbeat): the loop sends its own.
        if heartbeat:
            maxrt = max(_MAXRT_TIMEOUTS * heartbeat_timeout, _MIN_MAXRT_S)
            s.setsockopt(zmq.TCP_MAXRT, min(int(maxrt * 1000), 2**31 - 1))
        self._auth = transport.curve_server(s, secret, allowed)
        self._mon = transport.watch(s, zmq.EVENT_ACCEPTED)

    def _teardown(self) -> None:
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
            self._metrics = None
        transport.close_monitored(self._sock, self._mon)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_context:
            self._ctx.term()

    def start(self) -> Aggregator:
        """Serves in a background thread; returns self."""
        self._claim()
        self._thread = threading.Thread(target=self._serve_thread, name="omnireduce-aggregator", daemon=True)
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """Whether the thread of :meth:`start` still serves (False before start, after
        close, and once an error ended it: see :attr:`failure`)."""
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def serve_forever(self) -> None:
        """Serves in the calling thread until :meth:`close` is called from another thread."""
        done = threading.Event()
        self._forever_thread = threading.get_ident()
        self._claim(forever=done)
        try:
            self._serve()
        finally:
            done.set()
            if self._term_later:
                self._ctx.term()

    def close(self) -> None:
        """Stops serving and releases the socket; in-flight ops are abandoned.

        An aggregator served by another loop (:meth:`serve_sockets`) is closed after that
        loop stopped serving it (:meth:`serve_end`).
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
            self._metrics = None
        # Called on serve_forever's own thread (a signal handler there): it cannot wait for that
        # loop, which then closes the sockets and terms the context as it returns.
        inside = self._forever is not None and self._forever_thread == threading.get_ident()
        if self._forever is not None:
            if not inside:
                # serve_forever's thread closes the sockets once its poll returns: term() before
                # that would fail its poll (ContextTerminated) and end it as a crash.
                self._forever.wait()
        elif not self._serving or self._thread is not None:
            self._close_sockets()
        # A loop serving it (serve_sockets) closes the sockets in serve_end.
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_context:
            if inside and not self._forever.is_set():
                self._term_later = True
            else:
                self._ctx.term()

    def __enter__(self) -> Aggregator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_sockets(self) -> None:
        transport.close_monitored(self._sock, self._mon)

    # Everything below runs on the serving thread only.

    def _send_all(self, out: list[Outgoing]) -> None:
        if not out:
            return
        gone: list[bytes] = []
        for peer, frames in out:
            # Counted before the send: once a worker holds the message, the metric (read from
            # another thread) includes it; a failed send takes it back.
            nbytes = transport.frames_nbytes(frames)
            self.counters.bytes_out += nbytes
            try:
                transport.send_frames(self._sock, [peer, *frames])
            except zmq.ZMQError as e:
                self.counters.bytes_out -= nbytes
                self.counters.send_failures += 1
                if e.errno == zmq.EHOSTUNREACH:
                    # The routing id is gone: so is its connection. One whose end the
                    # monitor told of is declared once its last messages (a BYE) are read.
                    if peer not in gone and peer not in self._conns.departing:
                        self._log(logging.INFO, "connection %s is gone (no route on send)", peer.hex())
                        gone.append(peer)
                else:
                    # A peer that stopped reading (EAGAIN): the heartbeat timeout or the
                    # op's timeout deal with it; never stall the other jobs for it.
                    self._log(logging.WARNING, "cannot send to connection %s: %s", peer.hex(), e)
        for peer in gone:
            self._lost(peer, "disconnected")

    def _lost(self, peer: bytes, reason: str) -> None:
        self._conns.forget(peer)
        if self._liveness is not None:
            self._liveness.forget(peer)
        self._send_all(self.engine.peer_gone(peer, reason))

    def _track(self, peer: bytes, frame: zmq.Frame) -> bool:
        """Records the connection of a new routing id; False: drop its message (late)."""
        try:
            fd = frame.get(zmq.SRCFD)
        except (zmq.ZMQError, AttributeError, ValueError) as e:  # deprecated in libzmq; may vanish
            # An inproc peer has no descriptor; it lives and dies with this process.
            if not self._inproc:
                self._log(logging.WARNING, "cannot tell connections apart (%s): dead workers are noticed on send only",
                          e)
            return self._conns.track(peer, None)[0]
        # Events up to the acceptance of this connection were emitted before its first
        # message could arrive: read them all so the connection count is its own.
        self._read_monitor()
        handle, stale = self._conns.track(peer, fd)
        if not handle:
            logger.debug("a late message of closed connection %s (fd %d) dropped", peer.hex(), fd)
        elif peer in self._conns.departing:
            logger.debug("connection %s (fd %d) closed before its first message was read", peer.hex(), fd)
            self._departed.append((time.monotonic(), peer))
        for old in stale:
            self._log(logging.INFO, "connection %s (fd %d) is gone: %s, issued later, came on its descriptor",
                      old.hex(), fd, peer.hex())
            self._lost(old, "disconnected")
        return handle

    def _untracked(self, peer: bytes, frame: zmq.Frame) -> Any:
        """The connection of a message whose id is not tracked (tracking a new id now);
        :data:`_CLOSED` for a departing id, whose last messages are still read, and
        :data:`_UNTRACKED` for a late message to drop."""
        conns = self._conns
        if conns.is_gone(peer):
            return _UNTRACKED
        if peer not in conns.departing and not self._track(peer, frame):
            return _UNTRACKED
        # A departing id had a descriptor (the monitor told of its end), as a new one may.
        return conns.conn_of.get(peer, _CLOSED)

    def _read_monitor(self) -> None:
        for kind, value in transport.monitor_events(self._mon):
            if kind == zmq.EVENT_ACCEPTED:
                self._conns.accepted(value)
            elif kind == zmq.EVENT_DISCONNECTED:
                for peer in self._conns.disconnected(value):
                    logger.debug("connection %s (fd %d) closed", peer.hex(), value)
                    # Its last messages may still wait in the socket: see _declare_departures.
                    self._departed.append((time.monotonic(), peer))
            elif kind in transport.HANDSHAKE_FAILURES:
                failure = transport.HANDSHAKE_FAILURES[kind]
                if failure.aborted:
                    self.counters.error("handshake_aborted")
                    self._log(logging.INFO, "%s (errno %s)", failure.listener, value)
                else:
                    self.counters.error("handshake")
                    self._log(logging.WARNING, "refused a connection: %s (%s)", failure.listener, value)

    def _heartbeats(self, liveness: Liveness, now: float) -> None:
        """Drops the connections silent past the timeout; sends heartbeats to the idle ones."""
        silent, idle = liveness.due(now)
        why = f"sent nothing for {liveness.timeout:g} s (no heartbeat)"
        for peer in silent:
            self._log(logging.WARNING, "connection %s %s: dropping it", peer.hex(), why)
            # It may only be paused: once it reads again, it learns to connect anew.
            self._send_all([(peer, self._dropped_error)])
            if peer in liveness.heard:  # else the send found it gone, and declared it so
                self.counters.connections_dropped += 1
                self._lost(peer, why)
                liveness.dropped(peer, now)
        self._send_all([(peer, _HEARTBEAT) for peer in idle])

    def _declare_departures(self, drained: bool) -> None:
        """Declares closed connections gone, once their last messages (a BYE) have been read.

        A connection's messages enter the socket before the monitor reports its end,
        so once the socket has been read empty, every departure known is final.
        """
        if not self._departed:
            return
        now = time.monotonic()
        ready = [d for d in self._departed if drained or now - d[0] > _DEPARTURE_GRACE_S]
        if not ready:
            return
        self._departed = [d for d in self._departed if d not in ready]
        for _, peer in ready:
            if peer in self._conns.departing:  # else it was declared already
                self._lost(peer, _DEPARTED)

    def _claim(self, forever: threading.Event | None = None) -> None:
        """Marks the aggregator served: by one thread or loop only, and never once closed
        (``forever``: by serve_forever, which sets it when it returns)."""
        if self._serving or self._closed:
            raise RuntimeError("aggregator already served or closed")
        # Before _serving: a close() that sees it served by serve_forever waits for it.
        self._forever = forever
        self._serving = True

    def _serve_thread(self) -> None:
        try:
            self._serve()
        except Exception:
            pass  # logged by _serve and kept in self.failure; alive now says so to the owner

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in (self._sock, self._mon):
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self.serve_step(dict(poller.poll(_POLL_MS)))
        except Exception as e:
            logger.exception("aggregator loop died")
            self.failure = e
            raise
        finally:
            self._close_sockets()

    # Serving from another loop: a co-located worker's communication thread polls these
    # sockets with its own, so that its shard needs no thread (and no wake-up) of its own.

    def serve_sockets(self) -> list[zmq.Socket]:
        """The sockets to poll for input, whose events :meth:`serve_step` takes.

        Whoever serves the aggregator this way (one thread, instead of :meth:`start`)
        calls :meth:`serve_step` after every poll and at least every
        :attr:`serve_interval_ms`, and :meth:`serve_end` on that thread when done.

        Raises:
            RuntimeError: the aggregator is served already, or closed.
        """
        self._claim()
        return [self._sock, self._mon]

    #: How long a loop serving the aggregator may poll before calling :meth:`serve_step`
    #: again (ops time out on it).
    serve_interval_ms = _POLL_MS

    def serve_step(self, events: Mapping[Any, int]) -> None:
        """Handles what arrived: ``events`` is the poll's result for :meth:`serve_sockets`."""
        liveness = self._liveness
        now = time.monotonic()
        heard = liveness.heard if liveness is not None else None
        if self._mon in events:
            self._read_monitor()
        counters = self.counters
        # Read even without POLLIN: a message may have come after the poll, before
        # the monitor told of its connection's end.
        drained = False
        for _ in range(_BATCH):
            frames = transport.recv_frames(self._sock)
            if frames is None:
                drained = True
                break
            peer = frames[0].bytes
            counters.bytes_in += transport.frames_nbytes(frames) - len(peer)
            conn = self._conns.conn_of.get(peer, _UNTRACKED)
            if conn is _UNTRACKED:
                conn = self._untracked(peer, frames[0])
                if conn is _UNTRACKED:
                    counters.messages_in += 1
                    counters.late_dropped += 1
                    if liveness is not None and liveness.tell_dropped(peer, now):
                        self._send_all([(peer, self._dropped_error)])
                    continue
            if heard is not None:
                heard[peer] = now
            # A peer with a socket descriptor sent a copy (TCP, IPC); an inproc
            # peer (a co-located worker) handed over its own memory.
            self._send_all(self.engine.handle(peer, frames[1:], owned=conn is not None))
        self._declare_departures(drained)
        self._send_all(self.engine.expire())
        if liveness is not None:
            self._heartbeats(liveness, time.monotonic())

    def serve_end(self) -> None:
        """Closes the sockets: called on the thread that served them, when it stops."""
        self._close_sockets()
