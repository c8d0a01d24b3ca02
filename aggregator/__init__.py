"""The omnireduce aggregator: sums sparse blocks of a job's workers.

Run it with ``omnireduce-aggregator`` or ``python -m aggregator``, or embed it::

    from aggregator import Aggregator
    agg = Aggregator(listen="tcp://127.0.0.1:0").start()
"""

from aggregator.engine import Engine
from aggregator.server import Aggregator

__all__ = ["Aggregator", "Engine"]
