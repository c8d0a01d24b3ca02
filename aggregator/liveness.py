"""Heartbeats of the aggregator's connections: which to send one to, which to drop.

The aggregator keeps ZeroMQ's heartbeats off (see :class:`omnireduce.protocol.Heartbeat`)
and sends its own: a connection it has sent nothing to for ``interval`` seconds gets a
HEARTBEAT, and one it has heard nothing from for ``timeout`` seconds is dropped. Its
workers do the same the other way.

The times are those at which the serving loop read or sent a message, not those at
which the bytes arrived: when the loop itself did not run for a while (the process
was paused, or starved of CPU), what the workers sent meanwhile is still unread, so
their silence is not theirs. After such a gap every connection gets its full timeout
again, counted from the loop's return.
"""

from __future__ import annotations

import logging

__all__ = ["Liveness"]

logger = logging.getLogger(__name__)

# A loop that polls at least every 50 ms has stalled when it comes back after this long,
# even for heartbeats more frequent than every 250 ms.
_MIN_STALL_S = 0.5


class Liveness:
    """When each connection was last heard from and sent to.

    Used by the serving thread only. The loop records every message read in
    :attr:`heard` and every message sent in :attr:`told`, calls :meth:`resume` at
    the start of each step and :meth:`pause` at its end, and asks :meth:`due` what
    to do.

    Args:
        interval: seconds without sending to a connection after which it gets a heartbeat.
        timeout: seconds without hearing from a connection after which it is dropped.
    """

    def __init__(self, interval: float, timeout: float) -> None:
        self.interval = interval
        self.timeout = timeout
        #: Routing id -> when its last message was read.
        self.heard: dict[bytes, float] = {}
        #: Routing id -> when the last message to it was sent.
        self.told: dict[bytes, float] = {}
        self._stall = max(2 * interval, _MIN_STALL_S)
        self._next_scan = 0.0
        self._paused_at: float | None = None

    def resume(self, now: float) -> None:
        """The loop starts a step: after a stall, every connection's silence starts again now."""
        if self._paused_at is not None and now - self._paused_at > self._stall and self.heard:
            logger.info("the serving loop did not run for %.1f s: heartbeat timeouts start again",
                        now - self._paused_at)
            self.heard = dict.fromkeys(self.heard, now)
        self._paused_at = None

    def pause(self, now: float) -> None:
        """The loop ends a step, and waits for input."""
        self._paused_at = now

    def due(self, now: float) -> tuple[list[bytes], list[bytes]]:
        """The connections silent past the timeout (to drop) and those sent nothing for an
        interval (to send a heartbeat to); looked at a few times per interval."""
        if now < self._next_scan:
            return [], []
        self._next_scan = now + min(self.interval, self.timeout) / 4
        silent = [peer for peer, t in self.heard.items() if now - t > self.timeout]
        told = self.told
        idle = []
        for peer, t in self.heard.items():
            last = told.get(peer)
            if last is None:
                told[peer] = t  # first heard: its first heartbeat is due an interval on
            elif now - last > self.interval and now - t <= self.timeout:
                idle.append(peer)
        return silent, idle

    def forget(self, peer: bytes) -> None:
        """A connection gone: no heartbeats for it any more."""
        self.heard.pop(peer, None)
        self.told.pop(peer, None)
