"""Settings shared by the aggregator and the workers, and where they come from.

Precedence, highest first: an explicit argument, then the environment variable,
then the default below. torchrun's ``RANK`` and ``WORLD_SIZE`` are read as-is so a
worker launched by torchrun needs no extra configuration.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from omnireduce.errors import ConfigError

__all__ = [
    "OMNIREDUCE_ADDRESS",
    "OMNIREDUCE_JOB",
    "OMNIREDUCE_BLOCK_SIZE",
    "OMNIREDUCE_MESSAGE_BLOCKS",
    "OMNIREDUCE_STREAMS",
    "OMNIREDUCE_TIMEOUT",
    "RANK",
    "WORLD_SIZE",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MESSAGE_BLOCKS",
    "DEFAULT_STREAMS",
    "DEFAULT_TIMEOUT",
    "DEFAULT_JOB",
    "resolve",
]

#: Aggregator address a worker connects to, e.g. ``tcp://198.18.0.2:5555``.
OMNIREDUCE_ADDRESS = "OMNIREDUCE_ADDRESS"
#: Job id shared by the workers of one training job.
OMNIREDUCE_JOB = "OMNIREDUCE_JOB"
#: Elements per block (OmniReduce's block_size).
OMNIREDUCE_BLOCK_SIZE = "OMNIREDUCE_BLOCK_SIZE"
#: Blocks per message, one per column of a stream (OmniReduce's message_size / block_size).
OMNIREDUCE_MESSAGE_BLOCKS = "OMNIREDUCE_MESSAGE_BLOCKS"
#: Streams (slots) that proceed in parallel within one op.
OMNIREDUCE_STREAMS = "OMNIREDUCE_STREAMS"
#: Seconds a worker waits for the aggregator before failing an op.
OMNIREDUCE_TIMEOUT = "OMNIREDUCE_TIMEOUT"
#: torchrun's names for the worker's rank and the number of workers.
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"

DEFAULT_BLOCK_SIZE = 256
DEFAULT_MESSAGE_BLOCKS = 256
DEFAULT_STREAMS = 4
DEFAULT_TIMEOUT = 60.0
DEFAULT_JOB = "default"

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
