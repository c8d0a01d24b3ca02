"""torch's entry point for the "omnireduce" torch.distributed backend (``import torch`` calls it).

It lives in this package, not in ``worker``, so that ``import torch`` never runs a user's own
``worker.py`` (a common name) in the current directory, nor fails on it: torch imports an entry
point's module before calling it, outside any handler of ours. :func:`register` makes sure
the ``worker`` package it would load is this project's before loading it; if not (or on any
other failure), it logs and the backend is simply not registered.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["register"]


def register() -> None:
    """Registers the backend with torch.distributed (:func:`worker.autoload.register`); never raises."""
    try:
        spec = importlib.util.find_spec("worker")
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        ours = Path(__file__).resolve().parent / "worker" / "__init__.py"
        if origin != ours:
            logger.warning("the 'omnireduce' torch.distributed backend is not registered: 'worker' here is %s, not "
                           "omnireduce's package at %s (a module of that name in the current directory?)",
                           origin, ours.parent)
            return
        from worker.autoload import register as register_backend

        register_backend()
    except Exception:  # noqa: BLE001 - must not break `import torch`
        logger.warning("could not register the 'omnireduce' torch.distributed backend", exc_info=True)
