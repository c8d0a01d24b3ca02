"""The cost model against measurement: runs bench/allreduce.py's density sweep and compares every
omnireduce and gloo row with :mod:`omnireduce.model`'s prediction.

Calibrates first (``omnireduce-calibrate``'s measurements, written to ``--costs``) unless
``--load`` is given, then runs the sweep (``python -m bench.allreduce`` with every option
not model_check's own) and prints per row the measured and predicted milliseconds and the relative error,
and the median ``|predicted - measured| / measured`` per system.

Example::

    python -m bench.model_check --sizes 25MB 100MB --repeats 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile

from bench.common import add_predictions, format_table, median_model_error

logger = logging.getLogger(__name__)

__all__ = ["main"]


# The sweep's defaults here; any bench.allreduce option given on the command line wins.
_SWEEP_DEFAULTS = ["--sizes", "25MB", "100MB", "--systems", "gloo", "omnireduce", "--repeats", "5", "--warmup", "1"]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """model_check's own options, and the rest for ``bench.allreduce``."""
    p = argparse.ArgumentParser(prog="python -m bench.model_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Every other option goes to bench.allreduce (see python -m bench.allreduce -h).")
    p.add_argument("--costs", default=None,
                   help="cost parameters JSON (default: $OMNIREDUCE_COSTS, else omnireduce-calibrate's path)")
    p.add_argument("--load", action="store_true", help="load --costs instead of calibrating first")
    p.add_argument("--quick-calibration", action="store_true", help="calibrate with --quick")
    p.add_argument("--results", default=None,
                   help="a results.json of an earlier bench.allreduce run: predict for it instead of running the sweep")
    p.add_argument("--out", default=None, help="bench.allreduce's output folder (default: a temporary one)")
    return p.parse_known_args(argv)


def _sweep(sweep_args: list[str], out: str) -> str:
    """Runs bench.allreduce; returns its results.json."""
    from bench import allreduce

    allreduce.main([*_SWEEP_DEFAULTS, *sweep_args, "--no-plot", "--no-progress", "--no-check", "--out", out])
    return os.path.join(out, "results.json")


def main(argv: list[str] | None = None) -> int:
    args, sweep_args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from bench.calibrate import calibrate
    from omnireduce import config, model
    from worker.auto import load_costs

    path = args.costs or os.environ.get(config.OMNIREDUCE_COSTS) or model.DEFAULT_COSTS_PATH
    if args.load:
        if not os.path.exists(path):
            # load_costs would fall back on the defaults quietly: not what --load asks for.
            raise SystemExit(f"--load: no cost parameters at {path} (run omnireduce-calibrate, or name --costs)")
        params = load_costs(path)
    else:
        params = calibrate(quick=args.quick_calibration)
        params.save(path)
    print("cost parameters: " + ", ".join(
        f"{k}={v:.3g}" for k, v in json.loads(params.to_json()).items() if isinstance(v, float)))
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="omnireduce-model-check-") as tmp:
        results = args.results or _sweep(sweep_args, args.out or tmp)
        with open(results) as f:
            doc = json.load(f)
    rows = doc["rows"]
    # The layout and shards the run used, as it recorded them.
    a = doc.get("meta", {}).get("args", {})
    add_predictions(rows, params, block_size=a.get("block_size", 256), message_blocks=a.get("message_blocks"),
                    streams=a.get("streams"), shards=a.get("shards", 1), inplace=not a.get("new_output", False))
    print()
    print(format_table(rows))
    print()
    for s in ("omnireduce", "gloo"):
        err = median_model_error(rows, s)
        if err == err:  # not NaN
            print(f"median |predicted - measured| / measured, {s}: {err * 100:.1f}% "
                  f"over {sum(1 for r in rows if r['system'] == s)} rows")
    print(f"load average before the sweep {load_before}, after {os.getloadavg()}")
    print("command: " + " ".join(["python", "-m", "bench.model_check", *sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
