"""Who may speak for which rank of which job: tokens, generations and connections.

A worker's connection binds to one rank of one job with HELLO, presenting the
job's token; the job's first HELLO (or, for a job without a token, its first
START) fixes the token and the world size. A HELLO with a newer generation
restarts the job: the engine fails the older generation's ops, and connections of
that generation are refused from then on. A connection refused once for a job
stays refused for it, so it cannot slip in later without a HELLO.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, field

import numpy as np

from aggregator.connections import issued_before
from aggregator.limits import Limits
from omnireduce.errors import OmniReduceError
from omnireduce.protocol import Abort, Blocks, ErrorCode, Hello, Start

logger = logging.getLogger(__name__)

__all__ = ["Refused", "Job", "Binding", "Jobs"]


class Refused(OmniReduceError):
    """The aggregator's ERROR answer to a message it will not take, raised where it is found out.

    By default it refuses that one message: the ERROR goes to its sender only and no
    op is touched (what :class:`Jobs` raises). With ``fails_op`` the message broke
    the op it belongs to: the engine fails that op on every worker that joined it,
    and on the sender.

    Args:
        code: the error code.
        message: why.
        op: the op the ERROR names (a refusal's; None for the connection as a whole).
            A failed op is the message's own, whatever this says.
        ranks: the ranks concerned.
        fails_op: fail the message's op, not only refuse the message.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        op: int | None = None,
        ranks: list[int] | None = None,
        *,
        fails_op: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.op = op
        self.ranks = ranks or []
        self.fails_op = fails_op

    @classmethod
    def op_failure(cls, code: ErrorCode, message: str, ranks: list[int] | None = None) -> Refused:
        """One that fails the message's op on every worker that joined it (``fails_op``)."""
        return cls(code, message, ranks=ranks, fails_op=True)


@dataclass(slots=True)
class Job:
    """One job as the aggregator knows it."""

    name: str
    token: bytes
    generation: int
    world_size: int
    #: rank -> the connection currently bound to it.
    members: dict[int, bytes] = field(default_factory=dict)
    #: rank -> how it went away; the generation's new ops fail until it comes back.
    lost: dict[int, str] = field(default_factory=dict)
    #: rank -> the highest op the job had begun when that rank's worker left on purpose (BYE): the
    #: generation's ops beyond it fail until the rank comes back (a new worker of it numbers
    #: from 0 again, and its first ops, up to the mark, wait for it as before).
    left: dict[int, int] = field(default_factory=dict)
    #: the highest op number begun in this generation (-1: none).
    high: int = -1
    #: rank -> why its last HELLO was refused (an op that times out waiting for it says so).
    refused: dict[int, str] = field(default_factory=dict)
    #: op numbers in flight.
    ops: set[int] = field(default_factory=set)
    #: bytes its ops in flight hold.
    held: int = 0
    #: smoothed samples per second of each rank (weighted ops with compute times), for batch balancing.
    speeds: np.ndarray | None = None


@dataclass(slots=True)
class Binding:
    """What a connection is to a job: its rank, in which generation, or why it was refused."""

    rank: int
    generation: int
    refused: tuple[ErrorCode, str] | None = None


class Jobs:
    """The jobs and the connections bound to them.

    Args:
        limits: caps on jobs at once, world size and jobs per connection.
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._jobs: dict[str, Job] = {}
        self._bindings: dict[bytes, dict[str, Binding]] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, name: str) -> Job | None:
        return self._jobs.get(name)

    def __getitem__(self, name: str) -> Job:
        return self._jobs[name]

    def hello(self, peer: bytes, msg: Hello) -> tuple[Job, list[int]]:
        """Binds ``peer`` to a rank of a job.

        Returns:
            The job, and the op numbers in flight of the generation this HELLO
            replaces (the caller fails them); empty unless the job restarted.

        Raises:
            Refused: wrong token, older generation, different world size, or a limit;
                the connection then stays refused for the job.
        """
        try:
            token = msg.token.encode()
            j = self._jobs.get(msg.job)
            if j is None:
                self._check_room(peer, msg.job)
                j = self._new_job(msg.job, token, msg.generation, msg.world_size)
            elif not hmac.compare_digest(token, j.token):
                raise Refused(ErrorCode.AUTH, "wrong job token")
            stale: list[int] = []
            if msg.generation < j.generation:
                raise Refused(
                    ErrorCode.STALE, f"generation {msg.generation} is older than the job's generation {j.generation}"
                )
            if msg.generation > j.generation:
                self._check_world(msg.world_size)
                # Refused before anything changes: a HELLO refused must not restart the job.
                self._check_bound_jobs(peer, j.name)
                logger.warning(
                    "job=%r: restarted as generation %d by rank %d (was %d); failing its %d ops in flight",
                    j.name, msg.generation, msg.rank, j.generation, len(j.ops),
                )
                stale = sorted(j.ops)
                j.generation, j.world_size = msg.generation, msg.world_size
                j.members.clear()
                j.lost.clear()
                j.left.clear()
                j.high = -1
                j.refused.clear()
            elif msg.world_size != j.world_size:
                raise Refused(
                    ErrorCode.MISMATCH,
                    f"rank {msg.rank} says the job has {msg.world_size} workers, the job has {j.world_size}",
                    ranks=[msg.rank],
                )
            self._bind(peer, j, msg.rank)
            return j, stale
        except Refused as e:
            bound = self._bindings.setdefault(peer, {})
            before = bound.get(msg.job)
            j = self._jobs.get(msg.job)
            if before is not None and j is not None and j.members.get(before.rank) == peer:
                del j.members[before.rank]  # a refused connection holds no rank
            if j is not None and 0 <= msg.rank < j.world_size and msg.rank not in j.members:
                # Its ops never come: the others' wait for their timeout, which then says why.
                j.refused[msg.rank] = f"{e.code.name}: {e.message}"
            if msg.job in bound or len(bound) < self.limits.max_jobs_per_connection:
                bound[msg.job] = Binding(msg.rank, msg.generation, (e.code, e.message))
            elif not bound:
                del self._bindings[peer]
            raise

    def admit(self, peer: bytes, msg: Start | Blocks | Abort) -> Job:
        """The job of a START, BLOCKS or ABORT, once sure the connection may speak for the message's rank.

        Raises:
            Refused: the connection is not (or no longer) bound to that rank of the job.
        """
        b = self._bindings.get(peer, {}).get(msg.job)
        j = self._jobs.get(msg.job)
        if b is None:
            # A connection without HELLO (an old-style client) may only use a job without a token.
            if j is None:
                if not isinstance(msg, Start):
                    raise Refused(ErrorCode.UNKNOWN_OP, "no such op in flight", msg.op, [msg.rank])
                self._check_room(peer, msg.job)
                j = self._new_job(msg.job, b"", 0, msg.world_size)
            elif j.token:
                raise Refused(ErrorCode.AUTH, "this connection has not presented the job's token", msg.op)
            if msg.rank >= j.world_size:
                raise Refused(
                    ErrorCode.MISMATCH, f"rank {msg.rank} is not in the job's world of size {j.world_size}",
                    msg.op, [msg.rank],
                )
            self._bind(peer, j, msg.rank)
            return j
        if b.refused is not None:
            raise Refused(b.refused[0], b.refused[1], msg.op, [msg.rank])
        if j is None or b.generation != j.generation:
            now = "is gone" if j is None else f"runs generation {j.generation}"
            raise Refused(ErrorCode.STALE, f"this connection joined generation {b.generation}; the job {now}", msg.op)
        if msg.rank != b.rank:
            raise Refused(
                ErrorCode.PROTOCOL, f"this connection is rank {b.rank} of the job, not rank {msg.rank}",
                msg.op, [msg.rank],
            )
        if j.members.get(b.rank) != peer:
            # Taken over by a newer connection, or a job of the same name made anew (maybe with
            # another token) since this one joined: it speaks for that rank no more.
            raise Refused(ErrorCode.STALE, f"this connection no longer holds rank {b.rank} of the job (another "
                                           f"connection took it over, or the job was made anew)", msg.op)
        return j

    def unbind(self, peer: bytes, reason: str) -> list[tuple[Job, int, bool | None]]:
        """Forgets a connection that went away.

        Returns:
            For each job it was bound to: the job, its rank, and True if that rank is
            now lost, False if another connection had taken the rank over, None if
            the binding was refused or of an older generation (nothing lost, but
            the job may now be idle).
        """
        out: list[tuple[Job, int, bool | None]] = []
        for name, b in self._bindings.pop(peer, {}).items():
            j = self._jobs.get(name)
            if j is None:
                continue
            if b.refused is not None or b.generation != j.generation:
                out.append((j, b.rank, None))
                continue
            lost = j.members.get(b.rank) == peer
            if lost:
                del j.members[b.rank]
                j.lost[b.rank] = reason
            out.append((j, b.rank, lost))
        return out

    def leave(self, peer: bytes, job: str, rank: int) -> tuple[Job, bool] | None:
        """A connection's rank leaves its job on purpose (BYE); returns the job if it was a member,
        and whether it held its rank (no newer connection had taken it over)."""
        bound = self._bindings.get(peer, {})
        b = bound.get(job)
        j = self._jobs.get(job)
        if b is None or b.refused is not None or b.rank != rank or j is None or b.generation != j.generation:
            return None
        del bound[job]
        if not bound:
            del self._bindings[peer]
        held = j.members.get(rank) == peer
        if held:
            del j.members[rank]
            j.left[rank] = j.high
        logger.info("job=%r gen=%d rank=%d: left", job, j.generation, rank)
        return j, held

    def drop_if_idle(self, j: Job) -> bool:
        """Forgets a job nobody is connected to, with nothing in flight (its token too); True if it did."""
        if j.members or j.ops or self._jobs.get(j.name) is not j:
            return False
        del self._jobs[j.name]
        logger.info("job=%r gen=%d: no worker left; job forgotten", j.name, j.generation)
        return True

    def _check_world(self, world_size: int) -> None:
        if world_size > self.limits.max_world_size:
            raise Refused(ErrorCode.LIMIT, f"world size {world_size} exceeds the limit of {self.limits.max_world_size}")

    def _check_bound_jobs(self, peer: bytes, job: str) -> None:
        bound = self._bindings.get(peer, {})
        if job not in bound and len(bound) >= self.limits.max_jobs_per_connection:
            raise Refused(
                ErrorCode.LIMIT, f"one connection may join at most {self.limits.max_jobs_per_connection} jobs"
            )

    def _check_room(self, peer: bytes, job: str) -> None:
        self._check_bound_jobs(peer, job)
        if len(self._jobs) >= self.limits.max_jobs:
            raise Refused(ErrorCode.LIMIT, f"the aggregator serves its limit of {self.limits.max_jobs} jobs")

    def _new_job(self, name: str, token: bytes, generation: int, world_size: int) -> Job:
        self._check_world(world_size)
        j = Job(name, token, generation, world_size)
        self._jobs[name] = j
        logger.info(
            "job=%r gen=%d: new job of %d workers%s", name, generation, world_size, " with a token" if token else ""
        )
        return j

    def _bind(self, peer: bytes, j: Job, rank: int) -> None:
        holder = j.members.get(rank)
        if holder is not None and holder != peer and issued_before(peer, holder):
            # A late HELLO of a connection that closed (its worker connected again, and the
            # newer connection's HELLO was read first): it never takes the rank back.
            raise Refused(ErrorCode.STALE, f"rank {rank} is held by a newer connection of the job")
        self._check_bound_jobs(peer, j.name)
        bound = self._bindings.setdefault(peer, {})
        before = bound.get(j.name)
        if before is not None and before.rank != rank and j.members.get(before.rank) == peer:
            # One connection is one rank: it leaves the rank it held.
            del j.members[before.rank]
        bound[j.name] = Binding(rank, j.generation)
        old = j.members.get(rank)
        if old is not None and old != peer:
            logger.warning(
                "job=%r gen=%d rank=%d: connection %s replaces %s", j.name, j.generation, rank, peer.hex(), old.hex()
            )
        j.members[rank] = peer
        j.left.pop(rank, None)
        j.refused.pop(rank, None)
        if j.lost.pop(rank, None) is not None:
            logger.info("job=%r gen=%d rank=%d: connected again", j.name, j.generation, rank)
