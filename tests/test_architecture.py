"""The package layering: ``omnireduce/`` is the shared core and imports neither side.

``aggregator/`` and ``worker/`` both import the core; the core imports neither of them
(nor ``bench/``, where tools that drive both sides live, e.g. ``bench.calibrate``), and
``aggregator/`` does not import ``worker/``. The light core modules (the cost model and
the protocol) do not load Numba, so tools that only predict or decode stay cheap to import.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Modules that need Numba's CUDA target (numba-cuda) to import; a base install may lack it.
CUDA_MODULES = {"omnireduce.kernels.cuda", "omnireduce.kernels.cuda_kernels"}


def _in_fresh_python(code: str) -> Any:
    """Runs ``code`` in a new interpreter (nothing imported yet) and returns the JSON it prints last."""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def _imported_names(path: Path) -> set[str]:
    """Every absolute module a file imports, at module level or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _offenders(package: str, forbidden: set[str]) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = sorted(n for n in _imported_names(path) if n.split(".")[0] in forbidden)
        if bad:
            out.append(f"{path.relative_to(ROOT)}: {', '.join(bad)}")
    return out


def test_importing_every_core_module_loads_neither_side() -> None:
    code = f"""
import importlib, json, pkgutil, sys
import omnireduce
cuda_only = {sorted(CUDA_MODULES)!r}
imported, skipped = [], {{}}
for m in pkgutil.walk_packages(omnireduce.__path__, "omnireduce."):
    try:
        importlib.import_module(m.name)
    except ImportError as e:
        if m.name not in cuda_only:
            raise
        skipped[m.name] = str(e)
        continue
    imported.append(m.name)
sides = sorted(k for k in sys.modules if k.split(".")[0] in ("aggregator", "worker", "bench"))
print(json.dumps({{"imported": imported, "skipped": skipped, "sides": sides}}))
"""
    got = _in_fresh_python(code)
    # The walk found the package's modules (a wrong path would pass vacuously).
    assert {"omnireduce.protocol", "omnireduce.model", "omnireduce.blocks", "omnireduce.kernels.cpu"} <= set(
        got["imported"]
    ), got
    assert set(got["skipped"]) <= CUDA_MODULES, got["skipped"]
    assert got["sides"] == [], f"importing the core loaded {got['sides']}"


def test_core_sources_import_neither_side() -> None:
    # Also the imports inside functions, which importing the modules does not run.
    assert _offenders("omnireduce", {"aggregator", "worker", "bench", "tests"}) == []


def test_aggregator_does_not_import_the_worker() -> None:
    assert _offenders("aggregator", {"worker", "bench", "tests"}) == []


@pytest.mark.parametrize("module", ["omnireduce", "omnireduce.model", "omnireduce.protocol", "omnireduce.config"])
def test_light_core_modules_do_not_load_numba(module: str) -> None:
    got = _in_fresh_python(
        f"import json, sys, {module}\n"
        "print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in ('numba', 'llvmlite', 'torch'))))"
    )
    assert got == [], f"import {module} loaded {got[:5]}"


def _module_level_imports(path: Path) -> set[str]:
    """The absolute modules a file imports at module level (not inside functions or TYPE_CHECKING)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_worker_modules_import_no_cycle() -> None:
    # Module-level imports only: the one function-level import back (the deprecated
    # Worker([...]) shim making a ShardedWorker) goes away with the shim.
    modules = {f"worker.{p.stem}": p for p in (ROOT / "worker").glob("*.py") if p.stem != "__init__"}
    graph = {m: {n for n in _module_level_imports(p) if n in modules} for m, p in modules.items()}
    # sharded imports client, colocated imports sharded: the chain runs one way.
    assert "worker.client" in graph["worker.sharded"] and "worker.sharded" in graph["worker.colocated"]
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import cycle: {' -> '.join((*path, m))}"
        if m in done:
            return
        for n in sorted(graph[m]):
            visit(n, (*path, m))
        done.add(m)

    for m in sorted(graph):
        visit(m, ())
