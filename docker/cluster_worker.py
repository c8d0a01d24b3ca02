"""A cluster worker: reduces seeded sparse tensors through the aggregator and checks every sum.

Run in each worker container of ``docker/compose.yaml`` as
``python /opt/omnireduce/cluster_worker.py``. The connection settings come from the
environment as for any :class:`worker.Worker` (``OMNIREDUCE_ADDRESS``, ``RANK``,
``WORLD_SIZE``, ``OMNIREDUCE_JOB``, ``OMNIREDUCE_TIMEOUT``, ...); the job's shape from
the options below or their ``OMNIREDUCE_CLUSTER_*`` variables.

Every rank builds every rank's input from its seed, so it knows the exact sum and
needs no other channel to check the result. It prints one JSON line per op and a
final one, and writes a heartbeat file after each op for the container healthcheck.

Exit status: 0 every sum exact; 1 a sum differs; 3 an omnireduce error (its JSON line
names the error type, job, op and ranks, e.g. an ``OpTimeoutError`` when a peer died).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from omnireduce.errors import OmniReduceError, OpError
from worker import connect
from worker.demo import sparse_input

logger = logging.getLogger("cluster_worker")

EXIT_WRONG_SUM = 1
EXIT_OMNIREDUCE_ERROR = 3
HEARTBEAT = "/tmp/omnireduce-worker.alive"


def _env(name: str, default: str) -> str:
    return os.environ.get(f"OMNIREDUCE_CLUSTER_{name}", default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cluster_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=int(_env("ELEMENTS", "1000000")),
                   help="float32 elements per tensor ($OMNIREDUCE_CLUSTER_ELEMENTS)")
    p.add_argument("--density", type=float, default=float(_env("DENSITY", "0.05")),
                   help="fraction of nonzero 256-element blocks per rank ($OMNIREDUCE_CLUSTER_DENSITY)")
    p.add_argument("--ops", type=int, default=int(_env("OPS", "5")),
                   help="allreduce ops to run ($OMNIREDUCE_CLUSTER_OPS)")
    p.add_argument("--pause", type=float, default=float(_env("PAUSE", "0")),
                   help="seconds to sleep between ops, standing in for compute ($OMNIREDUCE_CLUSTER_PAUSE)")
    p.add_argument("--heartbeat", default=_env("HEARTBEAT", HEARTBEAT),
                   help="file touched after each op, for the healthcheck ($OMNIREDUCE_CLUSTER_HEARTBEAT)")
    args = p.parse_args(argv)
    if args.elements < 1 or args.ops < 0 or args.pause < 0 or not 0 < args.density <= 1:
        p.error("need --elements >= 1, --ops >= 0, --pause >= 0 and 0 < --density <= 1")
    return args


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _inputs(rank: int, world: int, op: int, elements: int, density: float) -> tuple[np.ndarray, np.ndarray]:
    # Seeded by op as well, so results mixed up between ops would show.
    x = sparse_input(rank + 100 * op, elements, density)
    expected = np.zeros(elements, dtype=np.float32)
    for r in range(world):  # the aggregator sums in rank order; integers make it exact in any order
        expected += sparse_input(r + 100 * op, elements, density)
    return x, expected


def run(args: argparse.Namespace) -> int:
    """Runs the job; returns the exit status (see the module docstring)."""
    heartbeat = Path(args.heartbeat)
    with connect() as w:
        base = {"rank": w.rank, "world_size": w.world_size, "job": w.job, "address": w.address}
        _emit({"event": "start", **base, "host": os.uname().nodename})
        heartbeat.touch()
        all_exact = True
        for op in range(args.ops):
            if op and args.pause:
                time.sleep(args.pause)
            x, expected = _inputs(w.rank, w.world_size, op, args.elements, args.density)
            y = w.allreduce(x)
            exact = bool(np.array_equal(y, expected))
            all_exact &= exact
            st = w.stats.last.as_dict()
            _emit({"event": "op", **base, "op": op, "exact": exact, **st})
            heartbeat.touch()
            if not exact:
                logger.error("rank %d op %d: the result differs from the dense sum in %d elements",
                             w.rank, op, int(np.count_nonzero(y != expected)))
        _emit({"event": "done", **base, "ops": args.ops, "exact": all_exact})
    return 0 if all_exact else EXIT_WRONG_SUM


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        return run(args)
    except OmniReduceError as e:
        record: dict[str, Any] = {"event": "error", "type": type(e).__name__, "message": str(e)}
        if isinstance(e, OpError):
            record.update(job=e.job, op=e.op, ranks=list(e.ranks))
        _emit(record)
        logger.error("%s: %s", type(e).__name__, e)
        return EXIT_OMNIREDUCE_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
