"""Settings shared by the aggregator and the workers, and where they come from.

Precedence, highest first: an explicit argument, then the environment variable,
then the default below. torchrun's ``RANK`` and ``WORLD_SIZE`` are read as-is so a
worker launched by torchrun needs no extra configuration; its
``TORCHELASTIC_RESTART_COUNT`` is the job's generation unless
``OMNIREDUCE_GENERATION`` says otherwise, so a restarted job never mixes with
the ops of the run it replaces.

Security settings (all optional; see :mod:`omnireduce.auth` and ``omnireduce-keygen``):

- ``OMNIREDUCE_TOKEN`` / ``Worker(token=)``: the job's shared secret; the job's
  first worker fixes it and every other worker of the job must present it.
- ``OMNIREDUCE_CURVE_SERVER_KEY`` / ``Worker(curve_server_key=)``: the aggregator's
  public key, a ``.key`` file or its 40-character Z85 text; turns CURVE on.
- ``OMNIREDUCE_CURVE_CLIENT_KEY`` / ``Worker(curve_client_key=)``: the worker's own
  ``.key_secret`` file; without it the worker uses a throwaway key pair.
- ``OMNIREDUCE_CURVE_SECRET_KEY`` / ``Aggregator(curve_secret_key=)``: the
  aggregator's ``.key_secret`` file; turns CURVE on.
- ``OMNIREDUCE_CURVE_CLIENT_KEYS`` / ``Aggregator(curve_client_keys=)``: directory
  of the workers' ``.key`` files that may connect; unset, any key may (encryption
  without client authentication; job tokens still separate the jobs).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

from omnireduce.errors import ConfigError

__all__ = [
    "OMNIREDUCE_ADDRESS",
    "OMNIREDUCE_JOB",
    "OMNIREDUCE_BLOCK_SIZE",
    "OMNIREDUCE_MESSAGE_BLOCKS",
    "OMNIREDUCE_STREAMS",
    "OMNIREDUCE_TIMEOUT",
    "OMNIREDUCE_MODE",
    "OMNIREDUCE_COSTS",
    "OMNIREDUCE_TOKEN",
    "OMNIREDUCE_GENERATION",
    "OMNIREDUCE_HEARTBEAT",
    "OMNIREDUCE_HEARTBEAT_TIMEOUT",
    "OMNIREDUCE_CURVE_SERVER_KEY",
    "OMNIREDUCE_CURVE_CLIENT_KEY",
    "OMNIREDUCE_CURVE_SECRET_KEY",
    "OMNIREDUCE_CURVE_CLIENT_KEYS",
    "TORCHELASTIC_RESTART_COUNT",
    "RANK",
    "WORLD_SIZE",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MESSAGE_BLOCKS",
    "DEFAULT_STREAMS",
    "DEFAULT_TIMEOUT",
    "DEFAULT_MODE",
    "DEFAULT_JOB",
    "MASTER_ADDR",
    "MASTER_PORT",
    "default_job",
    "DEFAULT_HEARTBEAT",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "PROBE_DENSE",
    "LOCAL_WORLD_SIZE",
    "OMNIREDUCE_MASK_THREADS",
    "OMNIREDUCE_MALLOC_TUNE",
    "OMNIREDUCE_SHARD_BYTES",
    "DEFAULT_SHARD_BYTES",
    "OMNIREDUCE_MAX_MESSAGE_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_MASK_THREADS",
    "mask_threads",
    "usable_cores",
    "resolve",
    "resolve_optional",
    "resolve_generation",
    "split_addresses",
    "heartbeat_stall",
    "resolve_heartbeat",
]

#: Aggregator address a worker connects to, e.g. ``tcp://198.18.0.2:5555``.
OMNIREDUCE_ADDRESS = "OMNIREDUCE_ADDRESS"
#: Job id shared by the workers of one training job. Unset: :func:`default_job`.
OMNIREDUCE_JOB = "OMNIREDUCE_JOB"
#: Elements per block (OmniReduce's block_size).
OMNIREDUCE_BLOCK_SIZE = "OMNIREDUCE_BLOCK_SIZE"
#: Blocks per message, one per column of a stream (OmniReduce's message_size / block_size).
OMNIREDUCE_MESSAGE_BLOCKS = "OMNIREDUCE_MESSAGE_BLOCKS"
#: Streams (slots) that proceed in parallel within one op.
OMNIREDUCE_STREAMS = "OMNIREDUCE_STREAMS"
#: Seconds a worker waits for the aggregator before failing an op.
OMNIREDUCE_TIMEOUT = "OMNIREDUCE_TIMEOUT"
#: The path of a worker's ops: ``sparse`` (the block protocol), ``dense`` (every block sent,
#: no detection), or ``auto`` (per tensor, whichever the cost model predicts faster).
OMNIREDUCE_MODE = "OMNIREDUCE_MODE"
#: The cost model's machine parameters (``omnireduce-calibrate`` writes them).
OMNIREDUCE_COSTS = "OMNIREDUCE_COSTS"
#: The job's token: a shared secret that keeps other tenants out of the job's sums.
OMNIREDUCE_TOKEN = "OMNIREDUCE_TOKEN"
#: The job's generation; raise it when the job's workers restart (torchelastic does).
OMNIREDUCE_GENERATION = "OMNIREDUCE_GENERATION"
#: Seconds without hearing from the peer after which a heartbeat goes (at most one per
#: interval); 0 turns them off (that end then only answers the other's).
OMNIREDUCE_HEARTBEAT = "OMNIREDUCE_HEARTBEAT"
#: Seconds without any message from the peer after which a connection is dropped as dead.
OMNIREDUCE_HEARTBEAT_TIMEOUT = "OMNIREDUCE_HEARTBEAT_TIMEOUT"
#: Worker: the aggregator's CURVE public key (``.key`` file or Z85 text).
OMNIREDUCE_CURVE_SERVER_KEY = "OMNIREDUCE_CURVE_SERVER_KEY"
#: Worker: its own CURVE key pair (a ``.key_secret`` file).
OMNIREDUCE_CURVE_CLIENT_KEY = "OMNIREDUCE_CURVE_CLIENT_KEY"
#: Aggregator: its CURVE key pair (a ``.key_secret`` file); turns CURVE on.
OMNIREDUCE_CURVE_SECRET_KEY = "OMNIREDUCE_CURVE_SECRET_KEY"
#: Aggregator: directory of the workers' public keys it accepts; unset accepts any key.
OMNIREDUCE_CURVE_CLIENT_KEYS = "OMNIREDUCE_CURVE_CLIENT_KEYS"
#: torchelastic's count of restarts of the job: the default generation.
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
#: torchrun's (and torch.multiprocessing's) rendezvous: one address and port per launch.
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
#: torchrun's names for the worker's rank and the number of workers.
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
#: torchrun's number of ranks on this machine: they share its cores.
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
#: Threads of a worker's CPU mask pass (an integer >= 1). Unset: the cores this process
#: may run on divided by ``LOCAL_WORLD_SIZE`` (at most :data:`MAX_MASK_THREADS`), or 1
#: when ``LOCAL_WORLD_SIZE`` is unset (nothing says the cores are free).
OMNIREDUCE_MASK_THREADS = "OMNIREDUCE_MASK_THREADS"
#: "0" keeps glibc's malloc thresholds as they are; "1" (the default) fixes them when the
#: first worker or aggregator of the process starts (see :mod:`omnireduce.memory`).
OMNIREDUCE_MALLOC_TUNE = "OMNIREDUCE_MALLOC_TUNE"
#: A sharded or co-located worker's op expected to move ``b`` bytes (its dense size, or with
#: a ``key=`` that times the union density of the last op of the key) goes to
#: ``ceil(b / OMNIREDUCE_SHARD_BYTES)`` shards (at least one, at most all), taken in turn
#: from op to op; 0 sends every op to every shard.
OMNIREDUCE_SHARD_BYTES = "OMNIREDUCE_SHARD_BYTES"
#: Worker: the largest frame its aggregators accept (their ``--max-message-bytes``). An op
#: whose messages could be larger fails with LimitError on every rank before anything is
#: sent; sent, such a frame gets the connection cut (ZeroMQ's MAXMSGSIZE) and its rank lost.
OMNIREDUCE_MAX_MESSAGE_BYTES = "OMNIREDUCE_MAX_MESSAGE_BYTES"

DEFAULT_BLOCK_SIZE = 256
# A tensor of up to 8192 x 16 blocks (128 MB of float32) lays one block per column, so it
# is eager (one round trip), pipelined over up to 16 streams of at most 8192 blocks each.
DEFAULT_MESSAGE_BLOCKS = 8192
DEFAULT_STREAMS = 16
DEFAULT_TIMEOUT = 60.0
DEFAULT_MODE = "sparse"
DEFAULT_JOB = "default"
DEFAULT_HEARTBEAT = 1.0
DEFAULT_HEARTBEAT_TIMEOUT = 5.0
#: The aggregator's default ``--max-message-bytes`` and the worker's default for it.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# A shard's part of an op costs a message each way on every rank and on the shard: below
# a few hundred KiB per shard those messages, not the links, bound the op; a whole MiB on
# one shard's link already loses at 1 Gbit/s (bench/RESULTS.md).
DEFAULT_SHARD_BYTES = 256 << 10
#: The mask pass streams memory: beyond a few threads the bandwidth, not the cores, bounds it.
MAX_MASK_THREADS = 8

#: Not a setting: the fraction of probed blocks above which the CPU mask kernel
#: (:mod:`omnireduce.kernels.cpu`) takes a tensor as mostly dense and stops at each block's
#: first nonzero word. Here, in a module without Numba, because the cost model
#: (:mod:`omnireduce.model`) predicts the mask with the same threshold.
PROBE_DENSE = 0.75

T = TypeVar("T")


def resolve(
    value: T | None,
    env: str,
    default: T | None,
    parse: Callable[[str], T],
) -> T:
    """Returns the explicit value, else the parsed environment variable, else the default.

    Args:
        value: the explicit argument; wins when not None.
        env: the environment variable consulted next.
        default: used when neither is given; None means the setting is required.
        parse: converts the variable's text to the setting's type.

    Raises:
        ConfigError: the variable does not parse, or a required setting is missing.
    """
    if value is not None:
        return value
    text = os.environ.get(env)
    if text is not None and text.strip() != "":
        try:
            return parse(text.strip())
        except ValueError as e:
            raise ConfigError(f"environment variable {env}={text!r} is invalid: {e}") from None
    if default is None:
        raise ConfigError(f"no value given and environment variable {env} is not set")
    return default


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise ValueError("must be at least 1")
    return n


def default_job() -> str:
    """The job id of a worker given none and no ``OMNIREDUCE_JOB``: ``torchrun-<MASTER_ADDR>:<MASTER_PORT>``
    where torchrun (or any torch launcher) set them, the same on every rank of one launch and
    different for two launches at once (each has its own rendezvous port), so two runs on one
    aggregator do not take each other's ranks; else :data:`DEFAULT_JOB`."""
    addr, port = os.environ.get(MASTER_ADDR, "").strip(), os.environ.get(MASTER_PORT, "").strip()
    if addr and port:
        return f"torchrun-{addr}:{port}"[:200]
    return DEFAULT_JOB


def mask_threads(value: int | None = None) -> int:
    """Threads for a worker's CPU mask pass.

    Precedence: ``value``, then ``OMNIREDUCE_MASK_THREADS``, then the usable cores
    divided by ``LOCAL_WORLD_SIZE`` (capped at :data:`MAX_MASK_THREADS`), then 1.
    The threads are only worth it where cores sit idle while the rank scans its
    gradient: more cores than ranks on the machine.

    Raises:
        ConfigError: a value or variable that is not an integer >= 1.
    """
    if value is not None:
        if value < 1:
            raise ConfigError(f"mask threads must be at least 1, got {value}")
        return value
    explicit = resolve_optional(None, OMNIREDUCE_MASK_THREADS, _positive_int)
    if explicit is not None:
        return explicit
    local = resolve_optional(None, LOCAL_WORLD_SIZE, _positive_int)
    if local is None:
        return 1
    return max(1, min(MAX_MASK_THREADS, usable_cores() // local))


def usable_cores() -> int:
    """The cores this process may run on (a cpuset or taskset counts)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def resolve_optional(value: T | None, env: str, parse: Callable[[str], T]) -> T | None:
    """Like :func:`resolve` for a setting that may stay unset: returns None then.

    Raises:
        ConfigError: the variable does not parse.
    """
    if value is not None:
        return value
    text = os.environ.get(env)
    if text is None or text.strip() == "":
        return None
    return resolve(None, env, None, parse)


def resolve_secret(value: str | None, env: str) -> str:
    """A secret: the explicit value, else the variable's text as it is (a secret's spaces are
    part of it, as they are in an argument), else "" (none); an empty variable is unset."""
    if value is not None:
        return value
    return os.environ.get(env, "")


def resolve_generation(value: int | None) -> int:
    """The job's generation: explicit, else ``$OMNIREDUCE_GENERATION``, else torchelastic's restart count, else 0.

    Raises:
        ConfigError: a variable does not parse, or the generation is negative.
    """
    generation = resolve_optional(value, OMNIREDUCE_GENERATION, int)
    if generation is None:
        # Read only when nothing above it is given: a bad value of it must not win over them.
        generation = resolve(None, TORCHELASTIC_RESTART_COUNT, 0, int)
    generation = check_integer("generation", generation)
    if generation < 0:
        raise ConfigError(f"generation must be a non-negative integer, got {generation!r}")
    return generation


def split_addresses(value: str | Sequence[str]) -> list[str]:
    """The aggregator endpoints in an address setting: a list or tuple, or a comma-separated string.

    ``"tcp://a:5555, tcp://b:5555"`` and ``["tcp://a:5555", "tcp://b:5555"]`` both
    name two aggregator shards; empty items and surrounding spaces are dropped.

    Raises:
        ConfigError: an item is not a string.
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    if not all(isinstance(a, str) for a in items):
        raise ConfigError(f"aggregator addresses must be strings, got {value!r}")
    return [a.strip() for a in items if a.strip()]


_MAX_SOCKET_S = (2**31 - 1) / 1000


def check_number(name: str, value: object, positive: bool = True, maximum: float | None = None) -> None:
    """Refuses anything but a finite real number that is positive (or, if not ``positive``, non-negative).

    Args:
        name: names the setting in the error.
        value: the value to check (a bool is refused).
        positive: zero is refused too.
        maximum: the largest value allowed, if any.

    Raises:
        ConfigError: ``value`` is not such a number.
    """
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not _finite(value) or value < 0
            or (positive and value == 0) or (maximum is not None and value > maximum)):
        most = "" if maximum is None else f" of at most {maximum:g}"
        raise ConfigError(f"{name} must be a finite {'positive' if positive else 'non-negative'} number{most}, "
                          f"got {value!r}")


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float (10**400)
        return False


def check_integer(name: str, value: object) -> int:
    """``value`` as an int if it is an integer (a NumPy one too; not a bool).

    Raises:
        ConfigError: ``value`` is not an integer.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return int(value)


def heartbeat_stall(interval: float) -> float:
    """Seconds between two of a loop's own looks at its heartbeats past which the loop
    itself stalled (paused, starved), so that its peer's silence meanwhile is not the
    peer's: twice the interval at which it looks, and at least half a second."""
    return max(2 * interval, 0.5)


def resolve_heartbeat(heartbeat: float | None, heartbeat_timeout: float | None) -> tuple[float, float]:
    """Heartbeat interval and timeout (seconds): explicit, else the environment, else the defaults.

    Raises:
        ConfigError: a variable does not parse, the interval is negative or the timeout not
            positive, or the interval is not shorter than the timeout.
    """
    interval = resolve(heartbeat, OMNIREDUCE_HEARTBEAT, DEFAULT_HEARTBEAT, float)
    timeout = resolve(heartbeat_timeout, OMNIREDUCE_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT, float)
    # At most 2**31 - 1 ms: the communication threads poll for int milliseconds.
    check_number("heartbeat", interval, positive=False, maximum=_MAX_SOCKET_S)
    check_number("heartbeat_timeout", timeout, maximum=_MAX_SOCKET_S)
    if interval >= timeout:
        # The peer's answer to a heartbeat is what keeps a quiet connection up: it must be
        # able to come back within the timeout.
        raise ConfigError(f"heartbeat ({interval:g} s) must be shorter than heartbeat_timeout ({timeout:g} s)")
    return interval, timeout
