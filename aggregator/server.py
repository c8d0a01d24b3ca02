"""The aggregator daemon as a library object: a ROUTER socket around :class:`Engine`."""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import zmq

from aggregator.engine import Engine

logger = logging.getLogger(__name__)

__all__ = ["Aggregator"]

_POLL_MS = 50
# Messages handled before the loop looks at timeouts and the stop flag again.
_BATCH = 256
# Far above what the protocol keeps in flight (streams x ops per worker), so a
# full queue means a peer that stopped reading, which ROUTER_MANDATORY reports.
_HWM = 100_000


def _bindable(listen: str) -> str:
    """ZeroMQ spells "any free port" as ``*``; accept the conventional port 0 too."""
    return re.sub(r"^(tcp://.+):0$", r"\1:*", listen)


class Aggregator:
    """Sums the blocks of every job's workers and tells them which block comes next.

    Args:
        listen: ZeroMQ endpoint to bind, e.g. ``tcp://0.0.0.0:5555``; port 0 picks a free port.
        timeout: seconds after an op's first message at which it is failed on all its
            workers; None waits forever.
        context: ZeroMQ context to use; a private one by default.

    Example::

        agg = Aggregator(listen="tcp://127.0.0.1:0")
        agg.start()
        print(agg.address)
        agg.close()
    """

    def __init__(
        self, listen: str = "tcp://127.0.0.1:0", timeout: float | None = None, context: zmq.Context | None = None
    ) -> None:
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self.engine = Engine(timeout=timeout)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, _HWM)
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        try:
            self._sock.bind(_bindable(listen))
        except zmq.ZMQError as e:
            self._sock.close()
            if self._own_context:
                self._ctx.term()
            raise OSError(f"cannot listen on {listen!r}: {e}") from e
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._serving = False
        self.send_errors = 0
        logger.info("omnireduce aggregator listening on %s", self.address)

    def start(self) -> Aggregator:
        """Serves in a background thread; returns self."""
        if self._thread is not None:
            raise RuntimeError("aggregator already started")
        self._thread = threading.Thread(target=self._serve, name="omnireduce-aggregator", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serves in the calling thread until :meth:`close` is called from another thread."""
        self._serve()

    def close(self) -> None:
        """Stops serving and releases the socket; in-flight ops are abandoned."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        elif not self._serving:
            self._sock.close()
        # With serve_forever in another thread, that thread closes the socket and
        # term() waits for it.
        if self._own_context:
            self._ctx.term()

    def __enter__(self) -> Aggregator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, peer: bytes, frames: list[Any]) -> None:
        try:
            self._sock.send_multipart([peer, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            # A vanished peer (EHOSTUNREACH) or one that stopped reading (EAGAIN):
            # the op will fail on its timeout; never stall the other jobs for it.
            self.send_errors += 1
            logger.warning("cannot send to peer %s: %s", peer.hex(), e)

    def _serve(self) -> None:
        self._serving = True
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(_POLL_MS):
                    for _ in range(_BATCH):
                        try:
                            frames = self._sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        peer = frames[0].bytes
                        for dest, out in self.engine.handle(peer, frames[1:]):
                            self._send(dest, out)
                for dest, out in self.engine.expire():
                    self._send(dest, out)
        except Exception:
            logger.exception("aggregator loop died")
            raise
        finally:
            self._sock.close()
