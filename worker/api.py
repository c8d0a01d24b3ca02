"""One way to make a worker, and what every kind of worker offers.

:func:`connect` returns a worker for one rank of one job: a
:class:`worker.client.Worker` (one aggregator), a
:class:`worker.sharded.ShardedWorker` (several aggregator shards) or a
:class:`worker.colocated.ColocatedWorker` (every rank serves one shard). All
three implement :class:`Allreducer`, which is what the DDP hook, the reducer and
the torch backend rely on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from omnireduce import config
from omnireduce.errors import ConfigError

if TYPE_CHECKING:
    from worker.colocated import Exchange
    from worker.stats import Stats

__all__ = ["Allreducer", "connect"]


@runtime_checkable
class Allreducer(Protocol):
    """A worker of one rank of one job: sums tensors over the job's workers."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def job(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    @property
    def message_blocks(self) -> int: ...

    @property
    def streams(self) -> int: ...

    @property
    def recommended_batches(self) -> list[float] | None: ...

    stats: Stats

    def allreduce_async(self, x: Any, **options: Any) -> Future:
        """Starts a sum over all workers of the job; returns a future of the result."""
        ...

    def allreduce(self, x: Any, **options: Any) -> Any:
        """Sums ``x`` over all workers of the job and returns the result."""
        ...

    def refuse(self, error: BaseException, x: Any = None, **options: Any) -> None:
        """Takes the number of an op this rank will not send (``x``: what it would have
        summed, if known) and fails that op on every rank, naming ``error``."""
        ...

    def set_timeout(self, seconds: float) -> None:
        """Sets the op timeout for the ops in flight and those to come."""
        ...

    def close(self) -> None:
        """Stops the worker; pending ops fail with WorkerClosedError."""
        ...

    def __enter__(self) -> Allreducer: ...

    def __exit__(self, *exc: object) -> None: ...


def connect(
    address: str | Sequence[str] | None = None, *, exchange: Exchange | None = None, **options: Any
) -> Allreducer:
    """A worker of this rank: the one kind that fits the addresses given.

    Args:
        address: the aggregator's endpoint; several (a list, a tuple, or one
            comma-separated string) make a :class:`worker.sharded.ShardedWorker`.
            Default ``$OMNIREDUCE_ADDRESS``.
        exchange: co-located aggregators instead (no address): every rank serves
            one shard, and ``exchange`` shares the shards' addresses (see
            :class:`worker.colocated.ColocatedWorker`, :func:`worker.colocated.torch_exchange`).
        **options: the worker's settings (``rank``, ``world_size``, ``job``,
            ``block_size``, ``timeout``, ``token``, ``mode``, ...; see
            :class:`worker.client.Worker`), with several shards ``shard_bytes``
            (see :class:`worker.sharded.ShardedWorker`) and, co-located, ``listen``,
            ``aggregator_options`` and ``close_timeout``.

    Raises:
        ConfigError: no address, both an address and ``exchange``, or bad settings.

    Example::

        with worker.connect("tcp://127.0.0.1:5555", rank=0, world_size=2, job="demo") as w:
            y = w.allreduce(x)
    """
    if exchange is not None:
        if address is not None:
            raise ConfigError("give either an aggregator address or a co-located exchange, not both")
        from worker.colocated import ColocatedWorker

        return ColocatedWorker(exchange, **options)
    value = address if address is not None else os.environ.get(config.OMNIREDUCE_ADDRESS)
    if value is None:
        raise ConfigError(f"no aggregator address: pass one or set ${config.OMNIREDUCE_ADDRESS}")
    if isinstance(value, (list, tuple)) or "," in value:
        from worker.sharded import ShardedWorker

        return ShardedWorker(value, **options)
    from worker.client import Worker

    # One aggregator: nothing to choose among (the same options work for every kind).
    options.pop("shard_bytes", None)
    return Worker(value, **options)
