"""Benchmarks of omnireduce against gloo: on loopback (:mod:`bench.allreduce`) and on an
emulated cluster network of namespaces and shaped links (:mod:`bench.cluster`).

Both run the same rank processes (:mod:`bench.procs`): every rank times gloo's dense
``all_reduce``, gloo's sparse COO ``all_reduce`` and omnireduce (sparse, dense or auto
mode) on the same tensors, in the same process.
"""
