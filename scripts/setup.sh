#!/usr/bin/env bash
# Creates .venv (once) and installs what the main job needs (requirements.txt) + tlt_jax
# (editable); `setup.sh --dev` also the test set (requirements-dev.txt: torch as the parity
# tests' reference, pytest, scipy, notebooks), which the main job never imports.
# Re-running is cheap: it reinstalls only when a requirements file or the interpreter changed.
# Interpreter: $PYTHON if set, else python3.12 if found (JAX >= 0.11 needs Python >= 3.12, so
# the newest JAX is tested where 3.12 exists), else python3 (on 3.11 pip picks jax 0.10.x).
# $VENV names the environment (default .venv): the second supported stack for benchmarks is
#   PYTHON=python3.11 VENV=.venv-py311 bash scripts/setup.sh     (Python 3.11, JAX 0.10.x)
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0
if [ "${1:-}" = --dev ]; then DEV=1; fi
VENV=${VENV:-.venv}
pyver() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true; }
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  # The first that runs (a pyenv shim for a version that is not selected is found but fails).
  for p in python3.12 "${PYENV_ROOT:-${HOME:-}/.pyenv}"/versions/3.12*/bin/python3.12 \
           /root/.pyenv/versions/3.12*/bin/python3.12 python3; do
    if [ -n "$(pyver "$p")" ]; then PY=$p; break; fi
  done
  PY=${PY:-python3}
fi
want_ver=$(pyver "$PY")
if [ -z "$want_ver" ]; then
  echo "setup.sh: cannot run the Python interpreter '$PY'" >&2
  exit 1
fi
if [ -e "$VENV" ] && [ "$(pyver "$VENV"/bin/python)" != "$want_ver" ]; then
  rm -rf "$VENV"  # made with another Python (major.minor): rebuild it with $PY
fi
if [ ! -x "$VENV"/bin/python ]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.tlt_requirements.sha
want=$( (cat requirements.txt pyproject.toml; "$VENV"/bin/python -V) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$VENV"/bin/python -m pip install -q -r requirements.txt
  "$VENV"/bin/python -m pip install -q --no-deps -e .
  echo "$want" > "$stamp"
fi
dev_stamp=$VENV/.tlt_dev_requirements.sha
dev_want=$( (cat requirements-dev.txt; echo "$want") | sha256sum | cut -d' ' -f1)
if [ $DEV = 1 ] && [ "$(cat "$dev_stamp" 2>/dev/null)" != "$dev_want" ]; then
  # torch first, pinned, so nothing later pulls another build (it is only the test reference):
  # the CPU wheel on 3.11 test machines, the PyPI (CUDA) build on 3.12.
  "$VENV"/bin/python -m pip install -q torch==2.13.0
  "$VENV"/bin/python -m pip install -q -r requirements-dev.txt
  echo "$dev_want" > "$dev_stamp"
fi
"$VENV"/bin/python -c "import sys; from importlib.metadata import version as v
print('setup.sh: $VENV has Python %s, jax %s' % (sys.version.split()[0], v('jax')))"
