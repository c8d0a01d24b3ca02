"""bench.device_allreduce (the GPU check's end-to-end op) runs, and checks its sums, on CPU tensors."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch")

from bench import device_allreduce  # noqa: E402


def test_cpu_tensors_sum_exactly_through_both_systems(tmp_path: str) -> None:
    out = os.path.join(tmp_path, "out.json")
    rc = device_allreduce.main(["--device", "cpu", "--workers", "2", "--sizes", "65536", "--densities", "0.01",
                                "1.0", "--repeats", "2", "--warmup", "1", "--json", out])
    assert rc == 0
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert [r["density"] for r in rows] == [0.01, 1.0]
    for r in rows:
        assert r["omnireduce_ok"] and r["gloo_ok"]
        assert r["omnireduce_ms"] > 0 and r["gloo_ms"] > 0 and r["workers"] == 2 and r["elements"] == 65536


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        device_allreduce.parse_args(["--densities", "1.5"])
    with pytest.raises(SystemExit):
        device_allreduce.parse_args(["--workers", "0"])
