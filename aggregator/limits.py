"""What the aggregator allows, what it counts, and how it logs floods of bad input.

:class:`Limits` caps every resource a peer can make the aggregator hold, so that
hostile or broken input gets an ERROR reply instead of unbounded memory.
:class:`Counters` are the plain numbers the engine keeps on its hot path, every
one of them (what it did, and the bytes it holds); the Prometheus endpoint
(:mod:`aggregator.metrics`) reads them when scraped.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from omnireduce import config
from omnireduce.errors import ConfigError
from omnireduce.protocol import MAX_WORLD_SIZE

__all__ = ["Limits", "Counters", "LATENCY_BUCKETS", "RateLimitedLog"]

_MIB = 1 << 20


# ZeroMQ takes RCVHWM as a C int; the rest fit the int64 the limits are compared in.
_MAX_LIMIT = {"max_queued_messages": 2**31 - 1}


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps on what peers can make the aggregator hold; exceeding one is an ERROR (LIMIT) reply.

    Memory the aggregator can be made to hold is at most ``max_bytes`` in ops, plus
    what ZeroMQ queues before the engine reads it: per connection at most
    ``max_queued_messages`` messages of at most ``max_message_bytes`` per frame.

    Args:
        max_jobs: jobs known at once (a job is known while a worker is connected to it
            or one of its ops is in flight).
        max_world_size: workers per job.
        max_ops_per_job: ops of one job in flight at once.
        max_job_bytes: bytes held for one job's ops in flight (pointer tables and
            blocks waiting for the rest of their round).
        max_bytes: bytes held for all jobs together.
        max_message_bytes: largest frame accepted (``zmq.MAXMSGSIZE``: ZeroMQ disconnects a
            peer sending more, before the engine sees it; the worker's ConnectionLostError
            then names its op's largest message); an op whose messages could be larger, but
            whose first START fits, is refused (LimitError).
        max_streams: streams per op.
        max_jobs_per_connection: jobs one connection may join.
        max_queued_messages: messages ZeroMQ queues per connection before it stops
            reading from it (``zmq.RCVHWM``; back-pressure, nothing is lost).
    """

    max_jobs: int = 1024
    max_world_size: int = 4096
    max_ops_per_job: int = 256
    max_job_bytes: int = 1024 * _MIB
    max_bytes: int = 4096 * _MIB
    max_message_bytes: int = config.DEFAULT_MAX_MESSAGE_BYTES
    max_streams: int = 1024
    max_jobs_per_connection: int = 16
    max_queued_messages: int = 1000

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if type(v) is not int or v < 1:
                raise ConfigError(f"limit {f.name} must be a positive integer, got {v!r}")
            if v > _MAX_LIMIT.get(f.name, 2**63 - 1):
                raise ConfigError(f"limit {f.name} must be at most {_MAX_LIMIT.get(f.name, 2**63 - 1)}, got {v}")
        if self.max_world_size > MAX_WORLD_SIZE:
            raise ConfigError(f"max_world_size cannot exceed the protocol's {MAX_WORLD_SIZE}")


#: Upper bounds (seconds) of the op latency histogram's buckets.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"),
)


@dataclass(slots=True)
class Counters:
    """What the aggregator did (monotonic counts) and holds; read by the metrics endpoint."""

    messages_in: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    blocks_in: int = 0
    blocks_out: int = 0
    rounds: int = 0
    ops_started: int = 0
    ops_completed: int = 0
    #: Ops failed, for any reason.
    ops_failed: int = 0
    send_failures: int = 0
    peers_lost: int = 0
    #: Connections dropped for silence (no message or heartbeat for the heartbeat timeout).
    connections_dropped: int = 0
    #: Messages of connections declared gone, read late and dropped.
    late_dropped: int = 0
    #: Bytes held for ops in flight (a gauge), and the most ever held.
    held_bytes: int = 0
    peak_held_bytes: int = 0
    #: Errors by kind (the lower-case ErrorCode name): failed ops and refused messages.
    errors: dict[str, int] = field(default_factory=dict)
    #: Completed ops per latency bucket (not cumulative), and the latencies' sum.
    latency_counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    latency_sum: float = 0.0

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def observe_latency(self, seconds: float) -> None:
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds


class RateLimitedLog:
    """Logs at most ``per_second`` lines a second; says how many it dropped.

    A peer sending garbage at full speed must not turn the log into a second flood.

    Args:
        log: the logger.
        per_second: lines allowed per second (a burst of that many, then that rate).
        clock: monotonic time source.
    """

    def __init__(
        self, log: logging.Logger, per_second: float = 20.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = log
        self._rate = per_second
        self._clock = clock
        self._tokens = per_second
        self._last = clock()
        self.suppressed = 0

    def __call__(self, level: int, msg: str, *args: object) -> None:
        now = self._clock()
        self._tokens = min(self._rate, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens < 1.0:
            self.suppressed += 1
            return
        self._tokens -= 1.0
        if self.suppressed:
            self._log.warning("%d similar log lines suppressed", self.suppressed)
            self.suppressed = 0
        self._log.log(level, msg, *args)
