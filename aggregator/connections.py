"""Which connection each routing id of the aggregator's ROUTER arrived on.

The socket's monitor reports a closed connection by its file descriptor only, so the
aggregator remembers, for every routing id, the connection its first message came
on: the descriptor (``SRCFD``) and how many times that descriptor had been accepted
by then. When the monitor reports the end of a connection, its ids are *departing*:
their last messages (a BYE) are still read, then they are declared gone.

An id whose first message is read after its connection's end (and before a newer
connection was accepted on the descriptor) is departing at once: a worker that died
right after connecting fails its job's ops then, not at their timeout.

A closed connection's messages can still be read after the monitor told of its end,
and by then a new connection may hold its descriptor number. Two rules keep such a
late message from being taken for the new connection's, which once had a live rank
declared lost:

* an id ZeroMQ generated and that was declared gone is never tracked again: its
  later messages are dropped (ZeroMQ gives every connection a new id);
* where an id's first message claims a connection that already carries another id,
  the one ZeroMQ issued first belongs to the earlier, closed connection on that
  descriptor (a ROUTER names a connection that brings no id of its own with a zero
  byte and a 32-bit counter, big-endian, that counts up: libzmq's
  ``router_t::identify_peer``). For ids a peer chose itself (``ZMQ_ROUTING_ID``; our
  workers never set one) the order cannot be told: both are kept, and a dead one is
  found when a send to it fails or when the connection ends. (And a late HELLO never
  takes a rank from a connection issued after its own: :class:`aggregator.jobs.Jobs`.)

All of this rests on the order in which ZeroMQ reports events and delivers messages
with one I/O thread: a connection's ACCEPTED is emitted before its handshake can run,
so before its first message, and its DISCONNECTED before its descriptor is closed.
The aggregator refuses a context with more I/O threads.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections import OrderedDict

__all__ = ["Connections", "issued_before", "is_generated", "seed_generated_ids"]

logger = logging.getLogger(__name__)

#: A connection: (descriptor, how many times it had been accepted).
Conn = tuple[int, int]

# Generated ids of connections declared gone, remembered so that their late messages
# are dropped (one per connection; past this many, the oldest are forgotten, and the
# issue order still tells a late id from the live holder of its descriptor).
_GONE_KEPT = 16384


def seed_generated_ids() -> None:
    """Starts the ROUTER's id counter at a random value: call before making the socket.

    libzmq starts the counter at the C library's ``rand()``, never seeded, so at the
    same value in every process; and it does not stop a peer from choosing an id of
    the generated form. A ROUTER whose counter reaches an id a peer took aborts the
    process (a libzmq assertion), so a predictable start lets any client that can
    connect kill the aggregator. Seeding ``rand()`` from the OS before each ROUTER is
    made makes its start unpredictable (CURVE with an allow-list of client keys keeps
    strangers out altogether).
    """
    try:
        ctypes.CDLL(None).srand(ctypes.c_uint(int.from_bytes(os.urandom(4), "big")))
    except (OSError, AttributeError) as e:  # no C library to load by that name
        logger.warning("cannot seed the routing id counter (%s): it starts where libzmq's rand() does", e)


def is_generated(peer: bytes) -> bool:
    """Whether ``peer`` has the form of a routing id the ROUTER generated (a zero byte
    and a 32-bit counter); ZeroMQ reserves ids starting with a zero byte for these."""
    return len(peer) == 5 and peer[0] == 0


def issued_before(a: bytes, b: bytes) -> bool:
    """Whether the ROUTER generated routing id ``a`` before ``b`` (modulo 2**32);
    False where either is an id of a peer's own choice."""
    if not (is_generated(a) and is_generated(b)):
        return False
    return 0 < (int.from_bytes(b[1:], "big") - int.from_bytes(a[1:], "big")) % (1 << 32) < (1 << 31)


class Connections:
    """The aggregator's book of routing ids and the connections they came on.

    Used by the serving thread only. The caller reads the monitor's events into
    :meth:`accepted` and :meth:`disconnected`, and, before :meth:`track`, every event
    emitted so far (the acceptance of a connection comes before its first message).
    """

    def __init__(self) -> None:
        self._accepts: dict[int, int] = {}
        # Descriptors whose last accepted connection has ended.
        self._ended: set[int] = set()
        # A connection carries one id; more where a late id could not be told apart.
        self._ids: dict[Conn, set[bytes]] = {}
        #: Tracked ids: their connection, or None for one without a descriptor (inproc).
        self.conn_of: dict[bytes, Conn | None] = {}
        #: Ids whose connection ended, their last messages still to be read.
        self.departing: set[bytes] = set()
        self._gone: OrderedDict[bytes, None] = OrderedDict()

    def is_gone(self, peer: bytes) -> bool:
        """Whether ``peer`` was declared gone and cannot come back: drop its messages."""
        return peer in self._gone

    def accepted(self, fd: int) -> None:
        self._accepts[fd] = self._accepts.get(fd, 0) + 1
        self._ended.discard(fd)

    def disconnected(self, fd: int) -> list[bytes]:
        """The ids of the connection on ``fd`` that ended, now departing; the descriptor is
        marked ended until its next connection is accepted."""
        self._ended.add(fd)
        ids = self._ids.pop((fd, self._accepts.get(fd, 0)), set())
        for peer in ids:
            self.conn_of.pop(peer, None)
        self.departing |= ids
        return sorted(ids)

    def track(self, peer: bytes, fd: int | None) -> tuple[bool, list[bytes]]:
        """Records the connection of an untracked id's message, which came on ``fd``.

        Args:
            peer: the routing id, neither tracked, departing nor gone.
            fd: the message's ``SRCFD``; None where the connection has no descriptor.

        Returns:
            Whether to handle the message (False: a late one of a closed connection,
            now gone), and the ids found to belong to closed connections, which the
            caller declares gone. ``peer`` itself is in :attr:`departing` afterwards
            where its connection has ended already.
        """
        if fd is None:
            self.conn_of[peer] = None
            return True, []
        if fd in self._ended:
            # The descriptor's last connection ended before this, its first message, was
            # read (a newer one would have been accepted first): it is this id's.
            self.departing.add(peer)
            return True, []
        conn = (fd, self._accepts.get(fd, 0))
        ids = self._ids.setdefault(conn, set())
        if any(issued_before(peer, q) for q in ids):
            self._mark_gone(peer)
            return False, []
        stale = sorted(q for q in ids if issued_before(q, peer))
        ids.add(peer)
        self.conn_of[peer] = conn
        return True, stale

    def forget(self, peer: bytes) -> None:
        """Declares ``peer`` gone: it is tracked no more, and a generated id never again."""
        conn = self.conn_of.pop(peer, None)
        if conn is not None:
            ids = self._ids.get(conn)
            if ids is not None:
                ids.discard(peer)
                if not ids:
                    del self._ids[conn]
        self.departing.discard(peer)
        self._mark_gone(peer)

    def _mark_gone(self, peer: bytes) -> None:
        # An id of the peer's own may come back on a new connection: never dropped.
        if not is_generated(peer):
            return
        self._gone[peer] = None
        self._gone.move_to_end(peer)
        if len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)
