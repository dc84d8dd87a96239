#!/usr/bin/env bash
# Creates .venv-trl (once): a separate, jax-free venv with Hugging Face TRL for the TRL GRPO
# baseline (scripts/bench_trl_grpo.py). Everything is pinned; only the package registry is used
# (no model or dataset downloads). Re-running is cheap: it reinstalls only when the pins below
# (or this script) change.
#
#   bash scripts/bench_trl_setup.sh
#   .venv-trl/bin/python scripts/bench_trl_grpo.py --out out/trl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-trl

# torch is installed first and on its own, pinned to the local CPU wheel, so nothing later pulls
# a CUDA build. The rest is the newest TRL with the transformers/accelerate it works with.
TORCH_PIN="torch==2.13.0"
PINS=(
  "trl==1.16.0"
  "transformers==5.23.0"
  "tokenizers==0.23.3"
  "accelerate==1.15.0"
  "datasets==5.2.0"
  "numpy==2.4.6"
  "safetensors"
  "tqdm"
)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.bench_trl_requirements.sha
want=$( { echo "$TORCH_PIN"; printf '%s\n' "${PINS[@]}"; cat "$0"; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "$TORCH_PIN"
  # Keep torch where it is: a resolver that wanted another torch would fail here rather than
  # silently download a CUDA build.
  "$VENV/bin/python" -m pip install -q "${PINS[@]}" "$TORCH_PIN"
  # tlt_jax itself (the task: tlt_jax.data.arith, numpy only), editable and without its
  # dependencies: this venv stays jax-free.
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
for p in ("torch", "trl", "transformers", "accelerate", "datasets", "tokenizers", "numpy"):
  print(f"  {p}=={md.version(p)}")
EOF
  echo "$want" > "$stamp"
fi
