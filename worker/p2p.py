"""Point-to-point messages (``send``/``recv``) of the omnireduce process group, through the aggregator.

A message from rank ``s`` to rank ``d`` with tag ``t`` is an op of a job of two
workers of its own, ``<group job>.p2p.<s>-<d>.<t>``: the sender sums its tensor's
bytes, the receiver zeros of the same length (summed in place), so the sum is the
sender's bytes. The receiver's zero blocks are not sent at all, and a message of
one row of blocks (an eager op: up to ``message_blocks x streams`` blocks of
``block_size`` bytes, 32 MiB by default) is sent by the aggregator to the receiver
only, as a block that one worker alone sent is never sent back to it: the bytes go
up once and down once, as through a relay. A larger message is also sent back to
its sender.

Until the receiver's ``recv`` arrives, a message is held by the aggregator (all of
it, for an eager one): it counts against the aggregator's byte limits
(``max_job_bytes`` per job, ``max_bytes`` in all, shared with every other job), so
many large ``isend`` posted long before their ``irecv`` can fail with
``LimitError``, and the aggregator's op timeout (its ``--timeout``, not the group's)
bounds how long a message may wait for its ``recv``.

Messages of one (sender, receiver, tag) pair up in call order, as torch's backends
match them; each direction and tag has a job (and a connection) of its own, so an
``isend`` and an ``irecv`` between the same two ranks run at once, and messages of
different tags do not wait for each other. A send completes once the receiver's
``recv`` has taken it (gloo's completes once the bytes are on their way): a rank
that sends to a peer which first sends back (both ``send`` before either
``recv``) waits until the op timeout; ``isend`` those, or use
``batch_isend_irecv``. ``recv`` from any source is not supported (the aggregator
matches messages by their job, which names the sender).

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
from concurrent.futures import Future

from omnireduce.errors import ConfigError, WorkerClosedError
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
    """

    def __init__(self, worker: Allreducer) -> None:
        first = worker.shards[0] if hasattr(worker, "shards") else worker
        if not isinstance(first, Worker):
            raise ConfigError(f"send and recv need a worker of an aggregator, not {type(first).__name__}")
        self._address = first.address
        self._context = first.context
        self._settings = first.settings
        self._lock = threading.Lock()
        self._loop: CommLoop | None = None
        self._links: dict[tuple[int, int, int], Worker] = {}
        self._closed = False

    def transfer(self, x: object, src: int, dst: int, tag: int) -> Future:
        """Starts this rank's side of a message from ``src`` to ``dst``: ``x`` is the sender's
        bytes, or the receiver's zeros of the same length (which the sum is written into);
        returns the op's future (the sender's bytes, on both sides)."""
        return self._link(src, dst, tag).allreduce_async(x, inplace=self._settings.rank == dst)

    def refuse(self, error: BaseException, src: int, dst: int, tag: int) -> None:
        """Numbers a message this rank refuses and fails it on the other side too
        (:meth:`worker.client.Worker.refuse`)."""
        self._link(src, dst, tag).refuse(error)

    def _link(self, src: int, dst: int, tag: int) -> Worker:
        key = (src, dst, tag)
        with self._lock:
            if self._closed:
                raise WorkerClosedError("the process group is shut down")
            link = self._links.get(key)
            if link is None:
                if self._loop is None:
                    # One communication thread for every pair of this rank.
                    self._loop = CommLoop(self._context, name=f"omnireduce-p2p-r{self._settings.rank}")
                settings = dataclasses.replace(
                    self._settings, job=f"{self._settings.job}.p2p.{src}-{dst}.{tag}",
                    rank=0 if self._settings.rank == src else 1, world_size=2, mode="sparse",
                )
                link = Worker(self._address, context=self._context, settings=settings, loop=self._loop)
                self._links[key] = link
                logger.debug("p2p link %d -> %d (tag %d) opened as %s", src, dst, tag, settings.job)
            return link

    def close(self) -> None:
        """Closes every pair worker; their pending messages fail."""
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
            loop, self._loop = self._loop, None
        for link in links:
            link.close()
        if loop is not None:
            loop.close()
