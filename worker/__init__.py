"""The omnireduce worker client.

    from worker import Worker
    with Worker("tcp://127.0.0.1:5555", rank=0, world_size=2, job="demo") as w:
        y = w.allreduce(x)

Several aggregator shards: ``Worker(["tcp://a:5555", "tcp://b:5555"], ...)`` (or a
comma-separated ``OMNIREDUCE_ADDRESS``) returns a :class:`ShardedWorker`.
"""

from worker.client import Worker
from worker.sharded import ShardedWorker
from worker.stats import OpStats, Stats

__all__ = ["Worker", "ShardedWorker", "Stats", "OpStats"]
