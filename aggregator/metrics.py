"""The aggregator's Prometheus endpoint (``--metrics-port``), with prometheus-client.

The engine keeps every number on its hot path in one structure
(:class:`aggregator.limits.Counters`); this collector reads the engine and turns
them into metric families when the endpoint is scraped, so serving metrics costs
the aggregator nothing between scrapes. Each aggregator has its own registry:
several can run in one process (as in the tests).

Metrics (all prefixed ``omnireduce_aggregator_``): ``ops_started_total``,
``ops_completed_total``, ``ops_failed_total``, ``messages_in_total``,
``bytes_in_total``, ``bytes_out_total``, ``blocks_in_total``, ``blocks_out_total``,
``rounds_total``, ``peers_lost_total``, ``send_failures_total``, ``late_dropped_total``,
``connections_dropped_total``,
``errors_total{kind=...}`` (failed ops and refused messages by error code, and
``handshake`` for refused connections, ``handshake_aborted`` for peers that closed
during the handshake, such as a health check's bare TCP connect), ``op_latency_seconds`` (histogram, from an
op's first message to its last result), and the gauges ``active_jobs``,
``active_ops``, ``held_bytes`` and ``peak_held_bytes``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from aggregator.limits import LATENCY_BUCKETS

if TYPE_CHECKING:
    from aggregator.server import Aggregator

logger = logging.getLogger(__name__)

__all__ = ["AggregatorCollector", "serve_metrics"]

_PREFIX = "omnireduce_aggregator_"
_COUNTERS = (
    ("messages_in", "Messages received from workers, valid or not."),
    ("bytes_in", "Bytes received from workers (frames after the routing id)."),
    ("bytes_out", "Bytes sent to workers."),
    ("blocks_in", "Blocks received from workers."),
    ("blocks_out", "Summed blocks sent to workers (a block sent to N workers counts N)."),
    ("rounds", "Rounds completed, over all streams of all ops."),
    ("ops_started", "Ops created."),
    ("ops_completed", "Ops completed."),
    ("ops_failed", "Ops failed (any reason), also those failed before any START came (so started - completed "
                   "- failed may be negative)."),
    ("peers_lost", "Connections bound to a job that closed or stopped answering heartbeats."),
    ("connections_dropped", "Connections dropped for sending nothing, not even a heartbeat, for the timeout."),
    ("send_failures", "Messages that could not be sent (peer gone or not reading)."),
    ("late_dropped", "Messages of connections already declared gone, read late and dropped."),
)


class AggregatorCollector(Collector):
    """Reads an aggregator's engine (its counters, jobs and ops) at scrape time.

    Args:
        agg: the aggregator.
    """

    def __init__(self, agg: Aggregator) -> None:
        self._agg = agg

    def collect(self) -> Iterator[Metric]:
        engine = self._agg.engine
        c = engine.counters
        for name, doc in _COUNTERS:
            yield CounterMetricFamily(_PREFIX + name, doc, value=getattr(c, name))
        errors = CounterMetricFamily(_PREFIX + "errors", "Failed ops and refused messages, by kind.", labels=["kind"])
        # dict() copies atomically under the GIL while the serving thread may add kinds.
        for kind, n in sorted(dict(c.errors).items()):
            errors.add_metric([kind], n)
        yield errors
        counts = list(c.latency_counts)
        cumulative, buckets = 0, []
        for bound, n in zip(LATENCY_BUCKETS, counts, strict=True):
            cumulative += n
            buckets.append(("+Inf" if math.isinf(bound) else repr(bound), cumulative))
        yield HistogramMetricFamily(
            _PREFIX + "op_latency_seconds", "Seconds from an op's first message to its last result.",
            buckets=buckets, sum_value=c.latency_sum,
        )
        gauges: tuple[tuple[str, str, Any], ...] = (
            ("active_jobs", "Jobs known (a worker connected or an op in flight).", engine.active_jobs),
            ("active_ops", "Ops in flight.", engine.active_ops),
            ("held_bytes", "Bytes held for ops in flight.", c.held_bytes),
            ("peak_held_bytes", "Most bytes ever held for ops in flight.", c.peak_held_bytes),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(_PREFIX + name, doc, value=value)


def serve_metrics(agg: Aggregator, port: int, addr: str = "127.0.0.1") -> Any:
    """Serves ``agg``'s metrics at ``http://addr:port/metrics`` from a daemon thread.

    Args:
        agg: the aggregator.
        port: TCP port; 0 picks a free one (read it from the returned server).
        addr: address to bind.

    Returns:
        The HTTP server (``server_address``, ``shutdown()``, ``server_close()``).
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AggregatorCollector(agg))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server
