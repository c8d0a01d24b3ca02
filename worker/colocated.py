"""Co-located aggregators: every rank's process serves one aggregator shard.

OmniReduce deploys its aggregators either on machines of their own or on the
workers' machines. Co-located, the process of rank ``k`` serves shard ``k``
and every tensor is split over the ``world_size`` shards as by
:class:`worker.sharded.ShardedWorker`. A rank reaches its own shard over
``inproc://`` (the blocks are handed over in memory, with no copy through the
kernel) and the other ranks' shards over TCP, so each chunk crosses the network
once each way: the bytes of a reduce-scatter plus an all-gather, which is what a
ring allreduce moves, instead of every byte of every rank through one
aggregator's link. No aggregator process has to be run or addressed.

The ranks learn each other's shard address through ``exchange``: a function
that takes this rank's address and returns every rank's, in rank order (an
all-gather). :func:`torch_exchange` makes one from a torch process group.

Example::

    import torch.distributed as dist
    from worker.colocated import ColocatedWorker, torch_exchange

    dist.init_process_group("gloo")
    with ColocatedWorker(torch_exchange(), listen="tcp://198.18.0.11:0") as w:
        total = w.allreduce(grad)
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq

from aggregator.limits import Limits
from aggregator.server import Aggregator
from omnireduce import config
from omnireduce.errors import ConfigError
from worker.sharded import ShardedWorker

logger = logging.getLogger(__name__)

__all__ = ["ColocatedWorker", "Exchange", "torch_exchange"]

#: Shares this rank's shard address; returns every rank's, in rank order.
Exchange = Callable[[str], Sequence[str]]

# How long close() lets the other ranks finish with this rank's shard before closing it.
_DEFAULT_CLOSE_TIMEOUT_S = 10.0
_POLL_S = 0.01
_inproc_ids = itertools.count()


def torch_exchange(group: Any = None) -> Exchange:
    """An :data:`Exchange` over a torch process group (``all_gather_object``).

    The addresses come back in the group's rank order: the co-located workers' ranks
    must be the ranks in ``group`` (the global ranks for the default group).

    Args:
        group: the process group; the default group if None.
    """
    import torch.distributed as dist

    def exchange(address: str) -> list[str]:
        addresses: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(addresses, address, group=group)
        return addresses

    return exchange


class ColocatedWorker(ShardedWorker):
    """A worker whose process also serves one aggregator shard of the job.

    Args:
        exchange: shares this rank's shard address with the other ranks and returns
            every rank's address in rank order; called once, by every rank.
        rank: this worker's rank; default ``$RANK``.
        world_size: the number of workers; default ``$WORLD_SIZE``.
        listen: where this rank's shard listens for the other ranks: an address they
            can reach this host by (port 0 picks a free port). The default serves
            ranks on this host only.
        aggregator_options: keyword arguments of this rank's
            :class:`aggregator.server.Aggregator` (``timeout``, ``limits``, CURVE keys,
            ``metrics_port``, ...).
        close_timeout: seconds :meth:`close` waits for the other ranks to leave this
            rank's shard before closing it.
        **worker_options: :class:`worker.client.Worker`'s options (``job``,
            ``block_size``, ``message_blocks``, ``streams``, ``timeout``, ``mode``, ...)
            and :class:`worker.sharded.ShardedWorker`'s ``shard_bytes``.

    Raises:
        ConfigError: bad options, or ``exchange`` returned something other than one
            address per rank with this rank's own at its place.
    """

    def __init__(
        self,
        exchange: Exchange,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        listen: str = "tcp://127.0.0.1:0",
        aggregator_options: Mapping[str, Any] | None = None,
        close_timeout: float = _DEFAULT_CLOSE_TIMEOUT_S,
        **worker_options: Any,
    ) -> None:
        rank = config.resolve(rank, config.RANK, None, int)
        world_size = config.resolve(world_size, config.WORLD_SIZE, None, int)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not in a world of size {world_size}")
        if "context" in worker_options or "address" in worker_options:
            raise ConfigError("a co-located worker makes its own context and aggregator addresses")
        if close_timeout < 0:
            raise ConfigError(f"close_timeout must be non-negative, got {close_timeout}")
        self.close_timeout = close_timeout
        aggregator_options = _same_message_limit(dict(aggregator_options or {}), worker_options)
        self._close_lock = threading.Lock()
        self._ended = False
        # The aggregator and this rank's workers share one context: inproc needs it.
        self._shared_ctx = zmq.Context()
        inproc = f"inproc://omnireduce-shard-{os.getpid()}-{next(_inproc_ids)}"
        try:
            self.aggregator = Aggregator(listen=[listen, inproc], context=self._shared_ctx, **aggregator_options)
        except BaseException:
            self._shared_ctx.term()
            raise
        try:
            public = self.aggregator.address
            addresses = list(exchange(public))
            if len(addresses) != world_size or not all(isinstance(a, str) for a in addresses):
                raise ConfigError(f"exchange returned {addresses!r}: expected {world_size} addresses")
            if addresses[rank] != public:
                raise ConfigError(f"exchange put {addresses[rank]!r} at rank {rank}, whose shard is {public!r}")
            # Our own shard in memory; an address listed twice (two ranks on one
            # endpoint) is refused by ShardedWorker.
            addresses[rank] = inproc
            super().__init__(addresses, rank, world_size, context=self._shared_ctx, **worker_options)
        except BaseException:
            self.aggregator.close()
            self._shared_ctx.term()
            raise
        try:
            # The shard is served by this rank's communication thread: a message between
            # the rank and its own shard wakes no other thread. Until now the other ranks'
            # first messages wait in the socket.
            self._loop.serve(self.aggregator)
        except BaseException:
            super().close()
            self.aggregator.close()
            self._shared_ctx.term()
            raise
        #: Every rank's shard address, this rank's as the others reach it.
        self.shard_addresses = tuple(a if k != rank else public for k, a in enumerate(addresses))

    def __repr__(self) -> str:
        return (f"ColocatedWorker(rank={self.rank}, world_size={self.world_size}, job={self.job!r}, "
                f"shard={self.aggregator.address!r})")

    def __enter__(self) -> ColocatedWorker:
        return self

    def close(self) -> None:
        """Closes this rank's workers, then its shard once the other ranks left it.

        The other ranks may still be reading their last results from this rank's
        shard when this rank is done: the shard closes when no rank's worker is
        connected any more (each says goodbye on close), or after ``close_timeout``.
        A process with several co-located workers should close them in the same
        order on every rank, or each close waits ``close_timeout`` for the others.

        Raises:
            RuntimeError: called on the worker's communication thread (an op's callback).
        """
        if self._loop.on_thread:
            # The thread would wait for itself to serve the shard, then close the context
            # its own sockets are still open on.
            raise RuntimeError("a co-located worker cannot be closed on its communication thread (in an op's "
                               "callback): close it from another thread")
        with self._close_lock:
            # One closer at a time, and a flag of its own (the shards' is set first): a step that
            # raises does not leave the loop, the shard or the context open.
            if self._ended:
                return
            try:
                self._close_shards()
                # The communication thread keeps serving this rank's shard meanwhile.
                deadline = time.monotonic() + self.close_timeout
                while self.aggregator.engine.active_jobs and self._loop.alive and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
                if self.aggregator.engine.active_jobs:
                    logger.warning("rank %d: closing its aggregator shard with %d job(s) still on it",
                                   self.rank, self.aggregator.engine.active_jobs)
            finally:
                try:
                    self._loop.close()
                    self.aggregator.close()
                finally:
                    self._shared_ctx.term()
                    self._ended = True


def _same_message_limit(aggregator_options: dict[str, Any], worker_options: dict[str, Any]) -> dict[str, Any]:
    """The shards' options with the frame limit the workers assume (``max_message_bytes``):
    one given to the workers (or ``$OMNIREDUCE_MAX_MESSAGE_BYTES``) becomes the shards' where
    their ``limits`` are not given, and the shards' given ``limits`` set the workers' where
    theirs is not given. ``worker_options`` is updated in place."""
    limits = aggregator_options.get("limits")
    given = config.resolve_optional(worker_options.get("max_message_bytes"), config.OMNIREDUCE_MAX_MESSAGE_BYTES, int)
    if limits is not None:
        worker_options.setdefault("max_message_bytes", limits.max_message_bytes if given is None else given)
    elif given is not None:
        aggregator_options["limits"] = Limits(max_message_bytes=config.check_integer("max_message_bytes", given))
    return aggregator_options
