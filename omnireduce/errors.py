"""The exception hierarchy shared by the aggregator and the workers.

Every error the library raises derives from :class:`OmniReduceError`, so a
training loop can catch one type. Subclasses also derive from the matching
builtin (``TimeoutError``, ``ValueError``, ...) so generic handlers still work.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "OmniReduceError",
    "ConfigError",
    "OpError",
    "ProtocolError",
    "MismatchError",
    "OpTimeoutError",
    "AggregatorError",
    "LimitError",
    "StaleGenerationError",
    "PeerLostError",
    "PeerRefusedError",
    "ConnectionLostError",
    "AuthError",
    "WorkerClosedError",
    "CollectiveError",
]


class OmniReduceError(Exception):
    """Base class of every error raised by omnireduce."""


class ConfigError(OmniReduceError, ValueError):
    """A setting, argument or input tensor is invalid."""


class ProtocolError(OmniReduceError):
    """A message could not be decoded or violates the protocol."""


class OpError(OmniReduceError):
    """An error tied to one collective operation of one job.

    Args:
        message: what went wrong.
        job: the job id.
        op: the op number within the job, or None when the whole job is affected.
        ranks: the ranks concerned (e.g. the ones that did not answer).
    """

    def __init__(
        self,
        message: str,
        *,
        job: str | None = None,
        op: int | None = None,
        ranks: Iterable[int] = (),
    ) -> None:
        self.job = job
        self.op = op
        self.ranks = tuple(sorted(ranks))
        where = []
        if job is not None:
            where.append(f"job={job!r}")
        if op is not None:
            where.append(f"op={op}")
        if self.ranks:
            where.append(f"ranks={list(self.ranks)}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.reason = message


class MismatchError(OpError, ValueError):
    """Workers of one op disagree on length, dtype or layout."""


class OpTimeoutError(OpError, TimeoutError):
    """An op did not complete in time; ``ranks`` names the ranks that were missing."""


class AggregatorError(OpError):
    """The aggregator reported an error for an op or a job."""


class LimitError(AggregatorError):
    """The aggregator refused work beyond one of its limits (jobs, ops in flight, bytes held, sizes),
    or the worker did before sending it (messages above ``max_message_bytes``)."""


class StaleGenerationError(AggregatorError):
    """The job was restarted with a newer generation; this worker's ops belong to an older one."""


class PeerLostError(OpError, ConnectionError):
    """Another worker of the job disconnected or stopped answering; ``ranks`` names it.

    The op cannot complete: restart the job (a new generation) from a checkpoint.
    """


class PeerRefusedError(OpError, ValueError):
    """A worker of the op refused it before sending any of it: its arguments failed a check
    on its side (there it raised that check's error). ``ranks`` names it; the message says why.
    """


class ConnectionLostError(OpError, ConnectionError):
    """This worker lost its connection to the aggregator while the op was in flight."""


class AuthError(OpError, PermissionError):
    """The aggregator refused this worker: wrong job token or CURVE key, or no key where one is required."""


class WorkerClosedError(OmniReduceError):
    """The worker was closed, or its communication thread died, while an op was pending."""


class CollectiveError(OmniReduceError, RuntimeError):
    """A torch collective (a process group's op or a DDP bucket) failed on this rank.

    A ``RuntimeError``, as torch's own backends raise; ``__cause__`` is the error of
    the op that failed (e.g. :class:`MismatchError`), whose type and text the
    message repeats.
    """
