#!/usr/bin/env bash
# Sets up (scripts/setup.sh --dev: the test set too) and runs the whole test suite on CPU (8 fake devices).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
exec .venv/bin/python -m pytest -n 2 --dist loadfile -q "$@"
