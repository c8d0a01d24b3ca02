"""The benchmarks' code: each benchmark runs on a tiny size and writes its files; the cluster
topology is created and removed (where root and ``ip netns`` are available)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bench import cluster
from bench.common import (
    SYSTEMS,
    format_table,
    is_colocated,
    is_known,
    is_rows,
    make_tensor,
    parse_size,
    row_from_event,
    skewed_blocks,
    worker_mode,
    write_outputs,
)
from tests.helpers import ROOT, child_env

NO_CLUSTER = cluster.preflight()


def _bench(module: str, out: str, *extra: str, timeout: float = 150, cwd: str = ROOT) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", module, "--sizes", "20000", "--densities", "1.0", "0.05", "--workers", "2",
        "--repeats", "2", "--warmup", "1", "--time-limit", "120", "--op-timeout", "60", "--no-progress",
        "--out", out, *extra,
    ]
    env = child_env()
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _check_outputs(out: str, systems: list[str], densities: list[float]) -> list[dict]:
    for name in ("results.json", "results.csv", "results.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "results.json")) as f:
        doc = json.load(f)
    rows = doc["rows"]
    assert sorted((r["system"], r["density"]) for r in rows) == sorted((s, d) for s in systems for d in densities)
    for r in rows:
        assert r["ok"] is True, r
        assert r["workers"] == 2 and r["elements"] == 20000
        assert len(r["times"]) == 2 and all(t > 0 for t in r["times"])
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
    with open(os.path.join(out, "results.csv")) as f:
        assert len(f.read().strip().splitlines()) == len(rows) + 1
    assert doc["meta"]["machine"]["cores"] == os.cpu_count()
    return rows


def test_make_tensor_places_exact_blocks() -> None:
    rng = np.random.default_rng(1)
    x = make_tensor(10 * 256 + 100, 0.3, 256, rng)
    assert x.shape == (2660,) and x.dtype == np.float32
    padded = np.zeros(11 * 256, dtype=np.float32)
    padded[: len(x)] = x
    nonzero = (padded.reshape(11, 256) != 0).any(1)
    assert nonzero.sum() == round(0.3 * 11)
    # Every element of a chosen block is a nonzero integer, so sums are exact in any order.
    vals = padded.reshape(11, 256)[nonzero]
    assert (vals != 0).all() and (vals == np.round(vals)).all() and np.abs(vals).max() <= 100
    assert (make_tensor(1000, 1.0, 256, rng) != 0).all()
    assert not make_tensor(1000, 0.0, 256, rng).any()


def test_skewed_blocks_share_hot_blocks_across_ranks() -> None:
    nb, k, ranks = 102_400, 1024, 4

    def union(skew: float, order_seed: int = 7) -> int:
        draws = []
        for r in range(ranks):
            rng = np.random.default_rng([3, r])
            draws.append(skewed_blocks(nb, k, skew, rng, order_seed) if skew else rng.choice(nb, k, replace=False))
        for d in draws:  # k distinct blocks each
            assert len(np.unique(d)) == k and d.min() >= 0 and d.max() < nb
        return len(np.unique(np.concatenate(draws)))

    # Uniform placement: the ranks hardly overlap. Zipf 1.1 over a shared popularity order: a
    # quarter of the sum is shared (0.75 expected; a rank's own draw still varies).
    assert union(0.0) > 0.97 * ranks * k
    assert 0.65 * ranks * k < union(1.1) < 0.85 * ranks * k
    # The popularity order is the seed's: other ranks with another seed would share nothing special.
    a = skewed_blocks(nb, k, 1.1, np.random.default_rng(0), 1)
    b = skewed_blocks(nb, k, 1.1, np.random.default_rng(1), 2)
    assert len(np.intersect1d(a, b)) < 0.1 * k
    # Through make_tensor: exactly round(density * blocks) nonzero blocks, as without skew.
    x = make_tensor(nb * 16, 0.01, 16, np.random.default_rng(5), skew=1.1, order_seed=7)
    assert (x.reshape(nb, 16) != 0).any(1).sum() == k


def test_parse_size() -> None:
    assert parse_size("100MB") == 26_214_400
    assert parse_size("64KB") == 16384
    assert parse_size("1234") == 1234


def test_table_and_outputs(tmp_path) -> None:
    rows = []
    for system, t in (("gloo", 0.060), ("gloo-sparse", 0.030), ("omnireduce", 0.015)):
        rows.append(row_from_event({"type": "result", "workers": 2, "elements": 1 << 20, "density": 0.01,
                                    "system": system, "times": [t, t * 2, t / 2], "ok": True}))
    table = format_table(rows)
    assert "omnireduce" in table and "4.00" in table and "2.00" in table  # speedups over gloo dense
    paths = write_outputs(rows, str(tmp_path), {"title": "t"})
    assert [os.path.basename(p) for p in paths] == ["results.json", "results.csv", "results.png"]
    assert json.loads((tmp_path / "results.json").read_text())["rows"][2]["speedup_vs_gloo"] == pytest.approx(4.0)
    # Several world sizes: a second figure, time against workers.
    rows += [row_from_event({"type": "result", "workers": 4, "elements": 1 << 20, "density": 0.01,
                             "system": system, "times": [t], "ok": True})
             for system, t in (("gloo", 0.12), ("omnireduce", 0.02))]
    paths = write_outputs(rows, str(tmp_path / "w"), {"title": "t"})
    assert [os.path.basename(p) for p in paths][-1] == "results-workers.png"
    assert os.path.getsize(paths[-1]) > 1000


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_allreduce_benchmark_tiny(tmp_path) -> None:
    out = str(tmp_path / "out")
    res = _bench("bench.allreduce", out)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "x gloo" in res.stdout and "wrote" in res.stdout
    rows = _check_outputs(out, ["gloo", "gloo-sparse", "omnireduce"], [1.0, 0.05])
    omni = {r["density"]: r for r in rows if r["system"] == "omnireduce"}
    assert omni[0.05]["sent_fraction"] < omni[1.0]["sent_fraction"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_allreduce_benchmark_ipc_and_flags(tmp_path) -> None:
    out = str(tmp_path / "out")
    res = _bench("bench.allreduce", out, "--transport", "ipc", "--systems", "omnireduce", "omnireduce-colocated",
                 "--message-blocks", "8", "--streams", "2", "--block-size", "128", "--sparse-io", "--new-output")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = _check_outputs(out, ["omnireduce", "omnireduce-colocated"], [1.0, 0.05])
    args = json.loads((tmp_path / "out" / "results.json").read_text())["meta"]["args"]
    assert args["transport"] == "ipc" and args["message_blocks"] == 8 and args["block_size"] == 128
    assert args["new_output"]
    # 157 blocks over 16 columns: the dense op needs more than one round per stream.
    assert max(r["rounds"] for r in rows) > 2


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_allreduce_benchmark_relative_out_folder_colocated_only(tmp_path) -> None:
    # The rendezvous file lives under --out and travels as a file:// URL.
    res = _bench("bench.allreduce", "rel-out", "--systems", "omnireduce-colocated", "--no-plot", cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    with open(tmp_path / "rel-out" / "results.json") as f:
        assert len(json.load(f)["rows"]) == 2
    # The ranks served their own shards: no aggregator process was started.
    logs = os.listdir(tmp_path / "rel-out" / "logs")
    assert any(n.startswith("rank") for n in logs) and not any(n.startswith("aggregator") for n in logs), logs


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_allreduce_benchmark_interleaved_modes(tmp_path) -> None:
    out = str(tmp_path / "out")
    systems = ["gloo", "omnireduce", "omnireduce-dense", "omnireduce-auto", "omnireduce-colocated"]
    res = _bench("bench.allreduce", out, "--interleave", "--systems", *systems)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = _check_outputs(out, systems, [1.0, 0.05])
    sent = {(r["system"], r["density"]): r["sent_fraction"] for r in rows if r["system"] != "gloo"}
    # The dense mode sends every block whatever the density; the sparse one only the nonzero ones.
    assert sent[("omnireduce-dense", 0.05)] > 0.95 and sent[("omnireduce", 0.05)] < 0.2


def test_system_kinds() -> None:
    kinds = {s: (worker_mode(s), is_colocated(s), is_rows(s), is_known(s)) for s in SYSTEMS
             if s.startswith("omnireduce")}
    assert kinds == {
        "omnireduce": ("sparse", False, False, False), "omnireduce-dense": ("dense", False, False, False),
        "omnireduce-auto": ("auto", False, False, False), "omnireduce-colocated": ("sparse", True, False, False),
        "omnireduce-rows": ("sparse", False, True, False), "omnireduce-rows-colocated": ("sparse", True, True, False),
        "omnireduce-knownrows": ("sparse", False, False, True),
        "omnireduce-knownrows-colocated": ("sparse", True, False, True),
    }


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("flags", [["--interleave", "--skew", "1.1"], ["--sparse-io", "--transport", "ipc"]],
                         ids=["coo", "sparse-io-ipc"])
def test_allreduce_benchmark_rows(tmp_path, flags: list[str]) -> None:
    # gloo's sparse all_reduce and omnireduce's of the same prebuilt COO tensor (sparse in,
    # sparse out; checked against the dense sum), dedicated and co-located; two co-located
    # shards in one process (the IPC endpoints must differ).
    out = str(tmp_path / "out")
    # The knownrows systems: the dense tensor in place, its nonzero rows given (no mask pass).
    systems = ["gloo-sparse", "omnireduce-rows", "omnireduce-rows-colocated", "omnireduce-colocated",
               "omnireduce-knownrows", "omnireduce-knownrows-colocated"]
    res = _bench("bench.allreduce", out, "--systems", *systems, "--no-plot", *flags)
    assert res.returncode == 0, res.stdout + res.stderr
    with open(os.path.join(out, "results.json")) as f:
        rows = json.load(f)["rows"]
    assert sorted((r["system"], r["density"]) for r in rows) == sorted((s, d) for s in systems for d in (1.0, 0.05))
    assert all(r["ok"] is True and len(r["times"]) == 2 for r in rows), rows
    sent = {(r["system"], r["density"]): r["sent_fraction"] for r in rows if r["system"] != "gloo-sparse"}
    # Rows in: only the nonzero rows go out (20,000 elements: 79 rows, 4 of them at 5%).
    assert all(sent[(s, 0.05)] < 0.2 for s in systems[1:] if s != "omnireduce-colocated"), sent
    assert all(r["skew"] == (1.1 if "--skew" in flags else 0.0) for r in rows)
    # The union every rank received, at least what one rank sent.
    union = {r["system"]: r["union_fraction"] for r in rows if r["density"] == 0.05 and r["system"] != "gloo-sparse"}
    assert all(sent[(s, 0.05)] <= u <= 0.2 for s, u in union.items()), (union, sent)
    shards = {r["system"]: r["shards"] for r in rows}
    assert shards["omnireduce-rows"] == shards["omnireduce-knownrows"] == 1
    assert shards["omnireduce-rows-colocated"] == shards["omnireduce-knownrows-colocated"] == 2


def test_topology_rejects_addresses_outside_the_benchmark_range() -> None:
    for subnet in ("10.0.0.0/24", "192.168.1.0/24", "172.16.0.0/24", "198.20.0.0/24"):
        with pytest.raises(ValueError, match="198.18.0.0/15"):
            cluster.Topology(2, subnet=subnet)
    with pytest.raises(ValueError, match="tc rate"):
        cluster.Topology(2, rate="fast")
    cluster.Topology(2, subnet="198.19.255.0/24")  # the top of the range is fine


def _ours() -> list[str]:
    tag = f"ob{os.getpid()}"
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [n for n in names if n.startswith(tag)] + [ln for ln in links.splitlines() if f" {tag}" in ln]


@pytest.mark.skipif(NO_CLUSTER is not None, reason=f"cluster benchmark unavailable: {NO_CLUSTER}")
@pytest.mark.timeout(120)
def test_topology_up_shapes_and_down() -> None:
    topo = cluster.Topology(2, rate="100mbit", subnet="198.18.200.0/24")
    try:
        topo.up()
        assert len(topo.exists()) == 1 + 3 + 3  # bridge, 3 namespaces, 3 host-side veths
        bps = cluster.measure_link(topo, seconds=0.5)
        # Shaped to 100 Mbit/s: unshaped veth carries about 100x that.
        assert 30e6 < bps < 130e6, bps
    finally:
        topo.down()
    assert topo.exists() == []
    assert _ours() == []


@pytest.mark.skipif(NO_CLUSTER is not None, reason=f"cluster benchmark unavailable: {NO_CLUSTER}")
def test_cleanup_stale_removes_dead_runs() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"ob{dead.pid}-test"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in cluster.cleanup_stale()
        assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.slow
@pytest.mark.skipif(NO_CLUSTER is not None, reason=f"cluster benchmark unavailable: {NO_CLUSTER}")
@pytest.mark.timeout(200)
def test_cluster_benchmark_tiny(tmp_path) -> None:
    out = str(tmp_path / "out")
    systems = ["gloo", "gloo-sparse", "omnireduce", "omnireduce-colocated"]
    res = _bench("bench.cluster", out, "--rate", "1gbit", "--subnet", "198.18.201.0/24", "--systems", *systems)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "link check" in res.stdout
    _check_outputs(out, systems, [1.0, 0.05])
    net = json.loads((tmp_path / "out" / "results.json").read_text())["meta"]["network"]
    assert net["rate"] == "1gbit" and net["measured_stream_bps"] > 0


@pytest.mark.slow
@pytest.mark.skipif(NO_CLUSTER is not None, reason=f"cluster benchmark unavailable: {NO_CLUSTER}")
@pytest.mark.timeout(120)
def test_cluster_benchmark_cleans_up_when_terminated(tmp_path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.cluster", "--sizes", "100MB", "--workers", "2", "--repeats", "50",
         "--no-progress", "--time-limit", "90", "--subnet", "198.18.202.0/24", "--out", str(tmp_path / "out")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    tag = f"ob{proc.pid}"
    try:
        deadline = time.monotonic() + 60
        # Wait until the rank processes run inside the namespaces, then interrupt.
        while time.monotonic() < deadline:
            ns = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                  if n.startswith(tag)]
            if len(ns) == 3 and all(
                subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.strip() for n in ns
            ):
                break
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.2)
        else:
            pytest.fail("the benchmark did not start its processes in the namespaces")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    left = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if n.startswith(tag)]
    links = [ln for ln in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
             .splitlines() if f" {tag}" in ln]
    assert left == [] and links == [], output


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_backtoback_benchmark_tiny() -> None:
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "bench.backtoback", "--workers", "2", "--rows", "500", "--width", "8",
           "--lookups", "40", "--ops", "5", "--rounds", "2", "--timeout", "150"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    blocks = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    # The systems alternate, round after round; every rank reports its CPU.
    assert [b["system"] for b in blocks] == ["gloo-sparse", "omnireduce-colocated"] * 2
    for b in blocks:
        assert b["ms_per_op"] > 0
        assert len(b["cpu_ms_per_rank"]) == 2 and min(b["cpu_ms_per_rank"]) > 0
    assert "| omnireduce-colocated |" in res.stdout


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_backtoback_benchmark_dense_tiny() -> None:
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "bench.backtoback", "--workers", "2", "--dense", "64KB", "--density", "0.1",
           "--key", "--ops", "5", "--rounds", "1", "--timeout", "150"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    blocks = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [b["system"] for b in blocks] == ["gloo", "omnireduce-colocated"]
    assert "dense float32 tensors of 65,536 bytes" in res.stdout


def test_backtoback_rejects_bad_arguments() -> None:
    from bench.backtoback import parse_args

    assert parse_args(["--workers", "3"]).workers == 3
    assert parse_args(["--dense", "1MB"]).systems == ["gloo", "omnireduce-colocated"]
    for bad in (["--workers", "0"], ["--lookups", "0"], ["--zipf", "-1"], ["--systems", "gloo"],
                ["--dense", "1MB", "--systems", "gloo-sparse"], ["--dense", "1000"],
                ["--dense", "1MB", "--density", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_reducer_benchmark_tiny() -> None:
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "bench.reducer", "--workers", "2", "--rows", "300", "--width", "8",
           "--lookups", "20", "--zipf", "1.1", "--steps", "3", "--rounds", "2", "--timeout", "150"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    # Before timing, every system's gradients were checked against gloo's (a mismatch exits non-zero).
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    blocks = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [b["system"] for b in blocks] == ["gloo", "reducer", "reducer-rows"] * 2
    for b in blocks:
        assert b["ms_per_step"] > 0 and len(b["cpu_ms_per_rank"]) == 2
    assert "| reducer-rows |" in res.stdout
    # Sparse tables: gloo's sparse allreduce against the reducer's rows (checked equal first).
    res = subprocess.run([*cmd, "--sparse"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    blocks = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [b["system"] for b in blocks] == ["gloo", "reducer"] * 2


def test_reducer_benchmark_rejects_bad_arguments() -> None:
    from bench.reducer import parse_args

    assert parse_args(["--workers", "3"]).workers == 3
    assert parse_args(["--sparse"]).systems == ["gloo", "reducer"]
    for bad in (["--workers", "0"], ["--steps", "0"], ["--zipf", "-1"], ["--systems", "gloo-sparse"],
                ["--sparse", "--systems", "reducer-rows"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_a_failed_worker_close_still_closes_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    from bench import procs

    closed: list[str] = []

    class Fake:
        def __init__(self, name: str, fail: bool) -> None:
            self.name, self.fail = name, fail

        def close(self) -> None:
            closed.append(self.name)
            if self.fail:
                raise RuntimeError(f"{self.name} would not close")

    class FakeDist:
        def destroy_process_group(self) -> None:
            closed.append("group")

    procs._close([Fake("a", True), Fake("b", False)], FakeDist())
    assert closed == ["a", "b", "group"]
    assert "a would not close" in caplog.text
