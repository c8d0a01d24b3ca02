#!/usr/bin/env bash
# Creates .venv and installs omnireduce with its test and torch extras.
# torch is pinned first to the CPU build (2.13.0) so pip never resolves a newer CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,torch,bench]'
