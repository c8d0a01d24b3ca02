"""torch's own distributed test suite, run on the "omnireduce" backend.

torch checks every backend with the same bodies: ``DistributedTest._DistTestBase``
in ``torch.testing._internal.distributed.distributed_test``. ``tests/dist_conformance.py``
runs them on our backend (an aggregator per test, one process per rank, a fresh
process group per test; see its docstring for how). This module runs an explicit
selection, one pytest case per torch test:

* :data:`PASSING` (at ``WORLD_SIZE`` 2), :data:`PASSING_4` (at 4: torch runs them only at
  exactly 4 ranks) and :data:`PASSING_GROUP` (at 8: torch runs its ``*_group`` tests, whose
  subgroup is ranks [1, 2], only from 8 ranks up) must pass.
* :data:`PENDING_BACKEND_FIXES`: tests of the lists above that fail today because
  the backend lacks something; they run as ``xfail(strict=True)``, so once the backend
  is fixed they XPASS, which fails, until they are removed from the constant.
* :data:`EXCLUDED`: every other test of the suite, with the reason (mostly: torch
  skips it on gloo on this CPU-only machine too). ``test_every_torch_test_is_accounted_for``
  checks that the lists cover the whole suite exactly, so a torch upgrade that
  adds a test fails here until someone sorts it.

The reference is gloo: every test of PASSING, PASSING_4 and PASSING_GROUP
passes on gloo here (``python -m tests.dist_conformance --backend gloo NAMES``; with
``--all``, the whole suite: 90 pass at WORLD_SIZE 2, the rest skip, in about 75 s; at 4,
93 pass, PASSING_4 and the gloo-only tests of EXCLUDED among them, in about 85 s). To rerun one test
by hand on omnireduce: ``python -m tests.dist_conformance test_all_reduce_sum``
(``WORLD_SIZE=4`` or ``8`` in the environment for PASSING_4 and the group tests; ``--trace DIR`` records what
each collective carried).

The runner runs once per module (three subprocesses, world sizes 2, 4 and 8) and only for
the cases pytest selected. Measured: about 100 s for the whole module on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
EXACT_WORLD_SIZE = 4
GROUP_WORLD_SIZE = 8
# Seconds one torch test may take (its collectives fail after OMNIREDUCE_TIMEOUT, 20 s).
TEST_TIMEOUT_S = 60
# Seconds a whole runner subprocess may take.
RUN_TIMEOUT_S = 600

PASSING: list[str] = [
    # process group basics
    "test_get_rank", "test_get_backend", "test_Backend_enum_class", "test_dump_DDP_relevant_env_vars",
    "test_get_rank_size_group", "test_get_rank_size_full_group", "test_destroy_group", "test_destroy_full_group",
    # barrier, broadcast, all_gather
    "test_barrier", "test_barrier_full_group",
    "test_broadcast", "test_broadcast_full_group",
    "test_all_gather", "test_all_gather_full_group", "test_all_gather_complex",
    "test_all_gather_object_default_pg", "test_all_gather_object_subgroup",
    "test_all_gather_coalesced_simple", "test_all_gather_coalesced_full_group", "test_all_gather_coalesced_complex",
    "test_all_gather_coalesced_with_empty",
    # all_reduce
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_sum_complex", "test_all_reduce_full_group_sum",
    "test_all_reduce_min", "test_all_reduce_max", "test_all_reduce_product",
    "test_all_reduce_full_group_min", "test_all_reduce_full_group_max", "test_all_reduce_full_group_product",
    "test_all_reduce_complex_unsupported_ops", "test_sparse_all_reduce_sum",
    "test_all_reduce_coalesced_sum", "test_all_reduce_coalesced_min", "test_all_reduce_coalesced_max",
    "test_all_reduce_coalesced_product", "test_all_reduce_coalesced_max_complex_unsupported",
    "test_all_reduce_coalesced_full_group_sum", "test_all_reduce_coalesced_full_group_min",
    "test_all_reduce_coalesced_full_group_max", "test_all_reduce_coalesced_full_group_product",
    "test_get_future",
    # DistributedDataParallel on CPU, no_sync
    "test_DistributedDataParallelCPU", "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad", "test_ddp_create_graph", "test_ddp_logging_data_cpu",
    "test_static_graph_api_cpu",
    "test_accumulate_gradients_no_sync", "test_accumulate_gradients_no_sync_grad_is_view",
    "test_accumulate_gradients_no_sync_allreduce_hook", "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_grads_same_across_ranks_with_no_sync",
    # reduce, gather, scatter (built on the same sums)
    "test_reduce_sum", "test_reduce_sum_twice", "test_reduce_min", "test_reduce_max", "test_reduce_product",
    "test_reduce_full_group_sum", "test_reduce_full_group_min", "test_reduce_full_group_max",
    "test_reduce_full_group_product",
    "test_gather", "test_gather_checks", "test_gather_full_group",
    "test_scatter", "test_scatter_checks", "test_scatter_complex", "test_scatter_full_group",
    "test_scatter_object_list",
    # point to point, relayed through the aggregator (worker.p2p)
    "test_send_recv", "test_send_recv_autograd_profiler", "test_send_recv_torch_profiler",
    "test_send_recv_with_tag", "test_send_recv_with_tag_autograd_profiler", "test_send_recv_with_tag_torch_profiler",
    "test_isend", "test_irecv", "test_isend_autograd_profiler", "test_isend_torch_profiler",
    "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags",
    "test_send_recv_any_source", "test_send_recv_any_source_autograd_profiler",
    "test_send_recv_any_source_torch_profiler",
]

# Run at EXACT_WORLD_SIZE ranks: torch skips them at any other world size.
PASSING_4: list[str] = [
    "test_gather_object", "test_gather_object_subgroup", "test_new_subgroups_with_group_param",
]

# Run at GROUP_WORLD_SIZE ranks; their group is the subgroup of ranks [1, 2].
PASSING_GROUP: list[str] = [
    "test_barrier_group", "test_broadcast_group", "test_all_gather_group", "test_all_gather_coalesced_group",
    "test_all_reduce_group_sum", "test_all_reduce_group_min", "test_all_reduce_group_max",
    "test_all_reduce_group_product",
    "test_all_reduce_coalesced_group_sum", "test_all_reduce_coalesced_group_min",
    "test_all_reduce_coalesced_group_max", "test_all_reduce_coalesced_group_product",
    "test_gather_group", "test_scatter_group", "test_reduce_group_sum", "test_reduce_group_min",
    "test_reduce_group_max", "test_reduce_group_product",
]

# Tests that fail today and must pass once the backend is fixed (xfail, strict; remove a test
# from here once it XPASSes): none left.
PENDING_BACKEND_FIXES: dict[str, str] = {}


_NOT_OURS: dict[str, str] = {
    # Pass on gloo, but test gloo-only features (their decorators say so).
    "test_barrier_timeout_full_group": "gloo-only ('Only gloo backend supports timeouts'): new_group(timeout=1 s) "
    "must time out a barrier in 1 s; omnireduce honours timeout= only where OMNIREDUCE_TIMEOUT is unset "
    "(test_torch_backend), and this runner sets it",
    "test_barrier_timeout_group": "gloo-only ('Only gloo backend supports timeouts'), as "
    "test_barrier_timeout_full_group",
    "test_monitored_barrier_gloo": "monitored_barrier is gloo-only in torch ('only implemented for GLOO backend')",
    "test_monitored_barrier_gloo_subgroup": "monitored_barrier is gloo-only in torch",
    "test_monitored_barrier_gloo_rank_0_timeout": "monitored_barrier is gloo-only in torch",
    "test_monitored_barrier_failure_order": "monitored_barrier is gloo-only in torch (needs WORLD_SIZE 8)",
    "test_monitored_barrier_wait_all_ranks": "monitored_barrier is gloo-only in torch (needs WORLD_SIZE 8)",
    # WORLD_SIZE-8 versions of unsupported collectives.
    # Skip on gloo at WORLD_SIZE 2 for their world size, and need CUDA at 8.
    "test_barrier_full_group_cuda": "CUDA tensors (the backend is CPU-only); skips on gloo here",
    "test_barrier_group_cuda": "CUDA tensors (the backend is CPU-only); skips on gloo here",
}

# Every other test of the suite: torch skips them on gloo on this machine (CPU only, WORLD_SIZE 2),
# by the reason given (CUDA, NCCL or MPI only, a world size of 4, or disabled by torch itself).
_SKIPPED_ON_GLOO: dict[str, list[str]] = {
    "Need at least 2 CUDA devices": [
        "test_1_level_hierarchical_model_averager_equivalent_to_periodic_model_averager",
        "test_DistributedSampler_padding", "test_average_parameters",
        "test_compute_bucket_assignment_by_size_sparse_error_without_logger", "test_ddp_apply_optim_in_backward",
        "test_ddp_apply_optim_in_backward_grad_as_bucket_view_false",
        "test_ddp_apply_optim_in_backward_ignored_params", "test_ddp_broadcast_buffer",
        "test_ddp_broadcast_buffer_via_hook", "test_ddp_broadcast_buffers_deprecation_warning",
        "test_ddp_bucket_cap_mb_list", "test_ddp_buffer_hook_allreduce",
        "test_ddp_buffer_hook_allreduce_return_future", "test_ddp_build_debug_param_to_name_mapping",
        "test_ddp_build_debug_param_to_name_mapping_requires_grad", "test_ddp_comm_hook_logging",
        "test_ddp_compile_static_graph", "test_ddp_control_flow_different_across_ranks",
        "test_ddp_control_flow_same_across_ranks", "test_ddp_device", "test_ddp_device_mesh_initialization",
        "test_ddp_forward_backward_hook", "test_ddp_grad_div_uneven_inputs", "test_ddp_hook_parity_allreduce",
        "test_ddp_hook_parity_allreduce_process_group", "test_ddp_hook_parity_post_localSGD",
        "test_ddp_hook_parity_powerSGD", "test_ddp_ignore_params_arg", "test_ddp_inference",
        "test_ddp_init_sync_buffers_with_forward_sync_buffers_false", "test_ddp_join_model_equivalence",
        "test_ddp_join_respects_forward_sync_buffers_false", "test_ddp_model_diff_num_params_across_ranks",
        "test_ddp_multiple_nested_unused_params_err_ignore_params", "test_ddp_multiple_nested_unused_params_error",
        "test_ddp_namedtuple", "test_ddp_native_mixed_precision_grad_as_bucket_view_no_set_grad_none",
        "test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none",
        "test_ddp_native_mixed_precision_ignored_params",
        "test_ddp_native_mixed_precision_no_grad_as_bucket_view_no_set_grad_none",
        "test_ddp_native_mixed_precision_no_grad_as_bucket_view_set_grad_to_none", "test_ddp_new_tensor_in_fwd",
        "test_ddp_new_tensor_in_fwd_static_graph", "test_ddp_profiling_torch_profiler",
        "test_ddp_python_error_logged", "test_ddp_remove_autograd_hooks", "test_ddp_returns_tensor_with_no_grad",
        "test_ddp_shared_grad_acc_unused_params", "test_ddp_sink_noclone", "test_ddp_static_graph_nested_types",
        "test_ddp_sync_module_states", "test_ddp_uneven_input_exception", "test_ddp_uneven_input_join_disable",
        "test_ddp_uneven_inputs", "test_ddp_uneven_inputs_stop_iteration_sync_bn",
        "test_ddp_unused_params_rebuild_buckets_exception", "test_ddp_zero_output_features",
        "test_detect_ddp_is_actually_static", "test_different_graph_across_ranks", "test_get_data_parallel_params",
        "test_invalid_static_graph", "test_monitored_barrier_allreduce_hang",
        "test_monitored_barrier_allreduce_hang_wait_all_ranks", "test_output_unused_in_loss_dict_module",
        "test_output_unused_in_loss_tuple_module", "test_periodic_model_averager",
        "test_periodic_model_averager_param_group", "test_post_localSGD_optimizer_parity",
        "test_post_localSGD_optimizer_parity_grad_is_view", "test_post_localSGD_optimizer_step_reload",
        "test_skip_all_reduce_unused_parameters", "test_stateless_api_with_ddp", "test_static_graph_multi_forward",
        "test_sync_bn_logged", "test_undefined_grad_parity_unused_parameters",
        "test_verify_model_across_rank_with_logger", "test_verify_model_across_rank_without_logger",
    ],
    "CUDA is not available.": [
        "test_DistributedDataParallel_SyncBatchNorm", "test_DistributedDataParallel_SyncBatchNorm_2D_Input",
        "test_DistributedDataParallel_SyncBatchNorm_Channels_Last",
        "test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_Running_Value",
        "test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_gradient",
        "test_DistributedDataParallel_SyncBatchNorm_No_Affine",
        "test_DistributedDataParallel_SyncBatchNorm_Single_Input_Per_Process",
        "test_DistributedDataParallel_SyncBatchNorm_half", "test_DistributedDataParallel_with_amp_and_grad_is_view",
        "test_all_reduce_sum_cuda", "test_all_reduce_sum_cuda_async", "test_all_reduce_sum_cuda_complex",
        "test_barrier_cuda", "test_broadcast_cuda", "test_ddp_logging_data_gpu",
        "test_new_subgroups_by_enumeration_negative_input_rank", "test_new_subgroups_group_size_exceeds_world_size",
        "test_sparse_all_reduce_sum_cuda",
    ],
    "Only Nccl supports CUDA all_to_all_single": [
        "test_all_to_all_group_cuda", "test_all_to_all_single_equal_split_cuda",
        "test_all_to_all_single_equal_split_cuda_complex", "test_all_to_all_single_equal_split_full_group_cuda",
        "test_all_to_all_single_equal_split_group_cuda", "test_all_to_all_single_unequal_split_cuda",
        "test_all_to_all_single_unequal_split_cuda_complex", "test_all_to_all_single_unequal_split_full_group_cuda",
        "test_all_to_all_single_unequal_split_group_cuda",
    ],
    "Only MPI supports CPU all_to_all_single": [
        "test_all_to_all_single_equal_split", "test_all_to_all_single_equal_split_complex",
        "test_all_to_all_single_equal_split_full_group", "test_all_to_all_single_equal_split_group",
        "test_all_to_all_single_unequal_split", "test_all_to_all_single_unequal_split_complex",
        "test_all_to_all_single_unequal_split_full_group", "test_all_to_all_single_unequal_split_group",
    ],
    "NCCL Batch Send Recv Only": [
        "test_batch_isend_irecv_mixed_backend_err", "test_batch_isend_irecv_nccl",
        "test_batch_isend_irecv_no_rank_zero_nccl", "test_batch_isend_irecv_op_err",
        "test_batch_isend_irecv_op_list_err", "test_batch_isend_irecv_ring_exchange_nccl",
        "test_batch_isend_irecv_self_nccl",
    ],
    # Skips at 2; at 4 (where the others of this reason are in PASSING_4) it needs 4 CUDA devices.
    "Test requires an exact world size of 4": [
        "test_3_level_hierarchical_model_averager",
    ],
    "Only MPI supports all_to_all": [
        "test_all_to_all", "test_all_to_all_complex", "test_all_to_all_full_group", "test_all_to_all_group",
    ],
    "Test requires backend gloo to be one of {'nccl'}": [
        "test_nccl_backend_bool_allgather", "test_nccl_backend_bool_allreduce", "test_nccl_backend_bool_broadcast",
        "test_nccl_backend_bool_reduce",
    ],
    "Only NCCL supports CUDA all_to_all": [
        "test_all_to_all_cuda", "test_all_to_all_cuda_complex", "test_all_to_all_full_group_cuda",
    ],
    "Only Nccl supports CUDA gather": [
        "test_gather_cuda", "test_scatter_cuda", "test_scatter_cuda_complex",
    ],
    "Test requires world size of 4": [
        "test_new_subgroups_by_enumeration_input_rank_exceeds_world_size", "test_new_subgroups_overlap_not_allowed",
        "test_new_subgroups_world_size_not_divisible_by_group_size",
    ],
    "NCCL Send Recv Only": [
        "test_send_recv_nccl", "test_send_recv_nccl_autograd_profiler", "test_send_recv_nccl_torch_profiler",
    ],
    "Only Nccl supports CUDA all gather": [
        "test_all_gather_cuda", "test_all_gather_cuda_complex",
    ],
    "Only Nccl supports CUDA all_gather_into_tensor": [
        "test_all_gather_into_cat_tensor_cuda", "test_all_gather_into_stack_tensor_cuda",
    ],
    "Test is failing, see https://github.com/pytorch/pytorch/pull/113620": [
        "test_broadcast_object_list", "test_ddp_sync_bn_training_vs_eval",
    ],
    "Coalescing manager currently tests with NCCL only; internal test flaky": [
        "test_coalescing_manager", "test_coalescing_manager_async",
    ],
    "Need at least 4 CUDA devices": [
        "test_post_localSGD_optimizer_parity_with_hierarchical_sgd",
        "test_post_localSGD_optimizer_parity_with_hierarchical_sgd_grad_is_view",
    ],
    "Only Nccl supports CUDA reduce": [
        "test_reduce_sum_cuda", "test_reduce_sum_cuda_twice",
    ],
    "https://github.com/pytorch/pytorch/issues/77317": [
        "test_DistributedDataParallel",
    ],
    "https://github.com/pytorch/pytorch/issues/76428": [
        "test_DistributedDataParallel_non_default_stream",
    ],
    "no torchvision": [
        "test_SyncBatchNorm_process_group",
    ],
    "Only Nccl supports all_gather_v": [
        "test_all_gather_v_cuda",
    ],
    "https://github.com/pytorch/pytorch/issues/179691": [
        "test_barrier_timeout_arg",
    ],
    "Requires file:// initialization method. Both tcp:// and env:// rely on the TCP store for which "
    "reinitialization has proven racy.": [
        "test_barrier_timeout_global",
    ],
    "https://github.com/pytorch/pytorch/issues/85012": [
        "test_compute_bucket_assignment_by_size_sparse_error_with_logger",
    ],
    "https://github.com/pytorch/pytorch/issues/102751": [
        "test_ddp_has_finalized",
    ],
    "Skipped due to flakiness": [
        "test_ddp_hook_pickling_powerSGD",
    ],
    "https://github.com/pytorch/pytorch/issues/162676": [
        "test_ddp_model_diff_shape_across_ranks",
    ],
    "https://github.com/pytorch/pytorch/issues/77342": [
        "test_ddp_profiling_autograd_profiler",
    ],
    "https://github.com/pytorch/pytorch/issues/137765": [
        "test_ddp_profiling_execution_trace",
    ],
    "Only NCCL backend supports high priority stream": [
        "test_nccl_high_priority_stream",
    ],
    "https://github.com/pytorch/pytorch/issues/164195": [
        "test_new_subgroups",
    ],
    "https://github.com/pytorch/pytorch/issues/162584": [
        "test_new_subgroups_by_enumeration",
    ],
    "Only Nccl supports CUDA reduce_scatter_tensor": [
        "test_reduce_scatter_tensor_cuda",
    ],
    "Only Nccl supports reduce_scatter_v": [
        "test_reduce_scatter_v_cuda",
    ],
}

EXCLUDED: dict[str, str] = {**_NOT_OURS, **{name: f"skips on gloo here: {why}" for why, names in
                                            _SKIPPED_ON_GLOO.items() for name in names}}



def _world_size(name: str) -> int:
    if name in PASSING_GROUP:
        return GROUP_WORLD_SIZE
    return EXACT_WORLD_SIZE if name in PASSING_4 else WORLD_SIZE


def _cases() -> list[Any]:
    cases = []
    for name in PASSING + PASSING_4 + PASSING_GROUP:
        marks = [pytest.mark.xfail(strict=True, reason=PENDING_BACKEND_FIXES[name])] \
            if name in PENDING_BACKEND_FIXES else []
        cases.append(pytest.param(name, marks=marks, id=name))
    return cases


def _run_conformance(names: list[str], world_size: int, out: Path) -> tuple[dict[str, Any], str]:
    """Runs names at world_size in one runner subprocess; returns its results and its log's tail."""
    report, log = out / f"ws{world_size}.json", out / f"ws{world_size}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNIREDUCE_", "TORCHELASTIC_")) and k not in
           ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "BACKEND", "TEMP_DIR", "INIT_METHOD")}
    env["WORLD_SIZE"] = str(world_size)
    cmd = [sys.executable, "-m", "tests.dist_conformance", "--backend", "omnireduce", "--json", str(report),
           "--timeout", str(TEST_TIMEOUT_S), *names]
    with open(log, "w") as f:
        # Its own session, so that a runner that runs over is ended with its forkserver and ranks.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"killed after {RUN_TIMEOUT_S} s"
    results = json.loads(report.read_text())["results"] if report.exists() else {}
    tail = log.read_text()[-3000:]
    return results, f"runner at WORLD_SIZE {world_size} exited ({rc}); log {log}:\n{tail}"


@pytest.fixture(scope="module")
def conformance(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """name: the runner's result (or the runner's exit when it has none), for the cases pytest selected."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.module is sys.modules[__name__] and hasattr(item, "callspec")}
    out = tmp_path_factory.mktemp("torch_conformance")
    results: dict[str, Any] = {}
    for world_size in (WORLD_SIZE, EXACT_WORLD_SIZE, GROUP_WORLD_SIZE):
        names = [n for n in PASSING + PASSING_4 + PASSING_GROUP if n in selected and
                 _world_size(n) == world_size]
        if names:
            got, runner = _run_conformance(names, world_size, out)
            results.update({n: got.get(n, {"outcome": "NO RESULT", "runner": runner}) for n in names})
    return results


def _describe(r: dict[str, Any]) -> str:
    if "runner" in r:
        return r["runner"]
    return (f"{r['outcome']} at WORLD_SIZE {r.get('world_size')} in {r['seconds']} s:\n{r['summary']}\n\n"
            f"{r['detail'][-4000:]}")


@pytest.mark.parametrize("name", _cases())
def test_torch_distributed_test(conformance: dict[str, Any], name: str) -> None:
    r = conformance[name]
    assert r["outcome"] == "PASS", _describe(r)


def test_lists_are_consistent() -> None:
    run = PASSING + PASSING_4 + PASSING_GROUP
    assert len(run) == len(set(run)), "a test is listed twice"
    assert not set(run) & set(EXCLUDED), "a test is both run and excluded"
    assert set(PENDING_BACKEND_FIXES) <= set(run), "a pending test must be one that should pass"


def test_every_torch_test_is_accounted_for() -> None:
    """The lists cover torch's DistributedTest._DistTestBase exactly: no test is silently left out."""
    proc = subprocess.run([sys.executable, "-m", "tests.dist_conformance", "--list"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    suite = set(proc.stdout.split())
    listed = set(PASSING + PASSING_4 + PASSING_GROUP) | set(EXCLUDED)
    assert suite - listed == set(), "tests of torch's suite in none of the lists (sort them)"
    assert listed - suite == set(), "listed tests that torch's suite does not have"
