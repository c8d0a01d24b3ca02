"""The ZeroMQ plumbing both sides share: socket options, CURVE, monitors, teardown.

The aggregator binds a ROUTER socket and every worker connects a DEALER; both set
their sockets up and take them down the same way:

- :func:`new_socket`: a socket that drops unsent messages when closed (``LINGER`` 0),
  so closing never waits for a peer that is gone;
- :func:`curve_server` and :func:`curve_client`: CURVE encryption and key
  authentication, by way of :mod:`omnireduce.auth`;
- :func:`watch`, :func:`monitor_events` and :data:`HANDSHAKE_FAILURES`: the
  socket's monitor, which reports closed connections and refused handshakes;
- :func:`close_monitored`: the socket and its monitor closed together;
- :func:`frames_nbytes`: what a message's frames weigh on the wire;
- :func:`send_frames` and :func:`recv_frames`: a message sent and received without
  waiting, in fewer Python calls than pyzmq's ``send_multipart``/``recv_multipart``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.backend import Socket as _BackendSocket
from zmq.utils.monitor import parse_monitor_message

from omnireduce import auth

__all__ = [
    "HANDSHAKE_FAILURES",
    "HandshakeFailure",
    "close_monitored",
    "curve_client",
    "curve_server",
    "frames_nbytes",
    "monitor_events",
    "new_socket",
    "recv_frames",
    "send_frames",
    "watch",
]

class HandshakeFailure(NamedTuple):
    """Why a connection's handshake failed, as each end tells it."""

    #: The listening end's words (the aggregator's log).
    listener: str
    #: The connecting end's words, with what to check (the worker's error).
    connector: str
    #: Failures in a row before the connecting end counts the connection as refused.
    strikes: int = 1
    #: For the listening end, the peer went away during the handshake (a port probe, a
    #: peer shutting down or giving up): the listener refused nothing, no cause for a warning.
    aborted: bool = False


#: Monitor events of a refused handshake (wrong CURVE key, CURVE at one end only, ...).
HANDSHAKE_FAILURES: dict[int, HandshakeFailure] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: HandshakeFailure("key refused", "it refused this worker's CURVE key"),
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: HandshakeFailure(
        "protocol or security mechanism mismatch",
        "protocol or security mechanism mismatch: is CURVE on at one end only?",
    ),
    # To a worker, a peer that closes during the handshake (an aggregator shutting down, a
    # co-located rank leaving) reports just like one that cannot read the worker's CURVE
    # HELLO (a wrong server key), errno and all; only the wrong key fails again on the
    # retry. To the aggregator, whose own refusals are AUTH or PROTOCOL, it is a peer that
    # went away (a health check's bare TCP connect, a worker that died while connecting,
    # or one that found a mismatch itself and gave up, such as a worker without CURVE).
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: HandshakeFailure(
        "a connection closed during its handshake", "handshake failed: is the aggregator's public key right?",
        strikes=2, aborted=True,
    ),
}
# Events both ends watch: a connection's end, and refused handshakes.
_WATCHED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
# Frames whose len() is their size in bytes (the rest are measured as buffers).
_SIZED = (bytes, zmq.Frame)


def new_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    """A socket of ``kind`` that drops what it has not sent when closed (``LINGER`` 0)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def curve_server(
    sock: zmq.Socket,
    secret_key: str | os.PathLike[str] | None,
    client_keys: str | os.PathLike[str] | None,
) -> ThreadAuthenticator | None:
    """Turns CURVE on for a binding socket, before it binds; None (CURVE off) without ``secret_key``.

    Args:
        sock: the socket; its context gets the authenticator (one per context).
        secret_key: the server's ``.key_secret`` file.
        client_keys: directory of the accepted clients' ``.key`` files; None accepts any key.

    Returns:
        The authenticator admitting clients: stop it when the socket is closed.

    Raises:
        ConfigError: unusable keys, or the authenticator cannot start.
    """
    if secret_key is None:
        return None
    authenticator = auth.start_authenticator(sock.context, client_keys)
    try:
        auth.configure_server(sock, secret_key)
    except BaseException:
        authenticator.stop()
        raise
    return authenticator


def curve_client(
    sock: zmq.Socket, server_key: str | os.PathLike[str] | None, client_key: str | os.PathLike[str] | None
) -> None:
    """Turns CURVE on for a connecting socket, before it connects; nothing without ``server_key``.

    Raises:
        ConfigError: unusable keys.
    """
    if server_key is not None:
        auth.configure_client(sock, server_key, client_key)


def watch(sock: zmq.Socket, events: int = 0) -> zmq.Socket:
    """The monitor of ``sock``: closed connections, refused handshakes, and ``events`` besides.

    Read it with :func:`monitor_events`; close it with :func:`close_monitored`.
    """
    return sock.get_monitor_socket(events | _WATCHED)


def monitor_events(mon: zmq.Socket) -> Iterator[tuple[int, int]]:
    """The events waiting in a monitor socket, as (event, value), without blocking.

    The value is the connection's file descriptor for connection events.
    """
    while True:
        try:
            event = parse_monitor_message(mon.recv_multipart(flags=zmq.NOBLOCK))
        except zmq.Again:
            return
        yield event["event"], event["value"]


def close_monitored(sock: zmq.Socket, mon: zmq.Socket | None) -> None:
    """Stops ``sock``'s monitor and closes both; a socket already closed is left as it is."""
    if mon is not None:
        if not sock.closed:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
        mon.close()
    sock.close()


def frames_nbytes(frames: Iterable[Any]) -> int:
    """Bytes of a message's frames as they go on the wire (ZeroMQ's framing not counted).

    A frame is what ZeroMQ sends or receives: bytes, a ``zmq.Frame``, or any buffer
    (a NumPy array, a memoryview).
    """
    total = 0
    for f in frames:
        total += len(f) if isinstance(f, _SIZED) else memoryview(f).nbytes
    return total


# pyzmq's send_multipart/recv_multipart go through a Python layer per frame (enum flag
# arithmetic, a RCVMORE getsockopt, draft-API group checks): about 20 us more per
# five-frame message than the backend's own send/recv, on every message of every op.
_backend_send = _BackendSocket.send
_backend_recv = _BackendSocket.recv
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)


def send_frames(sock: zmq.Socket, frames: list[Any]) -> None:
    """``sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)``, in fewer Python calls.

    Frames below the socket's ``copy_threshold`` are copied, larger ones lent to ZeroMQ
    (as ``copy=False`` does). ZeroMQ delivers a message's frames all or none, and takes the
    rest of a message once it took its first frame.

    Args:
        sock: the socket.
        frames: the message's frames: bytes, ``zmq.Frame`` or any buffer; at least one.

    Raises:
        zmq.Again: the socket has no room for the message (nothing was sent).
        zmq.ZMQError: as ``send_multipart``.
    """
    last = len(frames) - 1
    for i in range(last):
        _backend_send(sock, frames[i], _NOBLOCK_MORE, False, False)
    _backend_send(sock, frames[last], _NOBLOCK, False, False)


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame] | None:
    """``sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)``, or None when no message is in.

    Returns None rather than raising ``zmq.Again``: a drain ends on an empty socket on
    every pass, and an exception costs more than the receive.

    Raises:
        zmq.ZMQError: as ``recv_multipart``, except ``EAGAIN``.
    """
    try:
        frame = _backend_recv(sock, _NOBLOCK, False, False)
    except zmq.Again:
        return None
    frames = [frame]
    while frame.more:
        # The rest of a message is in once its first frame is.
        frame = _backend_recv(sock, _NOBLOCK, False, False)
        frames.append(frame)
    return frames
