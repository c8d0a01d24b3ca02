"""OmniReduce's allreduce microbenchmark on loopback: omnireduce against gloo dense and gloo sparse COO.

Every rank holds a float32 tensor whose nonzero 256-element blocks are placed at random,
independently per rank; the benchmark starts an aggregator and ``--workers`` rank
processes, and every rank times the three systems on the same tensors in the same
process (warm-up, then the median of the repeats of the slowest rank). Output: a table
on stdout, ``results.json``, ``results.csv`` and ``results.png`` in ``--out``.

Example::

    python -m bench.allreduce --sizes 100MB --workers 2 4 --repeats 10 --out bench/out
    python -m bench.allreduce --shards 2 --systems omnireduce --out bench/out-shards   # two aggregator processes
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

from bench.driver import Placement, add_args, run

logger = logging.getLogger(__name__)

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.allreduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--transport", choices=["tcp", "ipc"], default="tcp", help="omnireduce's ZeroMQ transport")
    p.add_argument("--out", default="bench/out", help="output folder")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="omnireduce-bench-") as tmp:
        listens = [
            "tcp://127.0.0.1:0" if args.transport == "tcp" else f"ipc://{os.path.join(tmp, f'aggregator{k}')}"
            for k in range(args.shards)
        ]

        def placement(w: int) -> Placement:
            own = [
                "tcp://127.0.0.1:0" if args.transport == "tcp" else f"ipc://{os.path.join(tmp, f'rank{r}')}"
                for r in range(w)
            ]
            return Placement(aggregators=[(listen, []) for listen in listens], rank_prefixes=[[] for _ in range(w)],
                             rank_env=[{"GLOO_SOCKET_IFNAME": "lo"} for _ in range(w)], rank_listen=own)

        run(args, placement, args.out, f"allreduce on loopback ({args.transport})", {"network": "loopback"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
