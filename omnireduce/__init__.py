"""omnireduce: sparse gradient aggregation for distributed deep learning.

This package holds what the aggregator and the workers share: the wire
protocol, the block layout and detection kernels, configuration and errors.
"""

from omnireduce.dtypes import DType
from omnireduce.errors import (
    AggregatorError,
    ConfigError,
    MismatchError,
    OmniReduceError,
    OpError,
    OpTimeoutError,
    ProtocolError,
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
    "WorkerClosedError",
    "__version__",
]
