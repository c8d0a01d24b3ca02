"""A worker's settings, resolved once from arguments and the environment.

Every kind of worker (one aggregator, several shards, co-located shards) is
built from one frozen :class:`WorkerSettings`: a sharded worker hands the same
settings to each shard's connection, so they cannot drift apart.

Precedence, for every field: the argument, else its ``OMNIREDUCE_*`` (or torch's
``RANK``/``WORLD_SIZE``) environment variable, else the default.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from omnireduce import config
from omnireduce.errors import ConfigError
from omnireduce.layout import EAGER_PIECES, Layout
from omnireduce.protocol import MAX_NAME
from worker.auto import MODES

__all__ = ["SettingsView", "WorkerSettings"]


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What a worker of one rank of one job needs to know, validated.

    Build it with :meth:`resolve`; see :class:`worker.client.Worker` for what each
    field means.
    """

    rank: int
    world_size: int
    job: str
    block_size: int
    message_blocks: int
    streams: int
    timeout: float
    token: str
    generation: int
    heartbeat: float
    heartbeat_timeout: float
    curve_server_key: str | None
    curve_client_key: str | None
    mode: str
    #: Most STARTs an eager op's payload is cut in (omnireduce.layout.eager_start_blocks);
    #: a sharded worker gives each shard its share.
    eager_pieces: int = EAGER_PIECES
    #: The largest frame the aggregators accept (their ``--max-message-bytes``).
    max_message_bytes: int = config.DEFAULT_MAX_MESSAGE_BYTES

    def with_timeout(self, seconds: float) -> WorkerSettings:
        """These settings with the op timeout ``seconds``.

        Raises:
            ConfigError: ``seconds`` is not a positive finite number.
        """
        config.check_number("timeout", seconds)
        return dataclasses.replace(self, timeout=float(seconds))

    @property
    def curve(self) -> bool:
        """Whether connections are encrypted and authenticated with CURVE."""
        return self.curve_server_key is not None

    @classmethod
    def resolve(
        cls,
        rank: int | None = None,
        world_size: int | None = None,
        job: str | None = None,
        block_size: int | None = None,
        message_blocks: int | None = None,
        streams: int | None = None,
        timeout: float | None = None,
        *,
        token: str | None = None,
        generation: int | None = None,
        heartbeat: float | None = None,
        heartbeat_timeout: float | None = None,
        curve_server_key: str | os.PathLike[str] | None = None,
        curve_client_key: str | os.PathLike[str] | None = None,
        mode: str | None = None,
        max_message_bytes: int | None = None,
    ) -> WorkerSettings:
        """Settings from arguments, else the environment, else the defaults.

        Raises:
            ConfigError: a value is missing or out of range.
        """
        heartbeat, heartbeat_timeout = config.resolve_heartbeat(heartbeat, heartbeat_timeout)
        settings = cls(
            rank=config.check_integer("rank", config.resolve(rank, config.RANK, None, int)),
            world_size=config.check_integer("world_size", config.resolve(world_size, config.WORLD_SIZE, None, int)),
            job=config.resolve(job, config.OMNIREDUCE_JOB, config.default_job(), str),
            block_size=config.resolve(block_size, config.OMNIREDUCE_BLOCK_SIZE, config.DEFAULT_BLOCK_SIZE, int),
            message_blocks=config.resolve(
                message_blocks, config.OMNIREDUCE_MESSAGE_BLOCKS, config.DEFAULT_MESSAGE_BLOCKS, int
            ),
            streams=config.resolve(streams, config.OMNIREDUCE_STREAMS, config.DEFAULT_STREAMS, int),
            timeout=config.resolve(timeout, config.OMNIREDUCE_TIMEOUT, config.DEFAULT_TIMEOUT, float),
            token=config.resolve_secret(token, config.OMNIREDUCE_TOKEN),
            generation=config.resolve_generation(generation),
            heartbeat=heartbeat,
            heartbeat_timeout=heartbeat_timeout,
            curve_server_key=config.resolve_optional(curve_server_key, config.OMNIREDUCE_CURVE_SERVER_KEY, str),
            curve_client_key=config.resolve_optional(curve_client_key, config.OMNIREDUCE_CURVE_CLIENT_KEY, str),
            mode=config.resolve(mode, config.OMNIREDUCE_MODE, config.DEFAULT_MODE, str),
            max_message_bytes=config.check_integer("max_message_bytes", config.resolve(
                max_message_bytes, config.OMNIREDUCE_MAX_MESSAGE_BYTES, config.DEFAULT_MAX_MESSAGE_BYTES, int)),
        )
        settings._validate()
        return settings

    def _validate(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not in a world of size {self.world_size}")
        for name in ("job", "token"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string, got {getattr(self, name)!r}")
        if not self.job or len(self.job) > 200:
            raise ConfigError(f"job id must be 1 to 200 characters, got {self.job!r}")
        if len(self.token) > MAX_NAME:
            raise ConfigError(f"token must be at most {MAX_NAME} characters")
        # Not inf or NaN either: the deadline becomes a poll timeout in whole milliseconds,
        # and the communication thread would die converting it.
        config.check_number("timeout", self.timeout)
        if self.curve_client_key is not None and self.curve_server_key is None:
            raise ConfigError("curve_client_key needs curve_server_key (the aggregator's public key)")
        Layout(0, self.block_size, self.message_blocks, self.streams)  # validates the three
        if self.max_message_bytes < 1:
            raise ConfigError(f"max_message_bytes must be positive, got {self.max_message_bytes}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")


class SettingsView:
    """The settings of a worker (its ``settings`` attribute) as read-only attributes."""

    settings: WorkerSettings

    @property
    def rank(self) -> int:
        return self.settings.rank

    @property
    def world_size(self) -> int:
        return self.settings.world_size

    @property
    def job(self) -> str:
        return self.settings.job

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    @property
    def message_blocks(self) -> int:
        return self.settings.message_blocks

    @property
    def streams(self) -> int:
        return self.settings.streams

    @property
    def timeout(self) -> float:
        return self.settings.timeout

    @property
    def generation(self) -> int:
        return self.settings.generation

    @property
    def mode(self) -> str:
        return self.settings.mode

    @property
    def curve(self) -> bool:
        return self.settings.curve
