"""The aggregator's Prometheus endpoint agrees with what the workers did."""

from __future__ import annotations

import logging
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aggregator import Aggregator
from omnireduce.errors import MismatchError
from omnireduce.protocol import Hello, encode
from tests.helpers import sparse
from worker import Worker

P = "omnireduce_aggregator_"


def scrape(agg: Aggregator) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    assert agg.metrics_address
    text = urllib.request.urlopen(agg.metrics_address, timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_what_the_workers_did(caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(4)
    inputs = [[sparse(rng, 100_000, 0.1) for _ in range(3)] for _ in range(2)]
    with Aggregator(timeout=20, metrics_port=0).start() as agg:
        assert agg.metrics_address and agg.metrics_address.startswith("http://127.0.0.1:")
        ws = [Worker(agg.address, rank=r, world_size=2, job="metered", timeout=30) for r in range(2)]
        for i in range(3):
            futs = [w.allreduce_async(inputs[r][i]) for r, w in enumerate(ws)]
            for f in futs:
                np.testing.assert_array_equal(f.result(30), inputs[0][i] + inputs[1][i])
        m = scrape(agg)
        sent = [w.stats.total for w in ws]
        hello = sum(len(encode(Hello("metered", r, 2, 0, ""))[0]) for r in range(2))
        assert m[(P + "ops_started_total", ())] == 3
        assert m[(P + "ops_completed_total", ())] == 3
        assert m[(P + "ops_failed_total", ())] == 0
        # Exactly what the workers sent: their op messages plus one HELLO each.
        assert m[(P + "bytes_in_total", ())] == sum(s.bytes_sent for s in sent) + hello
        assert m[(P + "blocks_in_total", ())] == sum(s.blocks_sent for s in sent)
        assert m[(P + "blocks_out_total", ())] == sum(s.blocks_received for s in sent)
        assert m[(P + "bytes_out_total", ())] >= sum(s.bytes_received for s in sent)
        assert m[(P + "rounds_total", ())] >= max(s.rounds for s in sent)
        assert m[(P + "op_latency_seconds_count", ())] == 3
        assert m[(P + "op_latency_seconds_bucket", (("le", "+Inf"),))] == 3
        assert 0 < m[(P + "op_latency_seconds_sum", ())] < 60
        assert m[(P + "active_jobs", ())] == 1 and m[(P + "active_ops", ())] == 0
        assert m[(P + "held_bytes", ())] == 0 and m[(P + "peak_held_bytes", ())] > 0

        # A failed op shows as an error of its kind, and the log line names job, op and ranks.
        caplog.clear()
        futs = [w.allreduce_async(np.ones(10 + r, np.float32)) for r, w in enumerate(ws)]
        for f in futs:
            with pytest.raises(MismatchError):
                f.result(30)
        m = scrape(agg)
        assert m[(P + "errors_total", (("kind", "mismatch"),))] == 1
        assert m[(P + "ops_failed_total", ())] == 1
        failed = [
            r.getMessage() for r in caplog.records if r.name == "aggregator.engine" and r.levelno >= logging.ERROR
        ]
        assert any("job='metered' op=3 failed (MISMATCH)" in line and "ranks [0] vs [1]" in line for line in failed)
        worker_lines = [r.getMessage() for r in caplog.records if r.name == "worker.connection"]
        assert any("rank 1 of job 'metered' op 3" in line for line in worker_lines)

        for w in ws:
            w.close()
        deadline = time.monotonic() + 10
        while scrape(agg)[(P + "active_jobs", ())] != 0:
            assert time.monotonic() < deadline, "the job was not forgotten after its workers left"
            time.sleep(0.05)
        # They closed on purpose (BYE): not counted as lost.
        assert scrape(agg)[(P + "peers_lost_total", ())] == 0
