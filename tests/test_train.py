"""bench.train: every system trains every model to gloo's parameters; the summary's arithmetic."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from bench.train import smoothed, summarise  # noqa: E402
from bench.train_rank import SYSTEMS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("ctr", "ncf", "lm")
STEPS = 4


@pytest.fixture(scope="module")
def loopback_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("train"))
    # Plain SGD: every replica then stays equal to gloo's up to the rounding of the sums.
    cmd = [sys.executable, "-m", "bench.train", "--rate", "loopback", "--models", *MODELS, "--scale", "0.01",
           "--steps", str(STEPS), "--workers", "2", "--optimizer", "sgd", "--op-timeout", "60",
           "--time-limit", "240", "--out", out]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def test_every_system_reaches_gloos_parameters(loopback_run: str) -> None:
    with open(os.path.join(loopback_run, "results.json")) as f:
        results = json.load(f)
    gaps = {(p["model"], p["system"]): p for p in results["params"]}
    assert set(gaps) == {(m, s) for m in MODELS for s in SYSTEMS}
    for (model, system), p in gaps.items():
        assert p["reference"] == "gloo-dense"
        # A missed average or a lost row moves a parameter by lr x a gradient (1e-3 and up here).
        assert p["max_abs_diff"] <= 1e-6, f"{model} {system}: parameters differ from gloo dense by {p['max_abs_diff']}"
        assert p["max_abs_param"] > 0
    # Every step of every system: the same loss (the same model on the same batches).
    losses: dict[tuple[str, int], dict[str, float]] = {}
    for e in results["steps"]:
        losses.setdefault((e["model"], e["step"]), {})[e["system"]] = e["loss"]
    assert len(losses) == len(MODELS) * STEPS
    for key, by_system in losses.items():
        assert set(by_system) == set(SYSTEMS), key
        ref = by_system["gloo-dense"]
        for system, loss in by_system.items():
            assert loss == pytest.approx(ref, rel=1e-5), (key, system)
    # The omnireduce systems really went through omnireduce: their ops counted sparse paths.
    last = {(e["model"], e["system"]): e for e in results["steps"] if e["step"] == STEPS - 1}
    for model in MODELS:
        for system in ("omnireduce", "omnireduce-sparse", "omnireduce-colocated", "omnireduce-auto",
                       "omnireduce-colocated-auto", "omnireduce-rows", "omnireduce-colocated-rows"):
            # The auto systems send their embedding rows through omnireduce whatever the dense buckets do.
            assert last[model, system]["paths"]["sparse"] > 0, (model, system)
            assert last[model, system]["protocol_bytes_sent"] > 0
        for system in ("omnireduce-rows", "omnireduce-colocated-rows"):
            # Their tables went out as looked-up rows, every step (no table dropped by its check).
            assert last[model, system]["rows_buckets"] >= STEPS, (model, system)
        assert "paths" not in last[model, "gloo-dense"]


def test_outputs_are_written(loopback_run: str) -> None:
    with open(os.path.join(loopback_run, "steps.csv")) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(MODELS) * len(SYSTEMS) * STEPS
    # Each step's slowest rank and its phases, which fit in the step's time.
    for row in rows:
        assert row["slowest_rank"] in ("0", "1")
        phases = [float(row[f"{p}_s"]) for p in ("forward", "backward", "tail", "optimizer")]
        assert min(phases) >= 0 and sum(phases) <= float(row["seconds"]) * 1.001
        # The ranks' CPU per phase: forward and backward compute, so they took CPU.
        cpu = [float(row[f"cpu_{p}_s"]) for p in ("forward", "backward", "tail", "optimizer")]
        assert min(cpu) >= 0 and cpu[0] > 0 and cpu[1] > 0
    with open(os.path.join(loopback_run, "results.json")) as f:
        summary = json.load(f)["summary"]
    assert {(r["model"], r["system"]) for r in summary} == {(m, s) for m in MODELS for s in SYSTEMS}
    for r in summary:
        assert r["step_s_median"] > 0 and r["samples_per_s"] > 0
        assert r["link_bytes_per_step"] is None  # loopback: no per-rank interface to count
        # The slowest rank's phases: each a real part of a step, none longer than the slowest step.
        phases = r["phases_ms"]
        assert list(phases) == ["forward", "backward", "tail", "optimizer"]
        assert phases["forward"] > 0 and phases["backward"] > 0 and min(phases.values()) >= 0
        assert sum(phases.values()) <= 1e3 * r["step_s_mean"] * STEPS
        assert list(r["cpu_ms"]) == ["forward", "backward", "tail", "optimizer"]
        assert r["cpu_ms"]["forward"] > 0 and r["cpu_ms"]["backward"] > 0 and min(r["cpu_ms"].values()) >= 0
    for model in MODELS:
        assert os.path.getsize(os.path.join(loopback_run, f"loss-{model}-loopback-w2.png")) > 1000


def _events(system: str, seconds: list[float], losses: list[float]) -> list[dict]:
    return [{"model": "m", "rate": "r", "workers": 2, "system": system, "step": i, "seconds": s, "loss": v,
             "metric": 0.5, "samples": 64, "bytes_sent": 100, "bytes_received": 50}
            for i, (s, v) in enumerate(zip(seconds, losses, strict=True))]


def test_summary_speedups_and_time_to_target() -> None:
    losses = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
    dense = _events("gloo-dense", [5.0] + [0.2] * 9, losses)
    fast = _events("omnireduce", [9.0] + [0.05] * 9, losses)
    slow = _events("gloo-sparse", [0.1] * 10, [v + 1 for v in losses])  # never reaches the target
    rows = {r["system"]: r for r in summarise(dense + fast + slow, [], warmup=1, target_at=0.5)}
    # 10 steps: a trailing mean over 2; the target is gloo dense's at step 4: (0.7 + 0.6) / 2.
    assert rows["gloo-dense"]["target_loss"] == pytest.approx(0.65)
    assert rows["omnireduce"]["steps_to_target"] == 5
    # The warm-up step counts at the median (0.05), not its 9 s.
    assert rows["omnireduce"]["seconds_to_target"] == pytest.approx(5 * 0.05)
    assert rows["gloo-dense"]["seconds_to_target"] == pytest.approx(5 * 0.2)
    assert rows["gloo-sparse"]["steps_to_target"] is None and rows["gloo-sparse"]["seconds_to_target"] is None
    assert rows["omnireduce"]["x_gloo-dense"] == pytest.approx(4.0)
    assert rows["omnireduce"]["x_gloo-sparse"] == pytest.approx(2.0)
    assert rows["omnireduce"]["samples_per_s"] == pytest.approx(64 / 0.05)
    assert rows["omnireduce"]["link_bytes_per_step"] == 150


def test_summary_phases_are_medians() -> None:
    events = _events("omnireduce", [0.1, 0.1, 0.1], [1.0, 0.9, 0.8])
    for e, tail in zip(events, [0.05, 0.01, 0.03], strict=True):
        e["phases"] = {"forward": 0.02, "backward": 0.04, "tail": tail, "optimizer": 0.005}
    (row,) = summarise(events, [], warmup=0)
    assert row["phases_ms"] == pytest.approx({"forward": 20.0, "backward": 40.0, "tail": 30.0, "optimizer": 5.0})


def test_smoothed_is_a_trailing_mean() -> None:
    assert smoothed([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smoothed([2.0], 5) == [2.0]


def test_bad_arguments_are_refused() -> None:
    res = subprocess.run([sys.executable, "-m", "bench.train", "--models", "resnet"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "invalid choice" in res.stderr


def _failing_once(calls: list[int], fail_until: int):  # noqa: ANN202 - a run_world stand-in
    from bench.driver import BenchError

    def run_world(cfg, placement, master, run_dir, deadline, on_event) -> None:  # noqa: ANN001
        calls.append(len(calls) + 1)
        attempt = len(calls)
        for step in range(cfg["steps"]):
            for system in cfg["systems"]:
                on_event({"type": "step", "system": system, "step": step, "seconds": 0.1 * attempt, "loss": 1.0,
                          "metric": 0.5, "samples": 8, "bytes_sent": 1, "bytes_received": 1})
            if attempt <= fail_until and step == 1:
                raise BenchError("rank 1 exited with -6: malloc(): unaligned tcache chunk detected")

    return run_world


@pytest.mark.parametrize("retries", [0, 1])
def test_a_failed_world_is_run_again_and_only_the_kept_attempt_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, retries: int
) -> None:
    from bench import train

    calls: list[int] = []
    monkeypatch.setattr(train, "run_world", _failing_once(calls, fail_until=1))
    rc = train.main(["--rate", "loopback", "--models", "ctr", "--workers", "2", "--systems", "gloo-dense",
                     "gloo-sparse", "--steps", "3", "--retries", str(retries), "--out", str(tmp_path)])
    with open(os.path.join(tmp_path, "results.json")) as f:
        data = json.load(f)
    assert len(calls) == 1 + retries
    failure = data["failures"][0]
    assert len(data["failures"]) == 1 and failure["attempt"] == 1 and "tcache" in failure["error"]
    if retries:
        # The world succeeded on its second attempt: the run did not fail, the failure is kept.
        assert rc == 0 and failure["retried"]
        assert len(data["steps"]) == 3 * 2 and [s["seconds"] for s in data["steps"]] == pytest.approx([0.2] * 6)
    else:
        # No retry: the failed attempt's steps (2 of 3) are what there is, and the run failed.
        assert rc == 1 and not failure["retried"]
        assert len(data["steps"]) == 2 * 2 and [s["seconds"] for s in data["steps"]] == pytest.approx([0.1] * 4)
