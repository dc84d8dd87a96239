#!/usr/bin/env bash
# The GPU checklist (../shared/GPU.md) in one command, one markdown report.
#
#   bash scripts/gpu_check.sh [--smoke] [--out DIR]      # DIR/report.md (default out/gpu_check)
#
# On a GPU machine (every stage time-boxed; the whole run stays under 10 minutes): the Pallas
# verification kernels compiled for the GPU against their references and timed against XLA
# (Mosaic GPU vs Triton vs the jnp reference, scripts/bench_verify.py), a speculative-test
# subset (greedy SD == plain through the kernel, the lossless distribution tests), a >= 1B
# widened bench target built on the spot (scripts/make_bench_model.py: the shipped model's
# function, so the real acceptance) and probed in bf16 (copy bandwidth, roofline of plain
# decode at batch 1 / 8, greedy SD == plain in bf16, compiled memory vs shapes:
# scripts/gpu_probe.py), the cost model calibrated on it and its predictions of the plain and
# speculative steps against measured (scripts/bench_cost_model.py: the H100/H200 profile the
# cluster simulator prices with; its whole-rollout validation, --rollouts 1, compiles an engine
# per workload and does not fit the 10-minute checklist: run it alone in a GPU session with
# the profile this stage prints), scripts/bench_regime.py on it (SD vs plain at batch 1, 8 and
# the long tail), and a dozen RL steps of the default config, TLT on vs off (scripts/bench_e2e.py).
# Missing Python packages travel as wheels in .whl/ (GPU.md says which) and are installed to
# /tmp/site. A stage that fails or runs out of time is reported as such; the rest still runs.
#
# --smoke: the same stages with tiny settings on the CPU (CI runs it: tests/test_gpu_check.py),
# the regime stage with the speculation gate's rollouts too (the GPU run skips them for time).
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
OUT=out/gpu_check
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --out) OUT=$2; shift ;;
    *) echo "gpu_check.sh: unknown argument '$1' (usage: gpu_check.sh [--smoke] [--out DIR])" >&2
       exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPORT=$OUT/report.md
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export JAX_COMPILATION_CACHE_DIR=$OUT/jax_cache
if [ $SMOKE = 1 ]; then
  export JAX_PLATFORMS=cpu
  # bench model: 2 x the shipped width; stage limits generous (CI machines are slow)
  MODEL_ARGS="--hidden 256 --heads 8 --kv_heads 4 --intermediate 512 --layers 4"
  PROBE_ARGS="--dtype float32 --prompts 2 --max_new_tokens 64 --iters 5"
  REGIME_ARGS="--prompts 1 --tail_prompts 2 --tail_n 2 --arms 3_1_4 --tail_arms 3_1_4
    --max_new_tokens 24 --threshold 2 --gate_rollouts 2 --gate_prompts 1"
  COST_ARGS="--batch_sizes 1,2 --arms 3_1_4 --iters 8 --rollouts 0 --learner 0"
  E2E_STEPS=2
  E2E_EXTRA="--config.train.eval_every=0 --config.eval.num_prompts=16
    --config.grpo.num_prompts=4 --config.grpo.n=4 --config.grpo.micro_batch=16
    --config.rollout.max_new_tokens=96"
  LIMIT=(30 240 240 120 240 300 400 120 240)
  KERNEL_TESTS="-k lower_to or chain_kernel_matches_reference"
  KBENCH_ARGS="--batches 1 --ks 4 --vocab 256 --iters 2"
  SPEC_TESTS="-k strategy_validation"
else
  export JAX_PLATFORMS=cuda XLA_FLAGS=""
  if [ -d .whl ] && compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
  fi
  # ~1.1B params: hidden 2048 (head_dim 32 kept), 24 layers, MLP 5632
  MODEL_ARGS="--hidden 2048 --heads 64 --kv_heads 32 --intermediate 5632 --layers 24"
  PROBE_ARGS="--dtype bfloat16 --prompts 8"
  REGIME_ARGS="--dtype bfloat16 --prompts 4 --tail_prompts 8 --tail_n 4
    --arms 3_1_4,4_1_5,6_1_7,4_2_8 --tail_arms 4_1_5,6_1_7 --gate_rollouts 0"
  COST_ARGS="--dtype bfloat16 --batch_sizes 1,8,64 --arms 4_1_5,4_2_8 --iters 32 --rollouts 0 --learner 0"
  E2E_STEPS=12
  E2E_EXTRA="--config.train.eval_every=0 --config.eval.num_prompts=64"
  LIMIT=(20 60 50 50 100 110 120 30 40)  # 580 s: the checklist stays under 10 minutes
  KERNEL_TESTS=""
  KBENCH_ARGS="--batches 1,8,64 --ks 4,8 --iters 20"
  SPEC_TESTS="-k kernel_equals_reference or sampled_spec_matches or broken_acceptance"
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}

T0=$(date +%s)
{
  echo "# GPU check ($(date -u +%Y-%m-%dT%H:%MZ), $([ $SMOKE = 1 ] && echo smoke on CPU || echo GPU))"
  echo
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); every stage time-boxed;"
  echo "each section ends with its exit status (124: cut off at the limit)."
} > "$REPORT"

# stage NAME LIMIT_S FILTER CMD...: runs CMD under `timeout`, appends what FILTER keeps of its
# log (all: the whole log; md: the markdown it printed; tail: the last 25 lines).
stage() {
  local name=$1 limit=$2 filter=$3
  shift 3
  local log=$OUT/$name.log t=$(date +%s)
  echo "[gpu_check] $name (limit ${limit}s)" >&2
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  {
    echo
    echo "## $name"
    echo
    case $filter in
      md) grep -E '^(#|\||[A-Za-z*].*(:|x|%)|$)' "$log" | grep -v -E '^(WARNING|I[0-9]{4}|W[0-9]{4})' \
            | cat -s | tail -n 80 ;;
      tail) echo '```'; tail -n 25 "$log"; echo '```' ;;
      *) echo '```'; cat "$log"; echo '```' ;;
    esac
    echo
    echo "exit $rc after $(( $(date +%s) - t )) s$([ $rc = 124 ] && echo ": cut off at ${limit} s")"
  } >> "$REPORT"
  return 0
}

BENCH=$OUT/bench_model
stage env "${LIMIT[0]}" all bash -c "nvidia-smi -L 2>/dev/null || echo 'no nvidia-smi';
  $PY -c 'import jax, flax, optax; print(\"jax\", jax.__version__, \"flax\", flax.__version__,
    \"optax\", optax.__version__); print(jax.devices())'"
stage kernels "${LIMIT[1]}" tail "$PY" -m pytest -p no:cacheprovider -v --tb=line \
  tests/test_verify_kernel.py ${KERNEL_TESTS:+"${KERNEL_TESTS%% *}" "${KERNEL_TESTS#* }"}
# shellcheck disable=SC2086
stage kernel_bench "${LIMIT[7]}" md "$PY" scripts/bench_verify.py $KBENCH_ARGS
stage speculative "${LIMIT[2]}" tail "$PY" -m pytest -p no:cacheprovider -v --tb=line \
  tests/test_speculative.py ${SPEC_TESTS:+"${SPEC_TESTS%% *}" "${SPEC_TESTS#* }"}
# shellcheck disable=SC2086
stage bench_model "${LIMIT[3]}" tail "$PY" scripts/make_bench_model.py --out "$BENCH" \
  --overwrite --no_regime $MODEL_ARGS
# shellcheck disable=SC2086
stage probe "${LIMIT[4]}" md "$PY" scripts/gpu_probe.py --bench "$BENCH" --out "$OUT" $PROBE_ARGS
# shellcheck disable=SC2086
stage cost_model "${LIMIT[8]}" md "$PY" scripts/bench_cost_model.py --target "$BENCH" \
  --out "$OUT/cost_model" $COST_ARGS
# shellcheck disable=SC2086
stage bench_regime "${LIMIT[5]}" md "$PY" scripts/bench_regime.py --bench "$BENCH" --skip_regime \
  --skip_hf --out "$OUT/bench_regime" $REGIME_ARGS
stage rl_steps "${LIMIT[6]}" md "$PY" scripts/bench_e2e.py --steps "$E2E_STEPS" --runs on,off --stacks .venv \
  --out "$OUT/e2e" --extra "$E2E_EXTRA"
echo -e "\ntotal $(( $(date +%s) - T0 )) s" >> "$REPORT"
echo "[gpu_check] report: $REPORT" >&2
