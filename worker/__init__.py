"""The omnireduce worker client.

    from worker import Worker
    with Worker("tcp://127.0.0.1:5555", rank=0, world_size=2, job="demo") as w:
        y = w.allreduce(x)

Several aggregator shards: ``Worker(["tcp://a:5555", "tcp://b:5555"], ...)`` (or a
comma-separated ``OMNIREDUCE_ADDRESS``) returns a :class:`ShardedWorker`. Every
rank serving one shard itself, with no aggregator to run: :class:`ColocatedWorker`.
"""

from worker.client import Worker
from worker.colocated import ColocatedWorker
from worker.sharded import ShardedWorker
from worker.stats import OpStats, Stats

__all__ = ["Worker", "ShardedWorker", "ColocatedWorker", "Stats", "OpStats"]
