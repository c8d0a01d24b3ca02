"""Benchmarks of omnireduce against gloo: on loopback (:mod:`bench.allreduce`) and on an
emulated cluster network of namespaces and shaped links (:mod:`bench.cluster`).

Both run the same rank processes (:mod:`bench.procs`): every rank times gloo's dense
``all_reduce``, gloo's sparse COO ``all_reduce`` and omnireduce (sparse, dense or auto
mode) on the same tensors, in the same process.

:mod:`bench.calibrate` (the ``omnireduce-calibrate`` console script) measures the cost
model's parameters. It is installed with the package (``bench`` is in pyproject's
packages) and imports only the base install; it lives here, not in the core, because it
runs an aggregator and workers, and the core (``omnireduce/``) imports neither side.
"""
