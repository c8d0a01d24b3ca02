"""The allreduce benchmark on an emulated cluster network (needs root and iproute2).

Every worker and every aggregator shard (``--shards``) run in their own network namespace, attached by a
veth pair to one bridge, with both directions of every link shaped by ``tc`` (a
token bucket at ``--rate``, optionally behind a netem delay): a star of full-duplex
links, like hosts on one switch. Addresses are taken from ``--subnet``, which must
lie in 198.18.0.0/15 (the benchmarking range). gloo runs in the same topology, so
the comparison is side by side as on loopback. Everything created is removed at
the end, also on an error, Ctrl-C, SIGTERM or SIGHUP; leftovers of a run that was
killed outright are removed by the next run.

Example::

    python -m bench.cluster --rate 1gbit --workers 2 4 --sizes 100MB --out bench/out-cluster
    python -m bench.cluster --shards 4 --systems omnireduce --out bench/out-cluster-4   # 4 aggregator hosts
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from bench.driver import Placement, add_args, run

logger = logging.getLogger(__name__)

__all__ = [
    "Topology", "cleanup_stale", "main", "measure_link", "parse_args", "preflight", "signals_raise", "BENCH_RANGE",
]

#: RFC 2544's benchmarking range: the only addresses this benchmark may use.
BENCH_RANGE = ipaddress.ip_network("198.18.0.0/15")
_NAME = re.compile(r"^ob(\d+)(?:-.*|br|h\w*)$")
_AGG_PORT = 5555
_CMD_TIMEOUT_S = 20


def preflight() -> str | None:
    """Why the cluster benchmark cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2)"
    try:
        probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        return f"'ip netns' does not work here: {e}"
    if probe.returncode != 0:
        return f"'ip netns' does not work here: {probe.stderr.strip()}"
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()}")
    return res


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Removes namespaces and links left by benchmark runs whose process is gone; returns their names."""
    removed = []
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_netns_pids(name)
            _sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in _sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _sh("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


def _kill_netns_pids(ns: str) -> None:
    for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Topology:
    """A bridge and one namespace per node, joined by shaped veth pairs.

    Args:
        workers: worker namespaces to create (plus one for the aggregator).
        rate: ``tc`` rate of every link direction, e.g. ``1gbit``, ``10gbit``.
        subnet: addresses for the nodes; must lie in 198.18.0.0/15.
        delay_us: one-way delay added to every link direction (netem), 0 for none.
        mtu: MTU of the links.
        aggregator_rate: rate of the aggregator's link; None gives it ``rate`` too.
        aggregators: aggregator namespaces (shards), each with its own link at ``aggregator_rate``.

    Use as a context manager: the namespaces exist inside the ``with`` block and are
    removed when it exits, whatever the reason.
    """

    def __init__(self, workers: int, rate: str = "1gbit", subnet: str = "198.18.0.0/24",
                 delay_us: int = 0, mtu: int = 1500, aggregator_rate: str | None = None,
                 aggregators: int = 1) -> None:
        net = ipaddress.ip_network(subnet)
        if not net.subnet_of(BENCH_RANGE):  # type: ignore[arg-type]
            raise ValueError(f"subnet {subnet} is outside 198.18.0.0/15, the only range this benchmark may use")
        hosts = list(net.hosts())
        if aggregators < 1:
            raise ValueError("at least one aggregator is needed")
        if len(hosts) < workers + aggregators:
            raise ValueError(f"subnet {subnet} has too few addresses for {workers} workers and {aggregators} "
                             "aggregators")
        aggregator_rate = aggregator_rate or rate
        for r in (rate, aggregator_rate):
            if not re.fullmatch(r"\d+(\.\d+)?[kmg]?bit", r):
                raise ValueError(f"rate {r!r} is not a tc rate such as 1gbit or 500mbit")
        self.rate = rate
        self.aggregator_rate = aggregator_rate
        self.delay_us = delay_us
        self.mtu = mtu
        self.prefixlen = net.prefixlen
        tag = f"ob{os.getpid()}"
        self.bridge = f"{tag}br"
        # Shard 0 keeps the single aggregator's names, so one shard is the topology it always was.
        self.n_aggregators = aggregators
        self.nodes: list[tuple[str, str, str]] = [
            (f"{tag}-agg{k or ''}", f"{tag}ha{k or ''}", str(hosts[k])) for k in range(aggregators)
        ]
        self.nodes += [(f"{tag}-w{i}", f"{tag}h{i}", str(hosts[aggregators + i])) for i in range(workers)]
        self._created: list[tuple[str, str]] = []

    @property
    def aggregators(self) -> list[tuple[str, str]]:
        """(namespace, address) of every aggregator shard."""
        return [(ns, ip) for ns, _, ip in self.nodes[: self.n_aggregators]]

    @property
    def workers(self) -> list[tuple[str, str]]:
        """(namespace, address) of every worker."""
        return [(ns, ip) for ns, _, ip in self.nodes[self.n_aggregators:]]

    def up(self) -> None:
        """Creates everything; on any failure removes what was made and raises."""
        try:
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            self._created.append(("link", self.bridge))
            _sh("ip", "link", "set", self.bridge, "up")
            for i, (ns, host_if, ip) in enumerate(self.nodes):
                rate = self.aggregator_rate if i < self.n_aggregators else self.rate
                _sh("ip", "netns", "add", ns)
                self._created.append(("netns", ns))
                _sh("ip", "link", "add", host_if, "mtu", str(self.mtu), "type", "veth", "peer", "name", "eth0",
                    "mtu", str(self.mtu), "netns", ns)
                self._created.append(("link", host_if))
                _sh("ip", "link", "set", host_if, "master", self.bridge, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "-n", ns, "addr", "add", f"{ip}/{self.prefixlen}", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                self._shape([], host_if, rate)  # switch -> node
                self._shape(["ip", "netns", "exec", ns], "eth0", rate)  # node -> switch
            self._wait_reachable()
        except BaseException:
            self.down()
            raise

    def _shape(self, prefix: list[str], dev: str, rate: str) -> None:
        bits = _rate_bits(rate)
        # A burst of 1 ms at the rate, and at least a few 64 KiB GSO segments.
        burst = max(bits // 8 // 1000, 4 * 65536)
        tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "20ms"]
        if self.delay_us > 0:
            _sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                f"{self.delay_us}us")
            _sh(*prefix, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
        else:
            _sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", *tbf)

    def _wait_reachable(self) -> None:
        # Carrier on every link; that traffic flows end to end is what measure_link checks.
        for ns, _, _ in self.nodes:
            for _ in range(50):
                if "LOWER_UP" in _sh("ip", "-n", ns, "link", "show", "eth0", check=False).stdout:
                    break
                time.sleep(0.1)
            else:
                raise RuntimeError(f"the link of namespace {ns} did not come up")

    def down(self) -> None:
        """Removes everything this topology created (idempotent; never raises)."""
        for kind, name in reversed(self._created):
            try:
                if kind == "netns":
                    _kill_netns_pids(name)
                    _sh("ip", "netns", "del", name, check=False)
                else:
                    _sh("ip", "link", "del", name, check=False)
            except Exception:  # teardown goes on with the rest whatever happens
                logger.exception("could not remove %s %s", kind, name)
        self._created.clear()

    def exists(self) -> list[str]:
        """The names of this topology's namespaces and links that exist now."""
        names = set(_sh("ip", "netns", "list", check=False).stdout.split())
        links = _sh("ip", "-o", "link", "show", check=False).stdout
        found = [ns for ns, _, _ in self.nodes if ns in names]
        found += [n for n in [self.bridge, *(h for _, h, _ in self.nodes)] if re.search(rf": {n}[@:]", links)]
        return found

    def __enter__(self) -> Topology:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


def _rate_bits(rate: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate)
    assert m is not None
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


@contextmanager
def signals_raise() -> Iterator[None]:
    """Turns SIGTERM, SIGHUP and SIGINT into one KeyboardInterrupt so ``finally`` blocks run."""

    def handler(signum: int, frame: FrameType | None) -> None:
        # Once: a second signal must not break off the teardown the first one started.
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


_PROBE_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(20)
c, _ = s.accept(); c.settimeout(20); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
print(n * 8 / (time.perf_counter() - t0))
"""
_PROBE_CLIENT = """
import socket, sys, time
end = time.perf_counter() + float(sys.argv[3]); buf = bytes(1 << 20)
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5); break
    except OSError: time.sleep(0.05)
while time.perf_counter() < end: c.sendall(buf)
c.close()
"""


def measure_link(topo: Topology, seconds: float = 1.0) -> float:
    """Bits per second of one TCP stream from the first worker to the first aggregator (a check of the shaping)."""
    agg_ns, agg_ip = topo.aggregators[0]
    w_ns, _ = topo.workers[0]
    srv = subprocess.Popen(["ip", "netns", "exec", agg_ns, sys.executable, "-c", _PROBE_SERVER, agg_ip, "5599"],
                           stdout=subprocess.PIPE, text=True)
    try:
        subprocess.run(["ip", "netns", "exec", w_ns, sys.executable, "-c", _PROBE_CLIENT, agg_ip, "5599",
                        str(seconds)], check=True, timeout=seconds + 30)
        out, _ = srv.communicate(timeout=30)
        return float(out.strip())
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--rate", default="1gbit", help="tc rate of every link direction (1gbit, 10gbit, ...)")
    p.add_argument("--aggregator-rate", default=None,
                   help="rate of the aggregator's link (default: --rate); a parameter server's fatter link")
    p.add_argument("--delay-us", type=int, default=0, help="one-way delay per link direction in microseconds")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--subnet", default="198.18.0.0/24", help="node addresses; must lie in 198.18.0.0/15")
    p.add_argument("--out", default="bench/out-cluster", help="output folder")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    why = preflight()
    if why:
        print(f"bench.cluster: {why}", file=sys.stderr)
        return 2
    stale = cleanup_stale()
    if stale:
        logger.warning("removed leftovers of an earlier run: %s", " ".join(stale))
    with signals_raise():
        topo = Topology(max(args.workers), rate=args.rate, subnet=args.subnet, delay_us=args.delay_us, mtu=args.mtu,
                        aggregator_rate=args.aggregator_rate, aggregators=args.shards)
        try:
            topo.up()
            link = measure_link(topo)
            print(f"link check: one TCP stream worker -> aggregator at {link / 1e9:.2f} Gbit/s (rate {args.rate})")

            def placement(w: int) -> Placement:
                return Placement(
                    aggregators=[(f"tcp://{ip}:{_AGG_PORT}", ["ip", "netns", "exec", ns])
                                 for ns, ip in topo.aggregators],
                    rank_prefixes=[["ip", "netns", "exec", ns] for ns, _ in topo.workers[:w]],
                    rank_env=[{"GLOO_SOCKET_IFNAME": "eth0"} for _ in range(w)],
                    rank_listen=[f"tcp://{ip}:0" for _, ip in topo.workers[:w]],
                )

            extra: dict[str, Any] = {
                "network": {
                    "rate": args.rate, "aggregator_rate": topo.aggregator_rate, "delay_us": args.delay_us,
                    "mtu": args.mtu, "subnet": args.subnet, "measured_stream_bps": link, "shards": args.shards,
                    "topology": "star: one namespace per node on a bridge",
                },
            }
            run(args, placement, args.out, f"allreduce on an emulated {args.rate} network", extra)
        finally:
            topo.down()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
