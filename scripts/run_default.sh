#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m tlt_jax.train --config configs/default.py "$@"
