"""Registers the "omnireduce" torch.distributed backend when torch is imported.

The package declares :func:`omnireduce_autoload.register`, which calls this module's
:func:`register`, under torch's ``torch.backends`` entry point group, which ``import
torch`` (2.5 and later) loads and calls, so ``dist.init_process_group("omnireduce")`` works in a script
that never imports this project. It imports nothing of the project: the backend
itself (:mod:`worker.backend`, ZeroMQ, Numba) loads only when a group is made.
It never makes ``import torch`` fail (torch would raise for an entry point that
does): a failure is logged and the backend is then simply not registered.
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns torch's loading of entry points off.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["BACKEND_NAME", "register"]

BACKEND_NAME = "omnireduce"


def _create(opts: Any, pg_options: Any = None) -> Any:
    from worker.backend import create_process_group

    return create_process_group(opts, pg_options)


def register() -> None:
    """Registers the backend with torch.distributed, once; never raises."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or BACKEND_NAME.upper() in dist.Backend._plugins:
            return
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
    except Exception:  # noqa: BLE001 - must not break `import torch`
        logger.warning("could not register the %r torch.distributed backend", BACKEND_NAME, exc_info=True)
