"""PyTorch integration: the DDP hook, the no-DDP reducer and the "omnireduce" backend against gloo."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from aggregator import Aggregator  # noqa: E402
from tests.helpers import run_procs  # noqa: E402 - also imported from here by tests/test_torch_backend.py

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def agg():
    a = Aggregator(timeout=60).start()
    yield a
    a.close()


TOLERANCE = {"fp16": dict(rtol=2e-3, atol=2e-3), "bf16": dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["buckets", "fp16", "bf16", "no_sync", "unused"])
def test_ddp_hook_matches_gloo(agg, tmp_path, world: int, case: str) -> None:
    results = run_procs("ddp_case", world, tmp_path, agg.address, case)
    for res in results:
        assert res["error"] is None
        assert res["buckets"] > 0
        torch.testing.assert_close(res["got"], res["expected"], **TOLERANCE.get(case, {}))
    if case == "buckets":
        # Iteration 0 has one bucket; from iteration 1 DDP's rebuilt buckets (cap 1 kB)
        # split the gradients, so the hook saw buckets of changing sizes.
        assert results[0]["buckets"] > 4
    # Every rank ends with the same parameters.
    for res in results[1:]:
        torch.testing.assert_close(res["got"], results[0]["got"], rtol=0, atol=0)


@pytest.mark.parametrize("case", ["view", "rows_view"])
def test_ddp_hook_with_gradients_as_bucket_views_and_a_static_graph(agg, tmp_path, case: str) -> None:
    # DDP's memory-saving options: the gradients are the bucket's memory, which the hook sums in place.
    results = run_procs("ddp_case", 2, tmp_path, agg.address, case)
    for res in results:
        assert res["error"] is None and res["buckets"] > 0
        if case == "rows_view":
            assert res["tables"] == ["module.emb"] and res["rows_buckets"] >= 4 and not res["dropped"]
        torch.testing.assert_close(res["got"], res["expected"])
        torch.testing.assert_close(res["got"], results[0]["got"], rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_hook_on_colocated_shards_matches_gloo(tmp_path, world: int) -> None:
    results = run_procs("ddp_case", world, tmp_path, "colocated", "buckets")
    for res in results:
        assert res["error"] is None and res["buckets"] > 4
        torch.testing.assert_close(res["got"], res["expected"])
        torch.testing.assert_close(res["got"], results[0]["got"], rtol=0, atol=0)


def test_auto_mode_sends_dense_buckets_through_gloo(agg, tmp_path, monkeypatch) -> None:
    from omnireduce.model import CostParams

    # Fixed machine parameters (a 1 Gbit/s network), not whatever this host calibrated:
    # the test checks the mechanism, so the model's choice must not depend on the host.
    costs = CostParams(alpha=50e-6, beta=8e-9, full_duplex=True, cores=8).save(str(tmp_path / "costs.json"))
    monkeypatch.setenv("OMNIREDUCE_COSTS", costs)
    results = run_procs("auto_case", 2, tmp_path, agg.address, 8)
    for res in results:
        assert res["error"] is None
        torch.testing.assert_close(res["got"], res["expected"])
        unions = sorted(res["unions"].values())
        # Two buckets from step 1 on: the embedding's (a few rows of 100,000) and the MLP's (dense).
        assert unions[0] < 0.05 and unions[-1] > 0.9, res["unions"]
        # The dense bucket goes through gloo once its density is known; the sparse one never does.
        assert res["paths"]["dense"] >= 6 and res["paths"]["sparse"] >= 8, res["paths"]
        # The ranks vote once per new density measurement of a bucket (at most one per sparse
        # op), not at every bucket whose density is known (which would be 12 votes here).
        assert 1 <= res["votes"] <= res["paths"]["sparse"], res
    assert results[0]["paths"] == results[1]["paths"]
    assert results[0]["votes"] == results[1]["votes"]


@pytest.mark.parametrize("kind", ["ok", "negative", "one"])
def test_samples_on_the_dense_group_are_agreed_or_fail_on_every_rank(agg, tmp_path, kind: str) -> None:
    # The dense path used to apply samples unchecked: a negative one gave a wrong gradient, and
    # samples on one rank only aborted the process (gloo's collectives no longer paired).
    results = run_procs("dense_samples_case", 2, tmp_path, agg.address, kind)
    for res in results:
        if kind == "ok":
            # sum(n_i * g_i) / sum(n_i): rank r's gradient is 2 * (r + 1) per weight.
            torch.testing.assert_close(res["grad"], torch.full((1, 4), (3 * 2 + 5 * 4) / 8))
        else:
            why = "not a positive finite number" if kind == "negative" else "samples set on 1 of the 2 ranks only"
            assert res["grad"] is None and why in res["error"] and why in res["state_error"], res


def test_auto_mode_votes_stay_paired_after_an_op_failed_on_one_rank_only(agg, tmp_path) -> None:
    # Step 3's op succeeds on rank 0 and fails on rank 1: only rank 0 records its density. The
    # votes rest on call counts, so both vote at the same ops (once, at step 1: probe_every=100)
    # and rank 0 fails at once when rank 1 refuses its next op; before, rank 0 voted alone and
    # waited in gloo until its timeout (30 minutes by default), breaking the group.
    results = run_procs("auto_partial_failure_case", 2, tmp_path, agg.address)
    for rank, res in enumerate(results):
        outcomes = [o for _, o, _ in res["steps"]]
        assert outcomes[:3] == ["ok"] * 3, (rank, res)
        assert all(o != "ok" for o in outcomes[4 - rank:]) and max(t for _, _, t in res["steps"]) < 10, (rank, res)
        if rank == 0:
            assert outcomes[3] == "ok" and "PeerRefusedError" in outcomes[4], res
        else:
            assert "injected" in outcomes[3], res
    assert results[0]["votes"] == results[1]["votes"] >= 1


def test_auto_mode_ranks_that_disagree_take_the_sparse_path(agg, tmp_path, monkeypatch) -> None:
    """A rank whose model always says sparse outvotes the others: no rank enters gloo alone."""
    from omnireduce.model import CostParams

    costs = CostParams(alpha=50e-6, beta=8e-9, full_duplex=True, cores=8).save(str(tmp_path / "costs.json"))
    monkeypatch.setenv("OMNIREDUCE_COSTS", costs)
    results = run_procs("auto_case", 2, tmp_path, agg.address, 5, 1)
    for res in results:
        assert res["error"] is None
        torch.testing.assert_close(res["got"], res["expected"])
        assert res["paths"]["dense"] == 0 and res["votes"] >= 1, res


@pytest.mark.parametrize("world", [2, 3])
def test_weighted_gradients_equal_the_global_batch_gradient(agg, tmp_path, world: int) -> None:
    for res in run_procs("weighted_case", world, tmp_path, agg.address):
        torch.testing.assert_close(res["hook"], res["expected"])
        torch.testing.assert_close(res["backend"], res["expected"])
        # The bias the weights remove: plain averaging of unequal batches is a different model.
        gap = max(float((a - b).abs().max()) for a, b in zip(res["unweighted"], res["expected"], strict=True))
        assert gap > 1e-3


@pytest.mark.parametrize("case", ["rows", "rows_buckets", "rows_synced", "rows_auto"])
def test_hook_sends_tracked_embedding_rows_and_matches_gloo(agg, tmp_path, case: str) -> None:
    # "rows": one bucket (the table and the MLP), a 100,000-row table of which a step looks up
    # at most 64 rows; "rows_buckets": 1 kB buckets (the MLP's parameters apart from the
    # table's) and gradients accumulated over two forwards (no_sync), 3 ranks; "rows_synced":
    # two synced backward passes per step, the gradient not zeroed between them (rows the
    # first summed are nonzero on every rank when the second goes out), 3 ranks.
    world = 2 if case == "rows" else 3
    results = run_procs("ddp_case", world, tmp_path, agg.address, case)
    for res in results:
        assert res["error"] is None and res["tables"] == ["module.emb"] and not res["dropped"]
        assert res["rows_buckets"] >= 4, res
        torch.testing.assert_close(res["got"], res["expected"])
        torch.testing.assert_close(res["got"], results[0]["got"], rtol=0, atol=0)
    if case == "rows_auto":
        # The one bucket (table and MLP) holds a tracked table: sent as rows, never put to a vote.
        assert all(res["votes"] == 0 for res in results), results[0]["votes"]
    if case == "rows":
        stats = results[0]["stats"]
        # Only the looked-up rows were read: the mask pass over 1.6M elements never ran, and
        # the bytes are those of at most 64 rows (+ the MLP) a step.
        assert stats["bytes_sent"] < 0.01 * stats["dense_bytes"], stats


def test_a_table_read_outside_its_lookups_is_dropped_and_still_matches_gloo(agg, tmp_path) -> None:
    results = run_procs("ddp_case", 2, tmp_path, agg.address, "rows_misused")
    for res in results:
        # The first step's check finds gradient rows outside the ids: the table goes by the
        # mask pass from then on, on every rank alike, and the result stays gloo's.
        assert res["error"] is None and res["dropped"] == ["module.emb"] and res["rows_buckets"] == 0, res
        torch.testing.assert_close(res["got"], res["expected"])


@pytest.mark.parametrize("mode", ["sparse", "auto"])
def test_ranks_that_disagree_on_a_tracked_table_fail_on_every_rank(agg, tmp_path, mode: str) -> None:
    # In auto mode too: rank 0, its table dropped, takes the sparse protocol as the others do
    # (no vote, no dense collective that the others would never enter).
    results = run_procs("rows_disagree_case", 2, tmp_path, agg.address, mode)
    assert results[0]["dropped"] == ["module.emb"] and results[1]["dropped"] == []
    for res in results:
        # Rank 0 sent the bucket whole (mask pass), rank 1 its table as rows: the layouts
        # differ, and backward() raises on both, naming the failed bucket.
        assert res["error"] is not None, res
        name, is_runtime, text = res["error"]
        assert is_runtime and "omnireduce allreduce of DDP bucket" in text and "MismatchError" in text, res
        assert res["state_error"] == "MismatchError"


def test_a_bucket_refused_on_one_rank_fails_the_step_at_once_on_every_rank(agg, tmp_path) -> None:
    # Rank 0's worker refuses its first bucket of step 1 (the op timeout is 60 s): rank 0's hook
    # fails that bucket without raising, so DDP hands it the bucket after it (the embedding
    # table's), which it refuses too; rank 1's buckets both fail at once, and both ranks' ops
    # stay in step.
    results = run_procs("ddp_refusal_case", 2, tmp_path, agg.address)
    for rank, res in enumerate(results):
        assert len(res["errors"]) == 1, (rank, res)
        step, message, took = res["errors"][0]
        assert step == 1 and took < 10, (rank, step, took)
        assert "omnireduce allreduce of DDP bucket" in message, message
        if rank == 0:
            assert "ConfigError: weight must be" in message and "ConfigError" in res["state_error"]
        else:
            assert "PeerRefusedError" in message or "skipped after an earlier failure" in message, message
        torch.testing.assert_close(res["after"], torch.full((4,), 3.0))


@pytest.mark.parametrize("mode", ["dense", "auto"])
def test_a_failure_on_one_rank_fails_the_dense_groups_step_on_every_rank(agg, tmp_path, mode: str) -> None:
    # Every bucket of the dense model goes through gloo (dense mode, or auto mode's verdict after
    # step 0's measurement). Rank 0 fails alone before step 2: its buckets still join gloo's
    # allreduce and fail there; rank 1's sums succeed, and the pass's closing agreement fails
    # its step too, instead of letting it train on untold.
    results = run_procs("dense_failure_case", 2, tmp_path, agg.address, mode)
    for rank, res in enumerate(results):
        assert len(res["errors"]) == 1, (rank, res)
        step, message, took = res["errors"][0]
        assert step == 2 and took < 10, (rank, step, took, message)
        assert res["paths"]["dense"] > 0, res
        if rank == 0:
            assert "skipped after an earlier failure: injected" in message, message
        else:
            assert "another rank failed this step's DDP buckets" in message, message
            assert "another rank failed" in res["state_error"], res
        torch.testing.assert_close(res["after"], torch.full((4,), 3.0))


def test_an_op_refused_on_one_rank_fails_the_reducers_step_at_once_on_every_rank(agg, tmp_path) -> None:
    # GradientReducer: rank 0's worker refuses its first op of step 1 (op timeout 60 s); rank 0
    # refuses every bucket after it (dense, the sparse tables' joined op, the unused layer's),
    # so rank 1's synchronize() raises at once too, and the ranks' next ops pair up.
    results = run_procs("reducer_refusal_case", 2, tmp_path, agg.address)
    for rank, res in enumerate(results):
        assert len(res["errors"]) == 1, (rank, res)
        step, message, took = res["errors"][0]
        assert step == 1 and took < 10, (rank, step, took, message)
        if rank == 0:
            assert "weight must be" in message and "ConfigError" in res["error"], res
        else:
            assert "PeerRefusedError" in message, message
        torch.testing.assert_close(res["after"], torch.full((4,), 3.0))
    assert results[0]["buckets"] >= 3


def test_hook_traffic_is_a_fraction_of_dense(agg, tmp_path) -> None:
    (res, _) = run_procs("ddp_case", 2, tmp_path, agg.address, "traffic")
    stats = res["stats"]
    # 16 bags x 4 ids touch at most 64 of 100,000 embedding rows (16 floats each) a
    # step, so at most 64 of 6,250 blocks of the table are nonzero; the MLP is tiny.
    assert stats["bytes_sent"] < 0.03 * stats["dense_bytes"]
    torch.testing.assert_close(res["got"], res["expected"])


@pytest.mark.parametrize("world", [2, 3])
def test_reducer_without_ddp_matches_gloo(agg, tmp_path, world: int) -> None:
    for res in run_procs("reducer_case", world, tmp_path, agg.address):
        torch.testing.assert_close(res["got"], res["expected"])
        assert res["buckets"] > 1
        # One op per bucket per step and the count of ranks that used each parameter: no_sync
        # sent nothing.
        assert res["ops"] == (res["buckets"] + 1) * res["steps"]


def test_reducer_gives_a_parameter_some_ranks_used_its_zero_sum_on_every_rank(agg, tmp_path) -> None:
    # Left None where it was unused, momentum and weight decay moved it on rank 0 only.
    results = run_procs("reducer_unused_case", 2, tmp_path, agg.address)
    for res in results:
        torch.testing.assert_close(res["got"], res["expected"], rtol=0, atol=0)
        assert res["grads"][0] is not None and not res["grads"][0].any()  # extra, its own parameter, comes first
    torch.testing.assert_close(results[0]["got"], results[1]["got"], rtol=0, atol=0)


def test_reducer_weights_each_rank_by_its_samples(agg, tmp_path) -> None:
    # Unequal batches: sum(n_i * g_i) / sum(n_i), dense and sparse buckets alike.
    for res in run_procs("reducer_case", 3, tmp_path, agg.address, 3, "weighted"):
        torch.testing.assert_close(res["got"], res["expected"])


@pytest.mark.parametrize("where", ["aggregator", "colocated"])
def test_reducer_sends_sparse_embedding_gradients_as_their_rows(agg, tmp_path, where: str) -> None:
    # nn.Embedding(sparse=True) gives COO gradients, which the reducer's flat buckets could not hold.
    from tests.torch_procs import VOCAB

    steps = 4
    address = agg.address if where == "aggregator" else "colocated"
    for res in run_procs("reducer_case", 3, tmp_path, address, steps, "sparse"):
        torch.testing.assert_close(res["got"], res["expected"])
        # The gradients left for the optimizer have gloo's layouts: sparse for the tables.
        assert res["layouts"] == res["ref_layouts"]
        assert "torch.sparse_coo" in res["layouts"]
        # The two tables (one width) go as one op a step: the dense buckets' ops, one, and the
        # count of ranks that used each parameter.
        assert res["ops"] == res["buckets"] * steps
        # Only looked-up rows travel: far less than the 4000-row table once per step.
        assert res["bytes"]["bytes_sent"] < steps * VOCAB * 16 * 4 / 4


@pytest.mark.parametrize("case", ["rows", "rows_synced", "rows_misused", "rows_colocated"])
def test_reducer_sends_dense_embedding_gradients_as_their_rows(agg, tmp_path, case: str) -> None:
    # rows_colocated: every rank serves a shard, and each shard's part of a table is a strided view of it.
    steps = 3
    address = agg.address if case != "rows_colocated" else "colocated"
    case = case.removesuffix("_colocated")
    for res in run_procs("reducer_case", 3, tmp_path, address, steps, case):
        torch.testing.assert_close(res["got"], res["expected"])
        assert res["layouts"] == res["ref_layouts"]
        if case == "rows_misused":
            # Gradients outside the looked-up rows: its first check drops the table on every rank.
            assert res["tables"] == [] and res["dropped"] == ["emb"]
            continue
        assert res["tables"] == ["emb", "rare"] and res["dropped"] == []
        # Only looked-up rows travel (64 per pass, the no_sync pass's ids included: 128 a step,
        # with the rare table's and the MLP's bytes about 200 rows' worth; with two synced
        # passes the second also sends the first's summed rows again: about 3 x 64 more), where
        # the mask pass would send 256-element blocks of the 4000 x 16 table (about 57 KB a
        # step for 64 random rows, 200 KB for 256). Split over 3 shards, the MLP's small
        # buckets pad more blocks: the looser bound.
        rows_per_step = 4 * 64 if case == "rows" and address != "colocated" else 8 * 64
        assert res["bytes"]["bytes_sent"] < steps * rows_per_step * 16 * 4


def test_backend_collectives_and_ddp(agg, tmp_path) -> None:
    world = 3
    results = run_procs("backend_case", world, tmp_path, agg.address)
    for res in results:
        assert res["backend"] == "omnireduce"
        torch.testing.assert_close(res["all_reduce"], torch.arange(6, dtype=torch.float32) * 6)
        torch.testing.assert_close(res["broadcast"], torch.tensor([21, -7, 2**40 + 2]))
        for r, g in enumerate(res["all_gather"]):
            torch.testing.assert_close(g, torch.tensor([r, -0.5], dtype=torch.float16))
        torch.testing.assert_close(res["got"], res["expected"])
    want = {f"recv from {r}": torch.full((3,), float(r)) for r in range(1, world)}
    want[f"irecv from {world - 1}"] = torch.full((2,), 9.0)
    torch.testing.assert_close(results[0]["any_source"], want)


def _train_until_failure(*args: Any) -> None:
    from tests.torch_procs import train_until_failure

    train_until_failure(*args)


def test_killed_aggregator_fails_backward_on_every_rank(tmp_path) -> None:
    from worker.demo import start_daemon

    daemon, address = start_daemon(timeout=30)
    world, timeout = 2, 3.0
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    init = str(tmp_path / "init-kill")
    procs = [
        ctx.Process(target=_train_until_failure, args=(r, world, init, address, timeout, events), daemon=True)
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        ready = [events.get(timeout=120) for _ in procs]
        assert all(e[0] == "ready" for e in ready), ready
        daemon.kill()
        killed_at = time.time()
        daemon.wait()
        failed = [events.get(timeout=60) for _ in procs]
    finally:
        if daemon.poll() is None:
            daemon.kill()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for event in failed:
        assert event[0] == "failed", event
        _, rank, at, message, state_error = event
        # Within the worker's timeout (plus a step's worth of slack), never a hang.
        assert at - killed_at < timeout + 2.0, (rank, at - killed_at)
        assert "job='doomed'" in message, message
        # An op in flight when the aggregator died fails at once on the lost connection;
        # one started after it fails at the worker's timeout: either, never silence.
        causes = {"OpTimeoutError": "no answer from the aggregator",
                  "ConnectionLostError": "lost the connection to the aggregator"}
        cause = [c for c in causes if f"{c}: {causes[c]}" in message]
        assert len(cause) == 1, message
        assert causes[cause[0]] in state_error, state_error


def _free_port_pair() -> int:
    import socket

    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two neighbouring free ports")


@pytest.mark.parametrize("hook", ["omnireduce", "rows"])
def test_torchrun_example_trains(tmp_path, hook: str) -> None:
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun, "torchrun is not installed beside this Python"
    env = {k: v for k, v in os.environ.items() if k != "OMNIREDUCE_ADDRESS"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The example puts its aggregator on MASTER_PORT + 1: find two free neighbours.
    port = _free_port_pair()
    proc = subprocess.run(
        [torchrun, "--nproc_per_node", "2", "--master_port", str(port), "examples/train_ctr.py",
         "--steps", "10", "--log-every", "5", "--tables", "2", "--vocab", "20000", "--batch", "64", "--hook", hook],
        cwd=root, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step")]
    assert len(lines) == 2, proc.stdout
    assert "loss" in lines[-1] and "MB dense" in lines[-1]
    if hook == "rows":
        # Every step's bucket of tables went out as their looked-up rows.
        assert int(lines[-1].rsplit("buckets as rows", 1)[1]) >= 10, lines[-1]


@pytest.mark.parametrize("cap", [0, -1.0, float("nan"), "25"])
def test_reducer_refuses_a_bad_bucket_cap_as_a_config_error(cap: Any) -> None:
    import torch

    from omnireduce import ConfigError
    from worker.reducer import GradientReducer

    # NaN used to pass (every comparison with it is false) and a string raised a raw TypeError.
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        GradientReducer(torch.nn.Linear(2, 2), worker=None, bucket_cap_mb=cap)  # type: ignore[arg-type]


def _raise_memory_error(_grad: torch.Tensor) -> None:
    raise MemoryError("simulated")


def test_reducer_after_a_backward_that_raised_on_one_rank_fails_every_rank(agg) -> None:
    """Rank 0's backward raises after its first buckets went out (an OOM the loop catches, the
    batch skipped). Its next backward must not send the other buckets of a new step to pair with
    the other rank's old ones (a silent mix of two steps): every rank's reduction fails instead."""
    import threading

    from omnireduce import OmniReduceError
    from tests.helpers import run_ranks
    from worker import Worker
    from worker.reducer import GradientReducer

    done = threading.Barrier(2)  # neither worker closes (its BYE fails the other's ops) before both are done

    def rank(r: int) -> list[str]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
        outcomes = []
        with Worker(agg.address, rank=r, world_size=2, job="reducer-broken-step", timeout=10) as w:
            reducer = GradientReducer(model, w, bucket_cap_mb=1e-5)  # a bucket per parameter
            for step in range(3):
                model.zero_grad()
                loss = model(torch.full((1, 3), float(step + 1 + 10 * r))).sum()
                try:
                    if step == 1 and r == 0:
                        # Raised when the first layer's gradient comes: the last layer's buckets went out.
                        handle = model[0].weight.register_hook(_raise_memory_error)
                        try:
                            loss.backward()
                        finally:
                            handle.remove()
                    else:
                        loss.backward()
                    reducer.synchronize()
                    outcomes.append("ok")
                except (MemoryError, OmniReduceError) as e:
                    outcomes.append(type(e).__name__)
            done.wait(60)
        return outcomes

    out0, out1 = run_ranks(2, rank)
    assert out0 == ["ok", "MemoryError", "OmniReduceError"], out0
    assert out1[0] == "ok" and out1[1:] == ["PeerRefusedError", "OmniReduceError"], out1


def test_tracked_ids_are_the_lookup_time_ids(agg) -> None:
    """The ids of a tracked table are copied at the lookup: an input buffer refilled in place
    for the next micro-batch (gradient accumulation) does not replace the earlier ids."""
    from tests.helpers import run_ranks
    from worker import Worker
    from worker.reducer import GradientReducer

    micro = [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]  # per rank, per micro-batch

    def rank(r: int) -> torch.Tensor:
        torch.manual_seed(0)
        table = torch.nn.Embedding(10, 2)
        with Worker(agg.address, rank=r, world_size=2, job="tracked-ids-copied", timeout=10) as w:
            reducer = GradientReducer(table, w, embedding_rows=True, verify_every=0)
            buf = torch.empty(2, dtype=torch.long)
            with reducer.no_sync():
                buf.copy_(torch.tensor(micro[r][0]))
                table(buf).sum().backward()
            buf.copy_(torch.tensor(micro[r][1]))
            table(buf).sum().backward()
            reducer.synchronize()
        return table.weight.grad[:, 0].clone()

    expected = torch.tensor([0.0] + [0.5] * 8 + [0.0])
    for got in run_ranks(2, rank):
        torch.testing.assert_close(got, expected)
