"""The omnireduce worker client.

    from worker import Worker
    with Worker("tcp://127.0.0.1:5555", rank=0, world_size=2, job="demo") as w:
        y = w.allreduce(x)
"""

from worker.client import Worker
from worker.stats import OpStats, Stats

__all__ = ["Worker", "Stats", "OpStats"]
