"""The omnireduce worker client.

    import worker
    with worker.connect("tcp://127.0.0.1:5555", rank=0, world_size=2, job="demo") as w:
        y = w.allreduce(x)

:func:`connect` is the one way to make a worker: one aggregator address gives a
:class:`Worker`; several (a list, or a comma-separated ``OMNIREDUCE_ADDRESS``) a
:class:`ShardedWorker`; ``exchange=`` (every rank serving one shard itself, no
aggregator to run) a :class:`ColocatedWorker`. All implement :class:`Allreducer`.
A sparse COO tensor, or :class:`SparseRows`, is summed row by row (its rows are
the blocks).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.api import Allreducer, connect
    from worker.client import Worker
    from worker.colocated import ColocatedWorker
    from worker.rows import SparseRows
    from worker.sharded import ShardedWorker
    from worker.stats import OpStats, Stats

__all__ = ["connect", "Allreducer", "Worker", "ShardedWorker", "ColocatedWorker", "SparseRows", "Stats", "OpStats"]

# Loaded on first use: `import worker` (and torch's entry point, worker.autoload)
# must stay cheap; the client pulls in ZeroMQ and Numba, co-located workers the aggregator.
_WHERE = {
    "connect": "worker.api",
    "Allreducer": "worker.api",
    "Worker": "worker.client",
    "ShardedWorker": "worker.sharded",
    "ColocatedWorker": "worker.colocated",
    "SparseRows": "worker.rows",
    "Stats": "worker.stats",
    "OpStats": "worker.stats",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
