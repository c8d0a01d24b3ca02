"""omnireduce: sparse gradient aggregation for distributed deep learning.

This package holds what the aggregator and the workers share: the wire
protocol, the block layout and detection kernels, configuration and errors.
"""

from omnireduce.dtypes import DType
from omnireduce.errors import (
    AggregatorError,
    AuthError,
    CollectiveError,
    ConfigError,
    ConnectionLostError,
    LimitError,
    MismatchError,
    OmniReduceError,
    OpError,
    OpTimeoutError,
    PeerLostError,
    PeerRefusedError,
    ProtocolError,
    StaleGenerationError,
    WorkerClosedError,
)
from omnireduce.layout import Layout

__version__ = "0.1.0"

__all__ = [
    "DType",
    "Layout",
    "OmniReduceError",
    "ConfigError",
    "ProtocolError",
    "OpError",
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
    "__version__",
]
