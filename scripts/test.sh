#!/usr/bin/env bash
# Installs everything the tests need, then runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
