"""Point-to-point messages (``send``/``recv``) of the omnireduce process group, through the aggregator.

A message from rank ``s`` to rank ``d`` with tag ``t`` is an op of a job of two
workers of its own, ``<group job>.p2p.<s>-<d>.<t>``: the sender sums its tensor's
bytes, the receiver zeros of the same length (summed in place), so the sum is the
sender's bytes. The process group sends the bytes as the widest integer type their
length allows (int64 for a multiple of 8 bytes, else int32, int16, uint8). The
receiver's zero blocks are not sent at all, and a message of one row of blocks (an
eager op: up to ``message_blocks x streams`` blocks of ``block_size`` elements, 256 MiB
of int64 or 32 MiB of uint8 by default) is sent by the aggregator to the receiver
only, as a block that one worker alone sent is never sent back to it: the bytes go
up once and down once, as through a relay. A larger message is also sent back to
its sender.

Until the receiver's ``recv`` arrives, a message is held by the aggregator (all of
it, for an eager one): it counts against the aggregator's byte limits
(``max_job_bytes`` per job, ``max_bytes`` in all, shared with every other job), so
many large ``isend`` posted long before their ``irecv`` can fail with
``LimitError``, and it waits at most the shorter of the sender's op timeout (the
group's: the sender's worker then aborts the op at the aggregator, so the ``send``
fails and the next ``recv`` pairs with the next ``send``) and the aggregator's
(its ``--timeout``).

Messages of one (sender, receiver, tag) pair up in call order, as torch's backends
match them; each direction and tag has a job (and a connection) of its own, so an
``isend`` and an ``irecv`` between the same two ranks run at once, and messages of
different tags do not wait for each other. A send completes once the receiver's
``recv`` has taken it (gloo's completes once the bytes are on their way): a rank
that sends to a peer which first sends back (both ``send`` before either
``recv``) waits until the op timeout; ``isend`` those, or use
``batch_isend_irecv``.

``recv`` from any source finds its sender through the group's store: every message
sent adds one to a counter of its (sender, receiver, tag) there first (one store
round trip per send, about 0.1 ms on loopback), and the receiver takes its message
from a sender whose count is ahead of the receives it has posted for it
(:mod:`worker.anysource`). A receive posted for a given sender before one from any
source takes that sender's next message first, as gloo's does. An argument error of
a receive from any source is raised before any sender is chosen, so it fails on the
receiver only (the sender's message then waits for the next receive, or its timeout).

Every rank reaches the pair jobs through the first aggregator of the group's worker
(its first shard; a co-located group's is rank 0's), with the group's settings
(token, generation, timeout, keys). Each (sender, receiver, tag) in use is a job
there, and a connection on both sides, until the group is destroyed: the
aggregator's job limit (``max_jobs``, shared with every other job) and the
processes' file descriptors bound them, so tags are for a few kinds of message,
not one per step.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from omnireduce.errors import ConfigError, OmniReduceError, WorkerClosedError
from worker.anysource import AnySource
from worker.api import Allreducer
from worker.client import Worker
from worker.loop import CommLoop

logger = logging.getLogger(__name__)

__all__ = ["PeerLinks"]


class PeerLinks:
    """The pair workers of one rank of a process group: one per (sender, receiver, tag)
    this rank has sent or received on, made on first use.

    Args:
        worker: the group's worker (its first aggregator and settings are used).
        store: the group's store (``torch.distributed.Store``), where the messages sent are
            counted for ``recv`` from any source; None: neither counted nor such receives.
    """

    def __init__(self, worker: Allreducer, store: Any = None) -> None:
        first = worker.shards[0] if hasattr(worker, "shards") else worker
        if not isinstance(first, Worker):
            raise ConfigError(f"send and recv need a worker of an aggregator, not {type(first).__name__}")
        self._address = first.address
        self._context = first.context
        self._settings = first.settings
        self._lock = threading.Lock()
        self._loop: CommLoop | None = None
        self._links: dict[object, Worker] = {}
        self._closed = False
        self._store = store
        # Receives posted per (src, tag) (this rank is their dst), counted with the posting
        # itself (under the lock), so that a recv from any source compares the senders' counts.
        self._posted: dict[tuple[int, int], int] = {}
        self._post_lock = threading.RLock()
        self._any: AnySource | None = None

    @property
    def rank(self) -> int:
        """This rank (in the group)."""
        return self._settings.rank

    @property
    def job(self) -> str:
        """The group's job id."""
        return self._settings.job

    def transfer(self, x: object, src: int, dst: int, tag: int) -> Future:
        """Starts this rank's side of a message from ``src`` to ``dst``: ``x`` is the sender's
        bytes, or the receiver's zeros of the same length (which the sum is written into);
        returns the op's future (the sender's bytes, on both sides)."""
        if self._settings.rank == dst:
            with self._post_lock:
                return self.post(x, src, tag)
        # Counted before it is sent: a receive from any source posted for it early waits for
        # it, where a message sent but never counted would never be taken.
        self._announce(src, dst, tag)
        return self._link(src, dst, tag).allreduce_async(x)

    def refuse(self, error: BaseException, src: int, dst: int, tag: int) -> None:
        """Numbers a message this rank refuses and fails it on the other side too
        (:meth:`worker.client.Worker.refuse`)."""
        key = (src, dst, tag)
        if self._settings.rank == dst:
            with self._post_lock:
                self._link(*key).refuse(error)
                self._count_posted(src, tag)
            return
        self._announce(*key)
        self._link(*key).refuse(error)

    def posting(self) -> threading.RLock:
        """The lock under which receives are posted and counted: held around the messages of
        one ``recv`` of several tensors, so that no receive from any source comes between."""
        return self._post_lock

    def receive_any(self, x: object, tag: int, peers: Sequence[int]) -> Future:
        """Starts a receive of ``x``'s length with ``tag`` from whichever of ``peers`` has a
        message this rank has not received yet (:mod:`worker.anysource`).

        Args:
            x: zeros of the message's length, which the message is written into.
            tag: the message's tag.
            peers: the ranks it may come from.

        Returns:
            A future of ``(source rank, the message)``; it fails with
            :class:`~omnireduce.errors.OpTimeoutError` when no message came within the
            group's op timeout.
        """
        if self._store is None:
            raise ConfigError("recv from any source needs the process group's store")
        with self._lock:
            if self._closed:
                raise WorkerClosedError("the process group is shut down")
            if self._any is None:
                self._any = AnySource(self, self._settings.timeout)
            any_source = self._any
        return any_source.receive(x, tag, peers)

    def sent_counts(self, keys: set[tuple[int, int]]) -> dict[tuple[int, int], int]:
        """The messages each (sender, tag) of ``keys`` has sent to this rank, from the store."""
        return {(src, tag): self._store.add(self._count_key(src, self._settings.rank, tag), 0)
                for src, tag in keys}

    def posted(self, src: int, tag: int) -> int:
        """The receives this rank has posted for ``src``'s messages of ``tag``."""
        return self._posted.get((src, tag), 0)

    def post(self, x: object, src: int, tag: int) -> Future:
        """Posts a receive from ``src`` and counts it (with :meth:`posting` held)."""
        try:
            future = self._link(src, self._settings.rank, tag).allreduce_async(x, inplace=True)
        except WorkerClosedError:
            raise  # nothing was numbered
        except Exception:
            # Refused (its arguments, the frame limit): the op was numbered (and failed on the
            # sender's side), so it counts.
            self._count_posted(src, tag)
            raise
        self._count_posted(src, tag)
        return future

    def _count_posted(self, src: int, tag: int) -> None:
        self._posted[src, tag] = self._posted.get((src, tag), 0) + 1

    def _count_key(self, src: int, dst: int, tag: int) -> str:
        # The job and its generation in the key: a store that outlives a group (a restarted
        # torchelastic job's) does not carry counts over to the next.
        return f"omnireduce/p2p/{self._settings.job}/{self._settings.generation}/{src}-{dst}.{tag}"

    def _announce(self, src: int, dst: int, tag: int) -> None:
        if self._store is None:
            return
        try:
            self._store.add(self._count_key(src, dst, tag), 1)
        except Exception as e:
            raise OmniReduceError(f"counting a message to rank {dst} in the process group's store failed "
                                  f"(nothing was sent): {type(e).__name__}: {e}") from e

    def _link(self, src: int, dst: int, tag: int) -> Worker:
        return self._worker((src, dst, tag), f"p2p.{src}-{dst}.{tag}", rank=0 if self._settings.rank == src else 1,
                            world_size=2)

    def group_link(self, name: str) -> Worker:
        """A worker of the whole group (this rank, the group's size) in a job of its own,
        ``<group job>.<name>``, made on first use: for ops numbered apart from the group's
        collectives, such as all_to_all's chunks, which go out only once its split table is in.
        """
        return self._worker(name, name, rank=self._settings.rank, world_size=self._settings.world_size)

    def _worker(self, key: object, name: str, rank: int, world_size: int) -> Worker:
        with self._lock:
            if self._closed:
                raise WorkerClosedError("the process group is shut down")
            link = self._links.get(key)
            if link is None:
                if self._loop is None:
                    # One communication thread for every pair of this rank.
                    self._loop = CommLoop(self._context, name=f"omnireduce-p2p-r{self._settings.rank}")
                settings = dataclasses.replace(self._settings, job=f"{self._settings.job}.{name}", rank=rank,
                                               world_size=world_size, mode="sparse")
                link = Worker(self._address, context=self._context, settings=settings, loop=self._loop)
                self._links[key] = link
                logger.debug("link %s opened as %s", key, settings.job)
            return link

    def set_timeout(self, seconds: float) -> None:
        """Sets the op timeout of every pair worker, those made later and receives from any
        source (:meth:`worker.client.Worker.set_timeout`)."""
        with self._lock:
            self._settings = self._settings.with_timeout(seconds)
            links = list(self._links.values())
            if self._any is not None:
                self._any.timeout = self._settings.timeout
        for link in links:
            link.set_timeout(self._settings.timeout)

    def close(self) -> None:
        """Closes every pair worker; their pending messages fail."""
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
            loop, self._loop = self._loop, None
            any_source, self._any = self._any, None
        if any_source is not None:
            any_source.close()
        for link in links:
            link.close()
        if loop is not None:
            loop.close()
