#!/usr/bin/env bash
# Installs omnireduce, then runs an aggregator daemon and 3 worker processes on a sparse tensor.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/omnireduce-demo "$@"
