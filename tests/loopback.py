"""Moved to :mod:`tests.helpers` (the in-process loopback); kept for the modules that still import it
from here (tests/test_integers.py). Import from :mod:`tests.helpers` instead."""

from tests.helpers import peer_of, run_allreduce, wire

__all__ = ["peer_of", "run_allreduce", "wire"]
