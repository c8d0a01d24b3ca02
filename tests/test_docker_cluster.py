"""The compose cluster (docker/compose.yaml) on a real Docker engine.

``scripts/docker_engine.sh`` installs Debian's docker.io and docker-compose if needed and
starts ``dockerd`` (vfs storage, no iptables, no docker0 bridge); when no engine can be
made to answer, the tests are skipped with the script's reason, except under CI
(``CI=true``, as CI services set it), where they fail: CI must run them. The image is built
locally with no registry (``docker/build_local_image.py``), the services run on a
network whose subnet is a free /24 inside 198.18.0.0/15, and the project, its network
and the image are removed afterwards, also when a test fails. The project name and
image tag are unique per run.

About a minute and a half here once the packages are installed (build ~5 s; each
cluster ~30 s, mostly creating and removing containers on vfs); add the apt-get install
on a fresh machine.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
RUN_ID = f"ortest{os.getpid()}{uuid.uuid4().hex[:6]}"
#: Where the test networks are taken from; dockerd's own pool (scripts/docker_engine.sh) is 198.19.0.0/16.
TEST_RANGE = ipaddress.ip_network("198.18.64.0/18")
ALLOWED = ipaddress.ip_network("198.18.0.0/15")
AGGREGATOR_TIMEOUT = 8  # seconds; the workers' own timeout is longer so the aggregator's error, naming ranks, wins
WORKER_TIMEOUT = 20
# Every variable docker/compose.yaml reads, so nothing leaks in from the caller's environment
# (RANK or WORLD_SIZE from torchrun, say).
BASE_ENV = {
    "WORLD_SIZE": "3",
    "OMNIREDUCE_JOB": f"{RUN_ID}-a",
    "OMNIREDUCE_JOB_B": f"{RUN_ID}-b",
    "OMNIREDUCE_JOB_S": f"{RUN_ID}-s",
    "OMNIREDUCE_TIMEOUT": "60",
    "OMNIREDUCE_AGGREGATOR_TIMEOUT": "30",
    "OMNIREDUCE_CLUSTER_ELEMENTS": "300000",
    "OMNIREDUCE_CLUSTER_DENSITY": "0.05",
    "OMNIREDUCE_CLUSTER_OPS": "5",
    "OMNIREDUCE_CLUSTER_PAUSE": "0",
    "OMNIREDUCE_HEALTH_INTERVAL": "1s",
    "OMNIREDUCE_TOKEN": "",
}


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


@dataclass
class Engine:
    compose: list[str]


def _in_ci() -> bool:
    """True under CI (``CI=true``; also ``1`` or ``yes``)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _no_engine(reason: str) -> NoReturn:
    """No Docker engine: skips the cluster tests, or fails them under CI, which must run them."""
    if _in_ci():
        pytest.fail(f"CI is set, so the Docker cluster tests must run, but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    if shutil.which("bash") is None:
        _no_engine("there is no bash to run scripts/docker_engine.sh")
    was_up = subprocess.run(["bash", "scripts/docker_engine.sh", "status"], cwd=ROOT,
                            capture_output=True, timeout=30).returncode == 0
    try:
        res = subprocess.run(["bash", "scripts/docker_engine.sh", "start"], cwd=ROOT, capture_output=True,
                             text=True, timeout=420)
    except subprocess.TimeoutExpired:
        _no_engine("no Docker engine: scripts/docker_engine.sh start took over 420 s")
    if res.returncode != 0:
        _no_engine(f"no Docker engine could be started: {res.stderr.strip()[-1500:]}")
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0:
        compose = ["docker", "compose"]
    else:
        exe = shutil.which("docker-compose")
        assert exe, "the engine runs but neither `docker compose` nor docker-compose is installed"
        compose = [exe]
    try:
        yield Engine(compose)
    finally:
        if not was_up and not os.environ.get("OMNIREDUCE_KEEP_DOCKER"):
            subprocess.run(["bash", "scripts/docker_engine.sh", "stop"], cwd=ROOT, capture_output=True, timeout=60)


@pytest.mark.parametrize("ci", ["true", "TRUE", "1", "", "false", None])
def test_a_missing_engine_fails_under_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch, ci: str | None) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    expected = pytest.fail.Exception if ci in ("true", "TRUE", "1") else pytest.skip.Exception
    with pytest.raises(expected, match="dockerd did not answer"):
        _no_engine("no Docker engine could be started: dockerd did not answer")


@pytest.fixture(scope="module")
def image(engine: Engine) -> Iterator[str]:
    tag = f"omnireduce-test:{RUN_ID}"
    try:
        res = _run([sys.executable, "docker/build_local_image.py", "--tag", tag, "--timeout", "240"], timeout=300)
        assert "'reused': False" in res.stderr, res.stderr
        yield tag
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=120)


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    if shutil.which("ip"):
        out = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True,
                             timeout=10).stdout
        for word in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?\b", out):
            nets.append(ipaddress.ip_network(word, strict=False))
    ids = subprocess.run(["docker", "network", "ls", "-q"], capture_output=True, text=True, timeout=30).stdout.split()
    if ids:
        out = subprocess.run(["docker", "network", "inspect", "--format",
                              "{{range .IPAM.Config}}{{.Subnet}} {{end}}", *ids],
                             capture_output=True, text=True, timeout=30).stdout
        nets += [ipaddress.ip_network(s, strict=False) for s in out.split() if "." in s]
    return nets


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    candidates = list(TEST_RANGE.subnets(new_prefix=24))
    random.shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(u) for u in used):
            return net
    raise AssertionError(f"no free /24 left in {TEST_RANGE}")


@dataclass
class Cluster:
    """One compose project of docker/compose.yaml; ``down`` removes everything it created."""

    engine: Engine
    image: str
    name: str
    env_overrides: dict[str, str] = field(default_factory=dict)
    profiles: list[str] = field(default_factory=list)
    subnet: ipaddress.IPv4Network | None = None
    #: The services ``up`` starts; empty: every service of the profiles (and those with none).
    services: list[str] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        env = {**os.environ, **BASE_ENV, **self.env_overrides, "OMNIREDUCE_IMAGE": self.image}
        env.pop("COMPOSE_PROJECT_NAME", None)
        env.pop("COMPOSE_FILE", None)
        if self.subnet is not None:
            env["OMNIREDUCE_SUBNET"] = str(self.subnet)
        return env

    def compose(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [*self.engine.compose, "-p", self.name, "-f", str(COMPOSE_FILE)]
        for p in self.profiles:
            cmd += ["--profile", p]
        return _run([*cmd, *args], timeout=timeout, env=self.env(), check=check)

    def up(self) -> None:
        for _ in range(3):
            self.subnet = _free_subnet()
            res = self.compose("up", "-d", "--no-build", *self.services, timeout=180, check=False)
            if res.returncode == 0:
                return
            if "overlap" not in res.stderr.lower():
                raise AssertionError(
                    f"compose up failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}\n{self.all_logs()}"
                )
            self.compose("down", "-v", "--remove-orphans", "-t", "5", timeout=120, check=False)
        raise AssertionError(f"compose up: every subnet tried overlapped: {res.stderr[-2000:]}")

    def container(self, service: str) -> str:
        ids = _run(["docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={self.name}",
                    "--filter", f"label=com.docker.compose.service={service}"], timeout=30).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def logs(self, service: str) -> tuple[str, str]:
        res = _run(["docker", "logs", self.container(service)], timeout=60)
        return res.stdout, res.stderr

    def all_logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", timeout=60, check=False).stdout[-6000:]

    def records(self, service: str) -> list[dict[str, Any]]:
        """The JSON lines a cluster_worker printed."""
        return [json.loads(line) for line in self.logs(service)[0].splitlines() if line.startswith("{")]

    def wait(self, service: str, timeout: float) -> int:
        try:
            res = _run(["docker", "wait", self.container(service)], timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{service} still running after {timeout} s:\n{self.all_logs()}") from None
        return int(res.stdout.strip())

    def ip(self, service: str) -> ipaddress.IPv4Address:
        out = _run(["docker", "inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}",
                    self.container(service)], timeout=30).stdout.split()
        assert len(out) == 1, f"{service}: addresses {out}"
        return ipaddress.ip_address(out[0])

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "-t", "5", timeout=180, check=False)
        # Whatever compose left behind (it failed, or timed out) goes by label.
        label = f"label=com.docker.compose.project={self.name}"
        left = subprocess.run(["docker", "ps", "-a", "-q", "--filter", label], capture_output=True, text=True,
                              timeout=30).stdout.split()
        if left:
            subprocess.run(["docker", "rm", "-f", "-v", *left], capture_output=True, timeout=120)
        nets = subprocess.run(["docker", "network", "ls", "-q", "--filter", label], capture_output=True, text=True,
                              timeout=30).stdout.split()
        if nets:
            subprocess.run(["docker", "network", "rm", *nets], capture_output=True, timeout=60)


@pytest.fixture
def cluster_factory(engine: Engine, image: str) -> Iterator[Any]:
    made: list[Cluster] = []

    def make(suffix: str, **kw: Any) -> Cluster:
        c = Cluster(engine, image, f"{RUN_ID}{suffix}", **kw)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.down()
        for c in made:
            label = f"label=com.docker.compose.project={c.name}"
            assert not subprocess.run(["docker", "ps", "-a", "-q", "--filter", label], capture_output=True,
                                      text=True, timeout=30).stdout.split(), f"{c.name}: containers left"


@pytest.fixture(scope="module")
def two_jobs(engine: Engine, image: str) -> Iterator[dict[str, Any]]:
    """Both jobs at once: job A (3 workers) on ``aggregator``, job B (2 workers) on ``aggregator-b``."""
    c = Cluster(engine, image, f"{RUN_ID}two", profiles=["second-job"])
    try:
        c.up()
        services = ["aggregator", "aggregator-b", "worker0", "worker1", "worker2", "worker-b0", "worker-b1"]
        ips = {s: c.ip(s) for s in services}  # before the workers exit and lose their addresses
        codes = {s: c.wait(s, timeout=120) for s in services if s.startswith("worker")}
        records = {s: c.records(s) for s in codes}
        c.compose("stop", "-t", "10", "aggregator", "aggregator-b", timeout=60)
        agg_logs = {s: "".join(c.logs(s)) for s in ("aggregator", "aggregator-b")}
        yield {"cluster": c, "ips": ips, "codes": codes, "records": records, "agg_logs": agg_logs,
               "logs": c.all_logs()}
    finally:
        c.down()


def _check_job(result: dict[str, Any], workers: list[str], job: str, world: int, address: str) -> None:
    for rank, s in enumerate(workers):
        assert result["codes"][s] == 0, f"{s} exited {result['codes'][s]}:\n{result['logs']}"
        recs = result["records"][s]
        ops = [r for r in recs if r["event"] == "op"]
        assert [r["op"] for r in ops] == list(range(int(BASE_ENV["OMNIREDUCE_CLUSTER_OPS"])))
        assert all(r["exact"] for r in ops), f"{s}: a sum differs: {ops}"
        assert all(r["rank"] == rank and r["world_size"] == world and r["job"] == job and r["address"] == address
                   for r in recs), recs
        assert recs[-1] == {"event": "done", "rank": rank, "world_size": world, "job": job, "address": address,
                            "ops": len(ops), "exact": True}
    hosts = {result["records"][s][0]["host"] for s in workers}
    assert len(hosts) == len(workers), f"workers did not run in separate containers: {hosts}"


def test_job_across_containers_gives_exact_sum(two_jobs: dict[str, Any]) -> None:
    _check_job(two_jobs, ["worker0", "worker1", "worker2"], BASE_ENV["OMNIREDUCE_JOB"], 3, "tcp://aggregator:5555")
    subnet = two_jobs["cluster"].subnet
    assert subnet is not None and subnet.subnet_of(ALLOWED)
    for s, ip in two_jobs["ips"].items():
        assert ip in subnet, f"{s} got {ip}, outside {subnet}"


def test_two_aggregators_in_separate_containers_serve_their_own_job(two_jobs: dict[str, Any]) -> None:
    _check_job(two_jobs, ["worker-b0", "worker-b1"], BASE_ENV["OMNIREDUCE_JOB_B"], 2, "tcp://aggregator-b:5555")
    assert two_jobs["ips"]["aggregator"] != two_jobs["ips"]["aggregator-b"]
    ops = BASE_ENV["OMNIREDUCE_CLUSTER_OPS"]
    for s, log in two_jobs["agg_logs"].items():
        # Each aggregator saw exactly its own job's ops: a worker sent to the wrong one would change the counts.
        assert f"completed {ops} ops, failed 0" in log, f"{s}:\n{log}"


def test_killed_worker_container_fails_the_others_clearly(cluster_factory: Any) -> None:
    job = BASE_ENV["OMNIREDUCE_JOB"]
    c = cluster_factory("kill", env_overrides={
        "OMNIREDUCE_AGGREGATOR_TIMEOUT": str(AGGREGATOR_TIMEOUT), "OMNIREDUCE_TIMEOUT": str(WORKER_TIMEOUT),
        "OMNIREDUCE_CLUSTER_OPS": "400", "OMNIREDUCE_CLUSTER_PAUSE": "0.05",
    })
    c.up()
    deadline = time.monotonic() + 90
    while True:  # until every worker has finished a few ops, so the kill lands mid-job
        done = [sum(r["event"] == "op" for r in c.records(f"worker{i}")) for i in range(3)]
        if min(done) >= 3:
            break
        assert max(done) < 400 and time.monotonic() < deadline, f"job did not get going: {done}\n{c.all_logs()}"
        time.sleep(0.5)
    _run(["docker", "kill", c.container("worker2")], timeout=30)
    ops: set[int] = set()
    for rank in (0, 1):
        code = c.wait(f"worker{rank}", timeout=AGGREGATOR_TIMEOUT + WORKER_TIMEOUT + 30)
        out, err = c.logs(f"worker{rank}")
        assert code == 3, f"worker{rank} exited {code}:\n{out[-2000:]}\n{err[-2000:]}"
        error = c.records(f"worker{rank}")[-1]
        # The aggregator names the lost rank either when the op times out (OpTimeoutError) or, where it
        # watches connections, as soon as rank 2's goes away; either way the error is an OpError for
        # this job, an op after the ones that completed, and exactly rank 2.
        assert error["event"] == "error" and error["type"].endswith("Error"), error
        assert error["job"] == job and error["ranks"] == [2], error
        assert isinstance(error["op"], int) and error["op"] >= 3, error
        msg = error["message"]
        assert f"job='{job}'" in msg and f"op={error['op']}" in msg and "ranks=[2]" in msg, error
        assert re.search(r"ranks? \[?2\b", msg.split(" (job=")[0]), f"the reason does not name rank 2: {msg}"
        assert error["type"] in err  # also logged on stderr for humans
        ops.add(error["op"])
    assert c.wait("worker2", timeout=30) == 137  # SIGKILL
    agg = "".join(c.logs("aggregator"))
    assert len(ops) == 1, f"the survivors failed in different ops: {ops}"
    line = rf"job[= ]'{re.escape(job)}'[ ,]*op[= ]{ops.pop()} failed \((\w+)\): [^\n]*ranks? \[?2\b"
    assert re.search(line, agg), f"the aggregator did not log the failed op naming rank 2:\n{agg[-3000:]}"


def test_job_over_two_aggregator_shards_in_separate_containers(cluster_factory: Any) -> None:
    """One job whose workers list two aggregator shards: every sum exact, both shards summed every op."""
    services = ["shard0", "shard1", "worker-s0", "worker-s1"]
    c = cluster_factory("shards", profiles=["shards"], services=services)
    c.up()
    ips = {s: c.ip(s) for s in services}
    codes = {s: c.wait(s, timeout=120) for s in ("worker-s0", "worker-s1")}
    records = {s: c.records(s) for s in codes}
    c.compose("stop", "-t", "10", "shard0", "shard1", timeout=60)
    result = {"codes": codes, "records": records, "logs": c.all_logs()}
    _check_job(result, ["worker-s0", "worker-s1"], BASE_ENV["OMNIREDUCE_JOB_S"], 2,
               "tcp://shard0:5555,tcp://shard1:5555")
    assert len({ips["shard0"], ips["shard1"]}) == 2 and all(ip in c.subnet for ip in ips.values())
    elements = int(BASE_ENV["OMNIREDUCE_CLUSTER_ELEMENTS"])
    for s in codes:
        ops = [r for r in records[s] if r["event"] == "op"]
        assert all(r["elements"] == elements for r in ops), ops
    ops = BASE_ENV["OMNIREDUCE_CLUSTER_OPS"]
    for s in ("shard0", "shard1"):
        # Each shard took its chunk of every op: a worker that skipped a shard would change the counts.
        log = "".join(c.logs(s))
        assert f"completed {ops} ops, failed 0" in log, f"{s}:\n{log}"
