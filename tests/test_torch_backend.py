"""The "omnireduce" torch.distributed backend as torch's users rely on it: failures raise on every
rank, sparse embedding gradients, integer and reduced-op all_reduce, groups, and no import needed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from aggregator import Aggregator  # noqa: E402
from omnireduce.errors import CollectiveError  # noqa: E402
from tests.helpers import run_procs  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def agg():
    a = Aggregator(timeout=60).start()
    yield a
    a.close()


def _same_sparse(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.is_sparse and got.is_coalesced()
    expected = expected.coalesce()
    # The same rows (the union of every rank's), the same sums within float rounding.
    torch.testing.assert_close(got.indices(), expected.indices(), rtol=0, atol=0)
    torch.testing.assert_close(got.values(), expected.values())


@pytest.mark.parametrize("how", ["hook", "backend", "sharded"])
def test_sparse_embeddings_train_under_ddp_as_on_gloo(agg, tmp_path, how: str) -> None:
    world = 2
    address = agg.address
    extra = None
    if how == "sharded":
        extra = Aggregator(timeout=60).start()
        address = f"{agg.address},{extra.address}"
    try:
        results = run_procs("sparse_ddp_case", world, tmp_path, address, how)
    finally:
        if extra is not None:
            extra.close()
    for res in results:
        torch.testing.assert_close(res["got"], res["expected"])
        for got, expected in zip(res["grads"], res["expected_grads"], strict=True):
            _same_sparse(got, expected)
        if how != "backend":
            assert res["paths"]["sparse"] > 0


def test_a_static_graphs_first_iteration_goes_out_and_weighs_each_step_anew(agg, tmp_path) -> None:
    """DDP(static_graph=True): its first iteration hung (a sparse gradient held for a bucket that
    never came), and the next one reused that iteration's samples share."""
    for res in run_procs("static_graph_case", 2, tmp_path, agg.address, timeout=120):
        torch.testing.assert_close(res["got"], res["expected"])


def test_failed_collectives_raise_on_every_rank(agg, tmp_path) -> None:
    results = run_procs("failure_case", 2, tmp_path, agg.address)
    for rank, res in enumerate(results):
        for name in ("sync", "wait", "future_wait", "future_value"):
            kind, is_runtime, message = res[name]
            # wait() raises the error itself; a torch future raises a RuntimeError naming it.
            assert is_runtime and (kind == "CollectiveError" or "CollectiveError: " in message), (rank, name, kind)
            assert "MismatchError" in message and "length: 10 vs 11" in message, (rank, name, message)
        assert res["sync"][0] == res["wait"][0] == "CollectiveError"
        for name in ("sync", "wait", "future_wait"):
            assert res[name + "_unchanged"], (rank, name)
        assert res["is_completed"]
        torch.testing.assert_close(res["after"], torch.full((4,), 3.0))
        if rank == 0:
            kind, _, message = res["timeout"]
            assert kind == "CollectiveError" and "OpTimeoutError" in message, message
        # DDP: the step where rank 0 sent a short bucket raises in backward on both ranks.
        for name, what in (("ddp_backend", "all_reduce"), ("ddp_hook", "DDP bucket")):
            assert len(res[name]) == 1, (rank, name, res[name])
            step, message = res[name][0]
            assert step == 2 and what in message and "MismatchError" in message, (rank, name, message)


def test_send_and_recv_deliver_what_gloo_delivers(agg, tmp_path) -> None:
    world = 3
    results = run_procs("p2p_case", world, tmp_path, agg.address)
    for rank, res in enumerate(results):
        for gloo, ours in zip(res["gloo"], res["omnireduce"], strict=True):
            assert ours.dtype == gloo.dtype and ours.shape == gloo.shape
            torch.testing.assert_close(ours, gloo, rtol=0, atol=0)
        if rank == 1:
            # Tags matched by tag, not by order.
            torch.testing.assert_close(res["omnireduce"][-2], torch.zeros(3))
            torch.testing.assert_close(res["omnireduce"][-1], torch.ones(3))
        errors = res["errors"]
        assert "CollectiveError" in errors["self"] and "another rank" in errors["self"], errors
        if rank in (0, 1):
            assert "CollectiveError" in errors["short"] and "MismatchError" in errors["short"], errors
        if rank == 1:
            torch.testing.assert_close(res["after"], torch.full((2,), 7.0))
    # The ring: each rank received what the previous rank sent (checked against gloo above,
    # and not all -1: the messages arrived).
    assert float(results[0]["omnireduce"][0].abs().sum()) > 0


def test_arguments_refused_on_one_rank_fail_the_collective_at_once_on_every_rank(agg, tmp_path) -> None:
    # Rank 1's arguments are wrong, the op timeout is 60 s: rank 1 raises its refusal in the
    # call, as gloo does, and rank 0 a CollectiveError naming rank 1 and why, both at once.
    results = run_procs("refusal_case", 2, tmp_path, agg.address)
    names = ["all_reduce", "all_reduce_max", "all_gather", "all_gather_into_tensor", "gather", "reduce_scatter",
             "all_to_all_single"]
    for name in names:
        (kind0, text0, took0), (kind1, text1, took1) = (res[name] for res in results)
        assert kind1 == "CollectiveError" and "PeerRefusedError" not in text1, (name, text1)
        assert kind0 == "CollectiveError" and "PeerRefusedError" in text0, (name, text0)
        assert "rank 1 refused the op: CollectiveError: " in text0, (name, text0)
        assert max(took0, took1) < 10, (name, took0, took1)
    for res in results:
        torch.testing.assert_close(res["after"], torch.full((4,), 3.0))


def test_a_groups_timeout_bounds_its_ops_unless_omnireduce_timeout_is_set(agg, tmp_path) -> None:
    # init_process_group/new_group(timeout=) as gloo honours it; OMNIREDUCE_TIMEOUT, the backend's
    # own setting, wins over it; torch's 30-minute default leaves the worker's (60 s).
    results = run_procs("group_timeout_case", 2, tmp_path, agg.address)
    for res in results:
        assert (res["torch_default"], res["given"], res["env_wins"]) == (60.0, 1.5, 2.5), res
    res = results[0]
    for name, seconds in (("given", 1.5), ("env_wins", 2.5)):
        assert "OpTimeoutError" in res[name + "_error"], res
        assert seconds - 0.1 <= res[name + "_waited"] < seconds + 3, res


def test_a_failed_coalesced_sparse_op_raises_on_every_rank(agg, tmp_path) -> None:
    # Two sparse tables go as one rows op; rank 0's op of step 2 claims a row more: both
    # ranks' backward raises at step 2 (each held gradient's future fails), none hangs.
    results = run_procs("sparse_failure_case", 2, tmp_path, agg.address)
    for rank, res in enumerate(results):
        assert len(res["errors"]) == 1, (rank, res)
        step, message = res["errors"][0]
        assert step == 2 and "DDP bucket" in message and "MismatchError" in message, (rank, message)
        assert "MismatchError" in res["recorded"]
        # Steps 0 and 1 went through (2 sparse buckets each; one op from step 1 on), then the failed step's.
        assert res["paths"]["sparse"] >= 6, res["paths"]


def test_init_process_group_needs_no_project_import(agg, tmp_path) -> None:
    # A fresh interpreter that imports torch only: the entry point registers the backend.
    script = textwrap.dedent(f"""
        import sys, torch, torch.distributed as dist
        assert "worker.backend" not in sys.modules and "zmq" not in sys.modules, "import torch loaded the backend"
        dist.init_process_group("omnireduce", init_method="file://{tmp_path}/init", rank=0, world_size=1)
        t = torch.arange(4.0)
        dist.all_reduce(t)
        print(dist.get_backend(), t.tolist(), type(dist.group.WORLD).__name__)
        dist.destroy_process_group()
    """)
    env = {**os.environ, "OMNIREDUCE_ADDRESS": agg.address, "OMNIREDUCE_JOB": "entry-point"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[0] == "omnireduce [0.0, 1.0, 2.0, 3.0] OmniReduceProcessGroup", proc.stdout


@pytest.mark.parametrize("job", [None, "remade"])
def test_a_default_group_made_again_pairs_its_ranks_ops(agg, tmp_path, job: str | None) -> None:
    # destroy_process_group then init_process_group over the same store: without
    # OMNIREDUCE_JOB rank 1 read the last making's job id from the store (every op timed out);
    # with it, the new group met the old one's failed ops (rank 0 left two pending).
    script = textwrap.dedent("""
        import os, torch, torch.distributed as dist
        from datetime import timedelta
        rank = int(os.environ["RANK"])
        groups = []  # kept: the store (and its counts) outlives each making, as torch may keep it
        for making in range(3):
            dist.init_process_group("omnireduce", init_method="file://" + os.environ["STORE"], rank=rank,
                                    world_size=2, timeout=timedelta(seconds=10))
            groups.append(dist.group.WORLD)
            if making == 0 and rank == 0:
                pending = dist.all_reduce(torch.ones(2), async_op=True)  # never met by rank 1
            x = torch.ones(2) * (rank + 1) if making else torch.zeros(0)
            if making:
                dist.all_reduce(x)
            print(making, dist.group.WORLD.worker.job, x.tolist(), flush=True)
            dist.destroy_process_group()
    """)
    env = {**os.environ, "OMNIREDUCE_ADDRESS": agg.address, "STORE": str(tmp_path / "store")}
    env.pop("OMNIREDUCE_JOB", None)
    if job:
        env["OMNIREDUCE_JOB"] = job
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        lines = [line.split(" ", 2) for line in out.strip().splitlines()]
        assert [(n, x) for n, _, x in lines] == [("0", "[]"), ("1", "[3.0, 3.0]"), ("2", "[3.0, 3.0]")], out
        jobs = [j for _, j, _ in lines]
        assert len(set(jobs)) == 3, jobs  # each making a job of its own
        if job:
            assert jobs == ["remade", "remade~1", "remade~2"], jobs


def test_import_torch_survives_a_broken_backend(tmp_path) -> None:
    # The entry point must never make `import torch` fail, whatever goes wrong in it.
    script = textwrap.dedent("""
        import torch.distributed
        from worker import autoload
        torch.distributed.Backend.register_backend = None   # registering now raises TypeError
        torch.distributed.Backend._plugins.pop("OMNIREDUCE", None)
        autoload.register()
        print("survived", "OMNIREDUCE" in torch.distributed.Backend._plugins)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "survived False"
    assert "could not register" in proc.stderr


def test_import_torch_beside_a_users_worker_module_neither_fails_nor_runs_it(tmp_path) -> None:
    # torch imports an entry point's module outside any handler of ours: with the entry point in
    # `worker`, a user's own worker.py in the current directory ran at `import torch`, and
    # torch then failed ("Failed to load the backend extension: omnireduce").
    (tmp_path / "worker.py").write_text('print("the user\'s worker ran")\n')
    script = "import torch, torch.distributed as dist; print('imported', 'OMNIREDUCE' in dist.Backend._plugins)"
    proc = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "imported False", proc.stdout
    assert "is not registered: 'worker' here is" in proc.stderr


def test_collectives_equal_gloo_for_the_dtypes_and_shapes_torch_sends(agg, tmp_path) -> None:
    world = 3
    results = run_procs("collectives_case", world, tmp_path, agg.address)
    for rank, res in enumerate(results):
        groups = res.pop("groups")
        # Output split sizes that do not add up to the output's rows: refused before any op.
        assert "output split sizes" in res.pop("all_to_all_refused")
        disagree = res.pop("all_to_all_disagree")
        if rank == 0:
            assert "CollectiveError" in disagree and "rank 0 expects" in disagree, disagree
        else:
            assert disagree is None
        for name, (gloo, ours) in res.items():
            if name == "sum_sparse":
                _same_sparse(ours, gloo)
            elif name.startswith("all_gather") or name == "all_to_all_ragged":
                for a, b in zip(ours, gloo, strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
            else:
                exact = not name.endswith(("_float", "_0dim", "_noncontiguous"))
                tol = dict(rtol=0, atol=0) if exact else {}
                torch.testing.assert_close(ours, gloo, **tol, msg=lambda m, name=name: f"{name}: {m}")
        # int32 sums really overflowed (so wraparound was checked), int64 went beyond 2**53.
        assert int(res["sum_torch.int64"][0].abs().max()) > 2**53
        # Groups: every group a job of its own, derived from OMNIREDUCE_JOB.
        world_job, sub_job = groups["jobs"]
        assert world_job.startswith("collectives.") and sub_job.startswith("collectives.") and world_job != sub_job
        if rank in (0, 1):
            t, job, size = groups["pair"]
            torch.testing.assert_close(t, torch.full((3,), 3.0))
            assert size == 2 and job not in (world_job, sub_job)
        torch.testing.assert_close(groups["after_destroy"], torch.full((2,), 3.0))


def test_gather_outputs_of_another_dtype_or_size_are_refused() -> None:
    """Called on the group directly (torch's Python all_gather checks this itself): gathered
    float32 bytes used to be read as int32 outputs of the same size."""
    from worker.backend import CollectiveError, OmniReduceProcessGroup

    class NoWorker:
        job = "none"
        refused: list[tuple[str, int]] = []

        def allreduce_async(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("refused before any op")

        def refuse(self, error: BaseException, x: torch.Tensor, weight: float | None = None) -> None:
            self.refused.append((str(error), x.numel() * x.element_size(), weight))

    worker = NoWorker()
    group = OmniReduceProcessGroup(0, 2, worker)  # type: ignore[arg-type]
    x = torch.ones(4)
    for bad in (torch.zeros(4, dtype=torch.int32), torch.zeros(3)):
        with pytest.raises(CollectiveError, match="does not match"):
            group.allgather([[torch.zeros(4), bad]], [x])
        opts = _gather_options(0)
        with pytest.raises(CollectiveError, match="does not match"):
            group.gather([[torch.zeros(4), bad]], [x], opts)
    # Each refusal numbered the one op the collective sends (2 ranks x 16 bytes) on this rank.
    assert [n for _, n, _ in worker.refused] == [32] * 4 and "does not match" in worker.refused[0][0]
    # A weighted AVG is refused as the weighted op it would have been (a sharded worker sends
    # those to every shard); MAX's gather of 2 x 16 bytes is not weighted.
    worker.refused.clear()
    group.samples = 3.0
    for op in (torch.distributed.ReduceOp.AVG, torch.distributed.ReduceOp.MAX):
        opts = torch.distributed.AllreduceOptions()
        opts.reduceOp = op
        with pytest.raises(CollectiveError, match="does not support torch.bool|sparse"):
            group.allreduce([torch.ones(4, dtype=torch.bool) if op == torch.distributed.ReduceOp.AVG
                             else torch.ones(4).to_sparse()], opts)
    assert [(n, w) for _, n, w in worker.refused] == [(4, 3.0), (32, None)]


def _gather_options(root: int) -> object:
    opts = torch.distributed.GatherOptions()
    opts.rootRank = root
    return opts


def test_wait_with_a_timeout_raises_while_the_collective_runs_and_not_after() -> None:
    from concurrent.futures import Future
    from datetime import timedelta

    from worker.backend import CollectiveError, OmniReduceWork

    part: Future = Future()
    t = torch.zeros(3)
    work = OmniReduceWork([(part, lambda out: t.copy_(out))], [t], "all_reduce of (3,) float32")
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=r"did not complete within 0.2 s"):
        work.wait(timedelta(seconds=0.2))
    assert 0.19 <= time.monotonic() - start < 5 and not work.is_completed()
    part.set_result(torch.ones(3))  # it went on, and completes
    # torch's C++ callers pass 0 for no timeout.
    assert work.wait(timedelta(0)) and work.wait(timedelta(seconds=1)) and work.is_success()
    torch.testing.assert_close(t, torch.ones(3))


def test_send_after_shutdown_is_a_clear_error(agg) -> None:
    from worker import Worker
    from worker.backend import CollectiveError, OmniReduceProcessGroup

    group = OmniReduceProcessGroup(0, 2, Worker(agg.address, rank=0, world_size=2, job="p2p-shut", timeout=5))
    work = group.send([torch.ones(2)], 1, 0)  # opens the pair's link; never received
    group.shutdown()
    with pytest.raises(CollectiveError):
        work.wait()  # failed by the shutdown, not left waiting
    for call in (lambda: group.send([torch.ones(2)], 1, 0), lambda: group.recv([torch.ones(2)], 1, 0)):
        with pytest.raises(CollectiveError, match="shut down"):
            call()


def _p2p_groups(agg: Any, job: str, world: int, timeout: float = 10, **options: Any) -> list[Any]:
    from worker import Worker
    from worker.backend import OmniReduceProcessGroup

    store = dist.HashStore()  # one process plays every rank: the store is shared in memory
    return [OmniReduceProcessGroup(r, world, Worker(agg.address, rank=r, world_size=world, job=job, timeout=timeout,
                                                    **options), store=store) for r in range(world)]


def test_set_timeout_bounds_the_ops_in_flight_and_those_to_come(agg) -> None:
    # torch's ProcessGroup.set_timeout; the aggregator (60 s) and the group (30 s) would wait
    # far longer. Rank 1 never calls: each op fails at the timeout set last.
    from datetime import timedelta

    from omnireduce.errors import ConfigError
    from worker.backend import CollectiveError

    ranks = _p2p_groups(agg, "set-timeout", 2, timeout=30)
    try:
        work = ranks[0].allreduce([torch.ones(3)])
        recv = ranks[0].recv([torch.zeros(2)], 1, 0)  # a pair link made before the call
        ranks[0].set_timeout(timedelta(seconds=1))
        t0 = time.monotonic()
        for w in (work, recv):
            with pytest.raises(CollectiveError, match=r"OpTimeoutError.*for 1 s"):
                w.wait()
        assert time.monotonic() - t0 < 10
        ranks[0].set_timeout(timedelta(seconds=0.5))
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match=r"OpTimeoutError.*for 0.5 s"):
            ranks[0].allreduce([torch.ones(3)]).wait()
        with pytest.raises(CollectiveError, match=r"within 0.5 s"):
            ranks[0].recv_anysource([torch.zeros(2)], 0).wait()
        assert time.monotonic() - t0 < 10
        for bad in (timedelta(0), timedelta(seconds=-1), 5):
            with pytest.raises(ConfigError, match="timeout"):
                ranks[0].set_timeout(bad)
        assert ranks[0].worker.timeout == 0.5
    finally:
        for g in ranks:
            g.shutdown()


def test_recv_from_any_source_takes_a_message_no_other_recv_took(agg) -> None:
    ranks = _p2p_groups(agg, "p2p-any", 3)
    try:
        sends = [ranks[1].send([torch.full((3,), 1.0)], 0, 0)]
        # Rank 1's first message goes to the recv that names it, so the recv from any source
        # that follows takes rank 2's, though rank 1's was counted first.
        first = torch.zeros(3)
        ranks[0].recv([first], 1, 0).wait()
        sends.append(ranks[2].send([torch.full((3,), 2.0)], 0, 0))
        got = torch.zeros(3)
        work = ranks[0].recv_anysource([got], 0)
        assert work._source_rank() == 2
        torch.testing.assert_close(got, torch.full((3,), 2.0))
        # A second message of rank 1, and one of another tag, which this recv does not take.
        sends.append(ranks[2].send([torch.full((2,), 7.0)], 0, 5))
        sends.append(ranks[1].send([torch.full((3,), 3.0)], 0, 0))
        again = torch.zeros(3)
        assert ranks[0].recv_anysource([again], 0)._source_rank() == 1
        torch.testing.assert_close(again, torch.full((3,), 3.0))
        tagged = torch.zeros(2)
        assert ranks[0].recv_anysource([tagged], 5)._source_rank() == 2
        torch.testing.assert_close(tagged, torch.full((2,), 7.0))
        for s in sends:
            s.wait()
        torch.testing.assert_close(first, torch.full((3,), 1.0))
    finally:
        for g in ranks:
            g.shutdown()


def test_a_message_refused_for_the_frame_limit_still_counts_for_recv_from_any_source(agg) -> None:
    # The refused receive was numbered but not counted: a later recv from any source then
    # waited on the refused sender and never took another rank's message.
    from worker.backend import CollectiveError

    ranks = _p2p_groups(agg, "p2p-limit", 3, timeout=5, max_message_bytes=1 << 20)
    try:
        for work in (ranks[1].send([torch.ones(1 << 19)], 0, 0), ranks[0].recv([torch.zeros(1 << 19)], 1, 0)):
            with pytest.raises(CollectiveError, match="LimitError"):
                work.wait()
        send = ranks[2].send([torch.full((3,), 2.0)], 0, 0)
        got = torch.zeros(3)
        assert ranks[0].recv_anysource([got], 0)._source_rank() == 2
        send.wait()
        torch.testing.assert_close(got, torch.full((3,), 2.0))
    finally:
        for g in ranks:
            g.shutdown()


def test_recv_from_any_source_fails_clearly(agg) -> None:
    from worker.backend import CollectiveError

    ranks = _p2p_groups(agg, "p2p-any-fail", 2, timeout=1)
    try:
        for tensors, match in (([torch.ones(2), torch.ones(2)], "one tensor"),
                               ([torch.ones(4).to_sparse()], "dense")):
            with pytest.raises(CollectiveError, match=match):
                ranks[0].recv_anysource(tensors, 0)
        # Nobody sends: the group's op timeout (1 s here) ends it, naming the ranks.
        t0 = time.monotonic()
        work = ranks[0].recv_anysource([torch.zeros(2)], 0)
        with pytest.raises(CollectiveError, match=r"OpTimeoutError.*no rank sent a message within 1 s.*ranks=\[1\]"):
            work.wait()
        assert time.monotonic() - t0 < 5
        with pytest.raises(CollectiveError, match="OpTimeoutError"):
            work._source_rank()
        # A message sent after that timeout is still taken by the next recv.
        send = ranks[1].send([torch.full((2,), 4.0)], 0, 0)
        t = torch.zeros(2)
        assert ranks[0].recv_anysource([t], 0)._source_rank() == 1
        send.wait()
        torch.testing.assert_close(t, torch.full((2,), 4.0))
        # One still waiting when the group shuts down fails then, not at its timeout.
        waiting = ranks[0].recv_anysource([torch.zeros(2)], 0)
        ranks[0].shutdown()
        with pytest.raises(CollectiveError, match="shut down"):
            waiting.wait()
        with pytest.raises(CollectiveError, match="only a recv from any source"):
            ranks[1].send([torch.ones(1)], 0, 3)._source_rank()
    finally:
        for g in ranks:
            g.shutdown()


def test_recv_from_any_source_serves_tags_apart_and_senders_in_turn(agg) -> None:
    ranks = _p2p_groups(agg, "p2p-any-turn", 3)
    try:
        # Posted for tag 1 first, while rank 1 sends tag 0 first: each tag is served on its own,
        # so neither waits for the other (a send completes once it is received).
        one, zero = torch.zeros(1), torch.zeros(1)
        w1, w0 = ranks[0].recv_anysource([one], 1), ranks[0].recv_anysource([zero], 0)
        sends = [ranks[1].send([torch.full((1,), 10.0)], 0, 0), ranks[1].send([torch.full((1,), 11.0)], 0, 1)]
        assert (w0._source_rank(), w1._source_rank()) == (1, 1)
        torch.testing.assert_close((zero, one), (torch.full((1,), 10.0), torch.full((1,), 11.0)))
        # Rank 1 has two messages waiting and rank 2 one: the senders are taken in turn.
        sends += [ranks[1].send([torch.full((1,), 1.0)], 0, 2), ranks[1].send([torch.full((1,), 1.5)], 0, 2),
                  ranks[2].send([torch.full((1,), 2.0)], 0, 2)]
        got = [torch.zeros(1) for _ in range(3)]
        works = [ranks[0].recv_anysource([g], 2) for g in got]
        sources = [w._source_rank() for w in works]
        torch.testing.assert_close(got, [torch.full((1,), float(v)) for v in (1.0, 2.0, 1.5)])
        assert sources == [1, 2, 1]
        for s in sends:
            s.wait()
    finally:
        for g in ranks:
            g.shutdown()


def test_a_send_whose_count_the_store_refuses_sends_nothing(agg) -> None:
    from worker import Worker
    from worker.backend import CollectiveError, OmniReduceProcessGroup

    class BrokenStore:
        def add(self, key: str, n: int) -> int:
            raise RuntimeError("store is gone")

    store = BrokenStore()
    ranks = [OmniReduceProcessGroup(r, 2, Worker(agg.address, rank=r, world_size=2, job="p2p-store", timeout=5),
                                    store=store) for r in range(2)]
    try:
        with pytest.raises(CollectiveError, match="nothing was sent.*store is gone"):
            ranks[1].send([torch.ones(2)], 0, 0).wait()
        with pytest.raises(CollectiveError, match="store failed.*store is gone"):
            ranks[0].recv_anysource([torch.zeros(2)], 0).wait()
        # The pair link took no message: a send counted by a store that works goes through.
        ranks[1]._store = ranks[0]._store = dist.HashStore()
        for g in ranks:
            g._p2p._store = g._store
        send, t = ranks[1].send([torch.full((2,), 5.0)], 0, 0), torch.zeros(2)
        ranks[0].recv([t], 1, 0).wait()
        send.wait()
        torch.testing.assert_close(t, torch.full((2,), 5.0))
    finally:
        for g in ranks:
            g.shutdown()


def test_bytes_with_one_owner_are_sent_as_the_widest_integers_their_length_and_offset_allow() -> None:
    from worker.tensorbytes import bytes_of, wide

    base = torch.arange(12, dtype=torch.float32)
    cases = [(base, torch.int64), (base[1:], torch.int32), (base[:3], torch.int32),
             (torch.arange(6, dtype=torch.float16), torch.int32), (torch.arange(3, dtype=torch.float16), torch.int16),
             (torch.arange(5, dtype=torch.uint8), torch.uint8), (torch.zeros(0), torch.uint8)]
    for t, dtype in cases:
        data = bytes_of(t)
        widened = wide(data)
        assert widened.dtype == dtype, (t, widened.dtype)
        # A view of the same bytes: the in-place receive of a message writes the caller's buffer.
        assert widened.numel() == 0 or widened.data_ptr() == data.data_ptr()
        assert torch.equal(widened.view(torch.uint8) if widened.numel() else widened, data)


def test_all_to_all_returns_at_once_and_later_collectives_keep_their_numbers(agg) -> None:
    # One thread plays both ranks: rank 0's all_to_all must return before rank 1 calls its own
    # (it waited for the split table before), and a collective called on both ranks while the
    # chunks are still out pairs up with its counterpart, not with the chunks' op.
    ranks = _p2p_groups(agg, "a2a-async", 2)
    try:
        ins = [torch.arange(3, dtype=torch.float64) + 10 * r for r in range(2)]  # rank r sends 1 + r, 2 - r rows
        outs = [torch.zeros(3, dtype=torch.float64) for _ in range(2)]
        splits_in, splits_out = [[1, 2], [2, 1]], [[1, 2], [2, 1]]
        t0 = time.monotonic()
        works = [ranks[r].alltoall_base(outs[r], ins[r], splits_out[r], splits_in[r]) for r in range(2)]
        sums = [torch.full((2,), float(r + 1)) for r in range(2)]
        after = [ranks[r].allreduce([sums[r]]) for r in range(2)]
        again = [torch.zeros(3, dtype=torch.float64) for _ in range(2)]
        works += [ranks[r].alltoall_base(again[r], ins[r], splits_out[r], splits_in[r]) for r in range(2)]
        for w in works + after:
            w.wait()
        assert time.monotonic() - t0 < 30
        # Rank 0 keeps its row 0 and takes rank 1's rows 0-1; rank 1 takes rank 0's rows 1-2 and keeps its row 2.
        want = [torch.tensor(v, dtype=torch.float64) for v in ([0.0, 10.0, 11.0], [1.0, 2.0, 12.0])]
        for r in range(2):
            torch.testing.assert_close(outs[r], want[r])
            torch.testing.assert_close(again[r], want[r])
            torch.testing.assert_close(sums[r], torch.full((2,), 3.0))
    finally:
        for g in ranks:
            g.shutdown()


def _outcome(work: Any) -> str:
    try:
        work.wait()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the test compares what each rank saw
        return f"{type(e).__name__}: {e}"


def test_rooted_collectives_whose_tensors_differ_by_a_few_bytes_fail_on_every_rank(agg) -> None:
    # Padded to 8 bytes, 5 and 6 float32 (or 8 and 6 int8 scattered) are ops of one length:
    # the other rank took the root's first bytes, or kept a padding zero. gloo refuses them.
    ranks = _p2p_groups(agg, "few-bytes", 2)
    try:
        for sizes in ((6, 5), (5, 6)):
            ts = [torch.arange(1.0, sizes[r] + 1) * (r + 1) for r in range(2)]
            works = [ranks[r].broadcast([ts[r]], dist.BroadcastOptions()) for r in range(2)]
            for r, w in enumerate(works):
                assert "the ranks' tensors differ in size" in _outcome(w), (sizes, r)
                torch.testing.assert_close(ts[r], torch.arange(1.0, sizes[r] + 1) * (r + 1))
        outs = [torch.zeros(4 - r, dtype=torch.int8) for r in range(2)]
        ins = [[[torch.arange(4, dtype=torch.int8), torch.arange(4, 8, dtype=torch.int8)]], []]
        works = [ranks[r].scatter([outs[r]], ins[r], dist.ScatterOptions()) for r in range(2)]
        for r, w in enumerate(works):
            assert "the ranks' tensors differ in size" in _outcome(w), r
            assert not outs[r].any()
        # The ranks' ops are still in step.
        ts = [torch.full((5,), float(r)) for r in range(2)]
        assert [_outcome(w) for w in [ranks[r].broadcast([ts[r]], dist.BroadcastOptions()) for r in range(2)]] == \
            ["ok", "ok"]
        torch.testing.assert_close(ts, [torch.zeros(5)] * 2)
    finally:
        for g in ranks:
            g.worker.close()


def test_rooted_collectives_whose_ranks_name_different_roots_fail_on_every_rank(agg) -> None:
    # Each rank names itself the root: gloo's ranks then wait for each other until their
    # timeout; here the two "roots'" bytes would be summed into the result, so both fail, and
    # nothing is written.
    ranks = _p2p_groups(agg, "two-roots", 2)
    try:
        bcast = [dist.BroadcastOptions() for _ in range(2)]
        scatter = [dist.ScatterOptions() for _ in range(2)]
        for r in range(2):
            bcast[r].rootRank = scatter[r].rootRank = r
        ts = [torch.full((3,), float(r + 1)) for r in range(2)]
        works = [ranks[r].broadcast([ts[r]], bcast[r]) for r in range(2)]
        for r, w in enumerate(works):
            assert "the ranks named different roots" in _outcome(w), r
            torch.testing.assert_close(ts[r], torch.full((3,), float(r + 1)))
        outs = [torch.zeros(2) for _ in range(2)]
        works = [ranks[r].scatter([outs[r]], [[torch.ones(2), torch.ones(2)]], scatter[r]) for r in range(2)]
        for r, w in enumerate(works):
            assert "the ranks named different roots" in _outcome(w), r
        # Named alike, the root may be any rank; and the ranks' ops are still in step.
        for r in range(2):
            bcast[r].rootRank = scatter[r].rootRank = 1
        works = [ranks[r].broadcast([ts[r]], bcast[r]) for r in range(2)]
        assert [_outcome(w) for w in works] == ["ok", "ok"]
        torch.testing.assert_close(ts, [torch.full((3,), 2.0)] * 2)
        works = [ranks[r].scatter([outs[r]], [[torch.ones(2), torch.full((2,), 5.0)]] if r == 1 else [], scatter[r])
                 for r in range(2)]
        assert [_outcome(w) for w in works] == ["ok", "ok"]
        torch.testing.assert_close(outs, [torch.ones(2), torch.full((2,), 5.0)])
    finally:
        for g in ranks:
            g.worker.close()


def test_gathering_works_hold_what_gloos_do(agg) -> None:
    # Code written against gloo reads fut.value()[r] as rank r's tensor, and a barrier's as [].
    ranks = _p2p_groups(agg, "work-values", 2)
    try:
        outs = [[torch.zeros(2) for _ in range(2)] for _ in range(2)]
        works = [ranks[r].allgather([outs[r]], [torch.full((2,), float(r))]) for r in range(2)]
        for r, w in enumerate(works):
            w.wait()
            value = w.get_future().value()
            assert len(value) == 2 and all(v is o for v, o in zip(value, outs[r], strict=True))
            torch.testing.assert_close(value[1], torch.ones(2))
        works = [ranks[r].barrier() for r in range(2)]
        assert [w.get_future().wait() for w in works] == [[], []]
    finally:
        for g in ranks:
            g.worker.close()


def test_a_bitwise_reduction_of_floats_is_refused_in_the_call(agg) -> None:
    # As gloo refuses it; before, every rank's bytes went round first, and torch's kernel
    # error came from the result's writing.
    ranks = _p2p_groups(agg, "bitwise-floats", 2)
    try:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.BXOR
        with pytest.raises(CollectiveError, match="bitwise reductions take integer and bool tensors"):
            ranks[0].allreduce([torch.ones(3, dtype=torch.float16)], opts)
        outcome = _outcome(ranks[1].allreduce([torch.ones(3, dtype=torch.int16)], opts))
        assert "rank 0 refused the op" in outcome, outcome
        ints = [torch.tensor([3, 5], dtype=torch.int32) * (r + 1) for r in range(2)]
        assert [_outcome(w) for w in [ranks[r].allreduce([ints[r]], opts) for r in range(2)]] == ["ok", "ok"]
        torch.testing.assert_close(ints[0], torch.tensor([3 ^ 6, 5 ^ 10], dtype=torch.int32))
    finally:
        for g in ranks:
            g.worker.close()


def test_results_are_written_into_parameters(agg) -> None:
    # dist.broadcast(param, 0) syncs initial weights; the result is written on a communication
    # thread, where an in-place write into a leaf that requires grad would be refused.
    ranks = _p2p_groups(agg, "into-params", 2)
    try:
        params = [torch.nn.Parameter(torch.full((3,), float(r + 1))) for r in range(2)]
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        assert [_outcome(w) for w in [ranks[r].broadcast([params[r]], opts) for r in range(2)]] == ["ok", "ok"]
        got = torch.nn.Parameter(torch.zeros(3))
        works = [ranks[1].send([torch.full((3,), 5.0)], 0, 0), ranks[0].recv([got], 1, 0)]
        summed = [torch.nn.Parameter(torch.full((2,), float(r))) for r in range(2)]
        works += [ranks[r].allreduce([summed[r]]) for r in range(2)]
        assert [_outcome(w) for w in works] == ["ok"] * 4
        for p in params:
            torch.testing.assert_close(p.detach(), torch.full((3,), 1.0))
            assert p.requires_grad and p.grad is None
        torch.testing.assert_close(got.detach(), torch.full((3,), 5.0))
        for p in summed:
            torch.testing.assert_close(p.detach(), torch.full((2,), 1.0))
    finally:
        for g in ranks:
            g.shutdown()


def test_an_all_to_all_that_fails_on_one_rank_only_leaves_the_next_in_step() -> None:
    # Rank 0's own op timeout (1 s) ends its all_to_all before rank 1 calls; the aggregator's
    # (20 s) does not, so rank 1's split table completes and it sends its chunks. Rank 0 must
    # still number that chunk op (refused), or its next all_to_all would take rank 1's chunks
    # of this one.
    from worker import Worker
    from worker.backend import OmniReduceProcessGroup

    aggregator = Aggregator(timeout=20).start()
    store = dist.HashStore()
    ranks = [OmniReduceProcessGroup(r, 2, Worker(aggregator.address, rank=r, world_size=2, job="a2a-local-timeout",
                                                 timeout=(1, 8)[r]), store=store) for r in range(2)]
    try:
        def call(r: int, n: int) -> tuple[Any, torch.Tensor]:
            out = torch.zeros(2)
            return ranks[r].alltoall_base(out, torch.full((2,), float(100 * n + 10 * r)), [], []), out

        first0, _ = call(0, 1)
        assert "OpTimeoutError" in _outcome(first0)
        first1, _ = call(1, 1)
        started = time.monotonic()
        outcome = _outcome(first1)
        # Failed at once, naming rank 0's timeout, not after rank 1's own 8 s.
        assert "PeerRefusedError" in outcome and "rank 0" in outcome, outcome
        assert time.monotonic() - started < 5
        (second0, out0), (second1, out1) = call(0, 2), call(1, 2)
        assert [_outcome(second0), _outcome(second1)] == ["ok", "ok"]
        for out in (out0, out1):
            torch.testing.assert_close(out, torch.tensor([200.0, 210.0]))
    finally:
        for g in ranks:
            g.shutdown()
        aggregator.close()


def test_arguments_found_wrong_late_are_still_refused_on_every_rank(agg) -> None:
    # Each call is refused on rank 0 (raising there) and fails on rank 1 naming rank 0; the
    # all_reduce after each shows that the ranks' op numbers are still in step.
    ranks = _p2p_groups(agg, "late-refusals", 2)
    scatter = dist.ScatterOptions()
    scatter.rootRank = 0

    def refused_on_rank0(name: str, call: Any, expected: str) -> None:
        with pytest.raises(CollectiveError, match=expected):
            call(0)
        outcome = _outcome(call(1))
        assert "PeerRefusedError" in outcome and "rank 0 refused" in outcome, (name, outcome)
        ts = [torch.full((2,), float(r)) for r in range(2)]
        assert [_outcome(w) for w in [ranks[r].allreduce([ts[r]]) for r in range(2)]] == ["ok", "ok"], name
        torch.testing.assert_close(ts[0], torch.full((2,), 1.0))

    try:
        # The root's inputs: right in total, wrong one by one (gloo refuses them too).
        refused_on_rank0("scatter", lambda r: ranks[r].scatter(
            [torch.zeros(4)], [[torch.arange(2.0), torch.arange(6.0)]] if r == 0 else [], scatter),
            "does not match the output")
        # An output whose strides no view of world x the input fits.
        refused_on_rank0("all_gather_into_tensor", lambda r: ranks[r]._allgather_base(
            torch.zeros(2, 4).t() if r == 0 else torch.zeros(2, 4), torch.ones(4)), "cannot be viewed")
        refused_on_rank0("all_to_all_single", lambda r: ranks[r].alltoall_base(
            torch.zeros(2), torch.tensor(1.0) if r == 0 else torch.zeros(2), [], []), "0-dim")
        refused_on_rank0("all_to_all_single splits", lambda r: ranks[r].alltoall_base(
            torch.zeros(2), torch.zeros(2), [2, 1] if r == 0 else [], []), "split sizes")
        # The all_to_alls after the refused ones pair up too (they have ops of their own).
        outs = [torch.zeros(2) for _ in range(2)]
        works = [ranks[r].alltoall_base(outs[r], torch.tensor([10.0 * r, 10.0 * r + 1]), [], []) for r in range(2)]
        assert [_outcome(w) for w in works] == ["ok", "ok"]
        torch.testing.assert_close(outs, [torch.tensor([0.0, 10.0]), torch.tensor([1.0, 11.0])])
    finally:
        for g in ranks:
            g.shutdown()
