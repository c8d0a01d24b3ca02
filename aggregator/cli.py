"""``omnireduce-aggregator``: the aggregator daemon's command line."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType

from aggregator.server import Aggregator

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="omnireduce-aggregator", description=__doc__)
    p.add_argument("--listen", default="tcp://0.0.0.0:5555", help="ZeroMQ endpoint to bind; port 0 picks a free one")
    p.add_argument(
        "--timeout", type=float, default=30.0,
        help="seconds after an op's first message at which it fails on all workers (0 disables)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.timeout < 0:
        raise SystemExit("--timeout must be >= 0")
    try:
        agg = Aggregator(listen=args.listen, timeout=args.timeout or None)
    except OSError as e:
        logger.error("%s", e)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agg.start()
    while not stop.wait(0.5):
        pass
    agg.close()
    logger.info("completed %d ops, failed %d", agg.engine.ops_completed, agg.engine.ops_failed)
    return 0
