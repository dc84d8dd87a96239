#!/usr/bin/env bash
# Creates .venv (once) and installs the pinned requirements + tlt_jax (editable).
# Re-running is cheap: it reinstalls only when a requirements file changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.tlt_requirements.sha
want=$(cat requirements.txt requirements-dev.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # torch first, pinned, so nothing later pulls a CUDA build (it is only the test reference).
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  .venv/bin/python -m pip install -q --no-deps -e .
  echo "$want" > "$stamp"
fi
