"""torch futures completed from the worker's thread, whose failures torch's C++ side sees as failures.

``torch.futures.Future.set_exception`` does not fail a future: it completes it
with the exception *object* as its value and raises only when Python code
unwraps it. C++ consumers (DDP's reducer, torch's collectives) read that value
as a result: DDP then finds no tensor in it and crashes, or steps on. A future
made by ``then`` whose callback raises carries a real error, which ``wait()`` and
``value()`` raise in C++ and in Python alike (as a ``RuntimeError`` whose text
includes the exception's type and message), so that is how these fail.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["Settable"]


class Settable:
    """A torch future (:attr:`future`) to complete once, with a value or an error.

    Example::

        s = Settable()
        return_to_torch(s.future)
        ...
        s.fail(CollectiveError("omnireduce all_reduce failed: ..."))   # from any thread
    """

    __slots__ = ("future", "_source", "_value", "_error", "_lock")

    def __init__(self) -> None:
        self._source: torch.futures.Future = torch.futures.Future()
        self._value: Any = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.future: torch.futures.Future = self._source.then(self._unwrap)

    def _unwrap(self, _source: torch.futures.Future) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def set(self, value: Any) -> None:
        """Completes the future with ``value``."""
        with self._lock:
            self._value = value
            self._source.set_result(None)

    def fail(self, error: BaseException) -> None:
        """Completes the future with ``error``: ``wait()`` and ``value()`` raise it."""
        with self._lock:
            self._error = error
            self._source.set_result(None)

    @classmethod
    def failed(cls, error: BaseException) -> torch.futures.Future:
        """A future that has failed with ``error`` already."""
        s = cls()
        s.fail(error)
        return s.future
