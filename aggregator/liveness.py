"""Heartbeats of the aggregator's connections: which to send one to, which to drop.

The aggregator keeps ZeroMQ's heartbeats off (see :class:`omnireduce.protocol.Heartbeat`)
and sends its own: a connection it has heard nothing from for ``interval`` seconds gets a
HEARTBEAT (at most one per interval), which the worker answers, and one it has heard
nothing from for ``timeout`` seconds is dropped. Its workers do the same the other way.

The times are those at which the serving loop read a message, not those at which the
bytes arrived: when the loop itself did not run for a while (the process was paused,
or starved of CPU), what the workers sent meanwhile is still unread, so their silence
is not theirs. After such a gap every connection gets its full timeout again, counted
from the loop's return.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from omnireduce.config import heartbeat_stall

__all__ = ["Liveness"]

logger = logging.getLogger(__name__)

# Connections dropped for silence that are remembered, to tell them so when they speak again.
_DROPPED_KEPT = 4096


class Liveness:
    """When each connection was last heard from.

    Used by the serving thread only. The loop records every message read in
    :attr:`heard`, and asks :meth:`due` what to do at the end of every step.

    Args:
        interval: seconds without hearing from a connection after which it gets a heartbeat.
        timeout: seconds without hearing from a connection after which it is dropped.
    """

    def __init__(self, interval: float, timeout: float) -> None:
        self.interval = interval
        self.timeout = timeout
        #: Routing id -> when its last message was read.
        self.heard: dict[bytes, float] = {}
        # Routing id -> when it was last sent a heartbeat (only ids that fell silent).
        self._pinged: dict[bytes, float] = {}
        self._stall = heartbeat_stall(interval)
        self._next_scan = 0.0
        self._looked: float | None = None
        # Dropped ids -> when they were last told so.
        self._dropped: OrderedDict[bytes, float] = OrderedDict()

    def due(self, now: float) -> tuple[list[bytes], list[bytes]]:
        """The connections silent past the timeout (to drop) and those silent for an
        interval and not sent a heartbeat within one (to send one to).

        Called at the end of every step of the loop: one that comes long after the
        previous one means the loop itself stalled (in its poll or in its work), and every
        connection's silence then starts again now. The connections themselves are looked
        at a few times per interval.
        """
        last, self._looked = self._looked, now
        if last is not None and now - last > self._stall and self.heard:
            logger.info("the serving loop did not run for %.1f s: heartbeat timeouts start again", now - last)
            self.heard = dict.fromkeys(self.heard, now)
        if now < self._next_scan:
            return [], []
        self._next_scan = now + min(self.interval, self.timeout) / 4
        silent = [peer for peer, t in self.heard.items() if now - t > self.timeout]
        pinged, interval = self._pinged, self.interval
        idle = [peer for peer, t in self.heard.items()
                if interval < now - t <= self.timeout and now - pinged.get(peer, t) > interval]
        for peer in idle:
            pinged[peer] = now
        return silent, idle

    def forget(self, peer: bytes) -> None:
        """A connection gone: no heartbeats for it any more."""
        self.heard.pop(peer, None)
        self._pinged.pop(peer, None)

    def dropped(self, peer: bytes, now: float) -> None:
        """``peer`` was dropped for silence (and told so)."""
        self.forget(peer)
        self._dropped[peer] = now
        self._dropped.move_to_end(peer)
        if len(self._dropped) > _DROPPED_KEPT:
            self._dropped.popitem(last=False)

    def tell_dropped(self, peer: bytes, now: float) -> bool:
        """Whether to tell ``peer``, whose message was not taken, that it was dropped: the
        first telling may not have reached it (a full queue). At most once per interval."""
        last = self._dropped.get(peer)
        if last is None or now - last < self.interval:
            return False
        self._dropped[peer] = now
        return True
