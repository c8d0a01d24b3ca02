"""``omnireduce-aggregator``: the aggregator daemon's command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import signal
import time
from types import FrameType

from aggregator.limits import Limits
from aggregator.server import Aggregator
from omnireduce.errors import ConfigError

logger = logging.getLogger(__name__)

# How often the main thread looks for a termination signal.
_SIGNAL_POLL_S = 0.2

_LIMIT_HELP = {
    "max_jobs": "jobs known at once",
    "max_world_size": "workers per job",
    "max_ops_per_job": "ops of one job in flight at once",
    "max_job_bytes": "bytes held for one job's ops in flight",
    "max_bytes": "bytes held for all jobs",
    "max_message_bytes": "largest frame accepted (zmq.MAXMSGSIZE; larger: the sender is disconnected)",
    "max_streams": "streams per op",
    "max_jobs_per_connection": "jobs one connection may join",
    "max_queued_messages": "messages queued per connection before reading from it pauses (zmq.RCVHWM)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="omnireduce-aggregator", description=__doc__)
    p.add_argument("--listen", default="tcp://0.0.0.0:5555", help="ZeroMQ endpoint to bind; port 0 picks a free one")
    p.add_argument(
        "--timeout", type=float, default=30.0,
        help="seconds after an op's first message at which it fails on all workers (0 disables)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--heartbeat", type=float, default=None,
        help="seconds without hearing from a connection after which it gets a heartbeat (0: off, only answer "
             "the workers'); default $OMNIREDUCE_HEARTBEAT, else 1",
    )
    p.add_argument(
        "--heartbeat-timeout", type=float, default=None,
        help="seconds of silence after which a worker counts as lost; default $OMNIREDUCE_HEARTBEAT_TIMEOUT, else 5",
    )
    p.add_argument(
        "--curve-secret-key", default=None,
        help="this aggregator's .key_secret file (omnireduce-keygen): turns CURVE encryption on; "
        "default $OMNIREDUCE_CURVE_SECRET_KEY",
    )
    p.add_argument(
        "--curve-client-keys", default=None,
        help="directory of the workers' .key files allowed to connect (default $OMNIREDUCE_CURVE_CLIENT_KEYS; "
        "unset with CURVE on: any key, encryption only)",
    )
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (0: any)")
    p.add_argument("--metrics-addr", default=None, help="address of the metrics endpoint (default 127.0.0.1; "
                   "needs --metrics-port)")
    defaults = Limits()
    for f in dataclasses.fields(Limits):
        p.add_argument(
            "--" + f.name.replace("_", "-"), type=int, default=getattr(defaults, f.name),
            help=f"{_LIMIT_HELP[f.name]} (default %(default)s)",
        )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not math.isfinite(args.timeout) or args.timeout < 0:
        raise SystemExit("--timeout must be a finite number >= 0")
    if args.metrics_addr is not None and args.metrics_port is None:
        raise SystemExit("--metrics-addr needs --metrics-port (no metrics are served without it)")
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Only a note: the handler runs between two bytecodes of the main thread, which may
        # hold a lock the handler would take (threading.Event.set, logging's): a deadlock.
        received.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # before the aggregator logs that it listens
    try:
        limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
        agg = Aggregator(
            listen=args.listen, timeout=args.timeout or None, limits=limits,
            heartbeat=args.heartbeat, heartbeat_timeout=args.heartbeat_timeout,
            curve_secret_key=args.curve_secret_key, curve_client_keys=args.curve_client_keys,
            metrics_port=args.metrics_port, metrics_addr=args.metrics_addr or "127.0.0.1",
        )
    except (OSError, ConfigError) as e:
        logger.error("%s", e)
        return 1
    agg.start()
    while not received and agg.alive:
        time.sleep(_SIGNAL_POLL_S)
    if not received:
        # A daemon that no longer serves must not look healthy to its supervisor.
        logger.error("the serving loop died (%r): exiting", agg.failure)
        agg.close()
        return 1
    logger.info("signal %d: shutting down", received[0])
    agg.close()
    logger.info("completed %d ops, failed %d", agg.engine.ops_completed, agg.engine.ops_failed)
    return 0
