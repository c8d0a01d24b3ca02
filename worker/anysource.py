"""``recv`` from any source for the omnireduce process group's point-to-point messages.

Every message sent adds one to a counter of its (sender, receiver, tag) in the group's
store (:meth:`worker.p2p.PeerLinks.transfer`). A receive from any source waits here until
some sender's count is ahead of the receives this rank has posted for it, then posts one
on that sender's pair link, which takes the sender's next message in order. One daemon
thread per rank serves every waiting receive: each pass reads the counters once (one
store round trip per sender and tag), then, under the links' posting lock, gives each
waiting receive, in call order, a sender that is ahead, the senders of a tag taken in
turn. Receives of different tags do not wait for each other; two of one tag are served
in call order. A receive waits until its deadline (the group's op timeout from the call),
polling with a back-off of 0.5 to 20 ms; once posted, its op has the op timeout too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from omnireduce.errors import OmniReduceError, OpTimeoutError, WorkerClosedError
from worker.loop import fail_future, forward

if TYPE_CHECKING:
    from worker.p2p import PeerLinks

logger = logging.getLogger(__name__)

__all__ = ["AnySource"]

# Seconds between two passes over the senders' counters while no receive could be posted:
# short at first (a message usually is on its way), then at most 50 passes a second.
_FIRST_PAUSE = 0.0005
_LAST_PAUSE = 0.02


class _Receive:
    __slots__ = ("deadline", "peers", "result", "tag", "x")

    def __init__(self, x: object, tag: int, peers: list[int], deadline: float) -> None:
        self.x = x
        self.tag = tag
        self.peers = peers
        self.deadline = deadline
        self.result: Future = Future()


class AnySource:
    """The receives from any source of one rank, served by a daemon thread of their own.

    Args:
        links: the rank's pair links (their counters, posted receives and posting lock).
        timeout: seconds a receive waits for a sender.
    """

    def __init__(self, links: PeerLinks, timeout: float) -> None:
        self._links = links
        # Set anew by PeerLinks.set_timeout; a receive takes the value it was posted under.
        self.timeout = timeout
        self._cond = threading.Condition()
        self._waiting: list[_Receive] = []
        self._closed = False
        # Per tag, the sender to look at first next time: senders are taken in turn, so a
        # rank that sends many messages does not starve the others.
        self._turn: dict[int, int] = {}
        self._thread = threading.Thread(target=self._serve, name=f"omnireduce-p2p-any-r{links.rank}", daemon=True)
        self._thread.start()

    def receive(self, x: object, tag: int, peers: Sequence[int]) -> Future:
        """Queues a receive of ``x``'s length (zeros the message is written into) with ``tag``
        from any of ``peers``; returns a future of ``(source rank, the message)``."""
        request = _Receive(x, tag, list(peers), time.monotonic() + self.timeout)
        with self._cond:
            if self._closed:
                raise WorkerClosedError("the process group is shut down")
            self._waiting.append(request)
            self._cond.notify()
        return request.result

    def close(self) -> None:
        """Fails every receive still waiting for a sender, now."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._cond.notify()
        for request in waiting:
            fail_future(request.result, WorkerClosedError("the process group is shut down"))

    def _serve(self) -> None:
        pause = _FIRST_PAUSE
        while True:
            with self._cond:
                if not self._waiting and not self._closed:
                    pause = _FIRST_PAUSE
                    self._cond.wait()
                if self._closed:
                    return
                waiting = list(self._waiting)
            try:
                posted = self._pass(waiting)
            except BaseException as e:  # noqa: BLE001 - every waiting caller gets it
                logger.exception("recv from any source: reading the senders' counters failed")
                error = e if isinstance(e, OmniReduceError) else OmniReduceError(
                    f"recv from any source: the process group's store failed: {type(e).__name__}: {e}")
                self._finish(waiting, error)
                continue
            self._expire()
            pause = _FIRST_PAUSE if posted else min(2 * pause, _LAST_PAUSE)
            with self._cond:
                if self._waiting and not self._closed and not posted:
                    self._cond.wait(pause)

    def _pass(self, waiting: list[_Receive]) -> bool:
        """Posts the receives that have a sender ahead now; True if any was."""
        sent = self._links.sent_counts({(src, r.tag) for r in waiting for src in r.peers})
        done = []
        with self._links.posting():
            for r in waiting:
                if self._closed:
                    # Closed during this pass: its receives failed already, and one posted now
                    # would take a sender's message that nobody receives.
                    break
                start = self._turn.get(r.tag, 0)
                order = sorted(r.peers, key=lambda src, start=start: (src < start, src))
                for src in order:
                    if sent[src, r.tag] > self._links.posted(src, r.tag):
                        self._turn[r.tag] = src + 1
                        done.append((r, src, self._start(r, src)))
                        break
        self._remove([r for r, _, _ in done])
        for r, src, inner in done:
            if inner is not None:
                forward(inner, r.result, lambda out, src=src: (src, out))
        return bool(done)

    def _start(self, r: _Receive, src: int) -> Future | None:
        # Called with the posting lock held; a receive that cannot be posted fails alone.
        try:
            return self._links.post(r.x, src, r.tag)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            fail_future(r.result, e)
            return None

    def _expire(self) -> None:
        now = time.monotonic()
        with self._cond:
            late = [r for r in self._waiting if r.deadline <= now]
            self._waiting = [r for r in self._waiting if r.deadline > now]
        for r in late:
            fail_future(r.result, OpTimeoutError(
                f"recv from any source (tag {r.tag}): no rank sent a message within {self.timeout:g} s",
                job=self._links.job, ranks=r.peers))

    def _finish(self, waiting: list[_Receive], error: BaseException) -> None:
        self._remove(waiting)
        for r in waiting:
            fail_future(r.result, error)

    def _remove(self, requests: list[_Receive]) -> None:
        if requests:
            with self._cond:
                self._waiting = [r for r in self._waiting if r not in requests]
