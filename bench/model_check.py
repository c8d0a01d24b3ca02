"""The cost model against measurement: runs bench/allreduce.py's density sweep and compares every
omnireduce and gloo row with :mod:`omnireduce.model`'s prediction.

Calibrates first (``omnireduce-calibrate``'s measurements, written to ``--costs``) unless
``--load`` is given, then runs the sweep (``python -m bench.allreduce`` with the options
below) and prints per row the measured and predicted milliseconds and the relative error,
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
from typing import Any

from bench.common import DENSITIES, add_predictions, format_table, median_model_error

logger = logging.getLogger(__name__)

__all__ = ["main"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.model_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["25MB", "100MB"])
    p.add_argument("--densities", nargs="+", type=float, default=list(DENSITIES))
    p.add_argument("--workers", nargs="+", type=int, default=[2])
    p.add_argument("--systems", nargs="+", default=["gloo", "omnireduce"], help="systems of bench.allreduce")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--message-blocks", type=int, default=None)
    p.add_argument("--streams", type=int, default=None)
    p.add_argument("--costs", default=None, help="cost parameters JSON (default: omnireduce-calibrate's path)")
    p.add_argument("--load", action="store_true", help="load --costs instead of calibrating first")
    p.add_argument("--quick-calibration", action="store_true", help="calibrate with --quick")
    p.add_argument("--results", default=None,
                   help="a results.json of an earlier bench.allreduce run: predict for it instead of running the sweep")
    p.add_argument("--out", default=None, help="bench.allreduce's output folder (default: a temporary one)")
    return p.parse_args(argv)


def _sweep(args: argparse.Namespace, out: str) -> list[dict[str, Any]]:
    from bench import allreduce

    argv = ["--sizes", *args.sizes, "--densities", *map(str, args.densities),
            "--workers", *map(str, args.workers), "--systems", *args.systems,
            "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--block-size", str(args.block_size),
            "--no-plot", "--no-progress", "--no-check", "--out", out]
    if args.message_blocks:
        argv += ["--message-blocks", str(args.message_blocks)]
    if args.streams:
        argv += ["--streams", str(args.streams)]
    allreduce.main(argv)
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)["rows"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from omnireduce import model
    from omnireduce.calibrate import calibrate

    path = args.costs or model.DEFAULT_COSTS_PATH
    if args.load:
        params = model.CostParams.load(path)
    else:
        params = calibrate(quick=args.quick_calibration)
        params.save(path)
    print("cost parameters: " + ", ".join(
        f"{k}={v:.3g}" for k, v in json.loads(params.to_json()).items() if isinstance(v, float)))
    load_before = os.getloadavg()
    if args.results:
        with open(args.results) as f:
            doc = json.load(f)
        rows = doc["rows"]
        a = doc.get("meta", {}).get("args", {})
        layout = {"block_size": a.get("block_size", args.block_size),
                  "message_blocks": a.get("message_blocks"), "streams": a.get("streams")}
    else:
        with tempfile.TemporaryDirectory(prefix="omnireduce-model-check-") as tmp:
            rows = _sweep(args, args.out or tmp)
        layout = {"block_size": args.block_size, "message_blocks": args.message_blocks, "streams": args.streams}
    add_predictions(rows, params, **layout)
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
