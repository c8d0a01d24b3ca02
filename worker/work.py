"""A collective of the omnireduce process group in flight: torch's ``Work``, settled once every part is."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.errors import CollectiveError
from worker.futures import Settable

logger = logging.getLogger(__name__)

__all__ = ["OmniReduceWork"]


class OmniReduceWork(dist._Work):
    """A collective in flight: completes when every part of it has, fails when any part fails.

    ``wait()`` raises :class:`CollectiveError` if the collective failed, as torch's
    own backends' works do; ``get_future()`` is completed with the collective's
    result or fails with the same error (a ``RuntimeError`` naming it: see
    :mod:`worker.futures`).

    Args:
        parts: (worker future, finish) pairs: ``finish(result)`` writes a part's
            result where it belongs; it runs only once every part succeeded, so a
            failed collective changes no tensor.
        value: the future's value once every part finished.
        what: names the collective in error messages.
        source: a recv from any source's: its ``finish`` appends the sender's rank.
    """

    def __init__(self, parts: list[tuple[ConcurrentFuture, Callable[[Any], None]]], value: Any, what: str,
                 source: list[int] | None = None) -> None:
        super().__init__()
        self._source = source
        self._result = Settable()
        self._what = what
        self._value = value
        self._parts = parts
        self._results: list[Any] = [None] * len(parts)
        self._left = len(parts)
        self._error: CollectiveError | None = None
        self._lock = threading.Lock()
        self._settled = threading.Event()
        if not parts:
            self._settle()
        for i, (src, _) in enumerate(parts):
            src.add_done_callback(lambda s, i=i: self._on_part(i, s))

    def _on_part(self, i: int, src: ConcurrentFuture) -> None:
        try:
            result = src.result()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the Work
            with self._lock:
                first = self._error is None
                if first:
                    self._error = CollectiveError(f"omnireduce {self._what} failed: {type(e).__name__}: {e}")
                    self._error.__cause__ = e
                self._left -= 1
                last = self._left == 0
            if first:
                logger.warning("omnireduce %s failed: %s: %s", self._what, type(e).__name__, e)
            if last:
                self._settle()
            return
        with self._lock:
            self._results[i] = result
            self._left -= 1
            last = self._left == 0
        if last:
            self._settle()

    def _settle(self) -> None:
        # Every part has finished: no worker writes into its tensors any more.
        if self._error is None:
            try:
                # Results are written from a communication thread, where autograd records in-place
                # writes: a parameter (a leaf that requires grad) would refuse them, where gloo's
                # C++ writes it (dist.broadcast(param, 0), the usual way to sync initial weights).
                with torch.no_grad():
                    for (_, finish), result in zip(self._parts, self._results, strict=True):
                        finish(result)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the Work
                if isinstance(e, CollectiveError):
                    # A check of the result (e.g. ranks that disagree), raised before anything is written.
                    logger.warning("omnireduce %s failed: %s", self._what, e)
                else:
                    logger.exception("omnireduce %s: writing the result failed", self._what)
                self._error = CollectiveError(f"omnireduce {self._what} failed: {type(e).__name__}: {e}")
                self._error.__cause__ = e
        self._parts, self._results = [], []
        self._settled.set()
        if self._error is not None:
            self._result.fail(self._error)
        else:
            self._result.set(self._value)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits for the collective; raises :class:`CollectiveError` if it failed.

        Args:
            timeout: how long to wait at most (None or 0: until the collective ends, which the
                group's op timeout bounds, see :func:`_timeout_of`). A collective still running
                then raises :class:`CollectiveError` here, as torch's works do, and goes on: its
                tensors are written if it completes, and a later ``wait()`` says how it ended.
        """
        seconds = None if timeout is None else timeout.total_seconds()
        if seconds is not None and seconds > 0 and not self._settled.wait(seconds):
            raise CollectiveError(f"omnireduce {self._what} did not complete within {seconds:g} s (the timeout "
                                  "given to wait()); it goes on")
        try:
            self._result.future.wait()
        except Exception:
            if self._error is None:
                raise
            raise self._error from None
        return True

    def get_future(self) -> torch.futures.Future:
        return self._result.future

    def _source_rank(self) -> int:
        """The rank a recv from any source took its message from (torch's ``recv`` and
        ``irecv`` callers ask it); waits for the receive first."""
        if self._source is None:
            raise CollectiveError(f"omnireduce {self._what}: only a recv from any source has a source rank")
        self.wait()
        return self._source[0]

    source_rank = _source_rank

    def is_completed(self) -> bool:
        return self._result.future.done()

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> Any:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        value = self._result.future.value()
        return value if isinstance(value, list) else [value]

    def synchronize(self) -> None:
        pass  # CPU only: nothing to order on a device stream
