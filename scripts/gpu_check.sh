#!/usr/bin/env bash
# The GPU checklist (docs/gpu.md) in one command, one markdown report that opens with its
# headline table.
#
#   bash scripts/gpu_check.sh [--smoke] [--out DIR]      # DIR/report.md (default out/gpu_check)
#   bash scripts/gpu_check.sh --plan [--smoke]           # print each stage's command, run none
#   bash scripts/gpu_check.sh --only rl_steps,learner --scale 2 [--out DIR]
#                         # a warm machine's second call: those stages alone, their limits (and
#                         # the budgets inside them) x 2, the bench target reused from DIR if
#                         # an earlier run there made it; the report covers these stages
#
# On a GPU machine, fresh and with empty caches, every stage is time-boxed and the whole run
# takes at most 9 minutes (the limits below sum to 540 s; most stages end well inside theirs).
# Stages, in order of value (a stage that fails or runs out of time is reported as such; the
# rest still run):
#   env           the device, jax / flax / optax versions
#   decode        plain and speculative decode of the bench target's shape against the copy
#                 bandwidth at batch 1, 8, 64, the engine as it runs on a GPU (fused
#                 projections, paged attention) and its variants: cuBLAS for the narrow dots,
#                 the attention windows, XLA command buffers, no autotuning; a profile of the
#                 step's kernels; compiled memory (scripts/gpu_decode.py)
#   rl_steps      RL steps of the default config on ONE GPU (the main job, python -m
#                 tlt_jax.train), TLT on then off, each run's phases and compile seconds,
#                 TLT off's last step traced (config.profile: device busy / wall)
#   bench_model   the >= 1B widened bench target (scripts/make_bench_model.py: the shipped
#                 model's function, so the real acceptance)
#   bench_regime  SD vs plain on it, batch 1 and 8, greedy (outputs == plain, bf16) and sampled
#                 (scripts/bench_regime.py)
#   learner       a packed RL step's log-prob pass and update on it, the fused attention, the
#                 same with LoRA adapters (rank 64, and its weight sync's time and memory) and
#                 XLA's attention: seconds, parity, the simulator's prediction; the packed
#                 attention alone, ours vs JAX's mha vs XLA's (scripts/gpu_learner.py)
#   experts       a mixture of experts' MLP (one layer of Qwen3-30B-A3B's): the grouped-matmul
#                 kernel's start-up check, a learner micro-batch's forward + backward through it
#                 and through ragged_dot, a rollout step's experts against the copy bandwidth
#                 (scripts/gpu_experts.py)
#   kernel_bench  the verification kernels (Mosaic GPU, Triton) vs the XLA reference
#                 (scripts/bench_verify.py)
#   cost_model    the cost model fitted on the bench target, its predictions of the plain and
#                 speculative steps against measured (scripts/bench_cost_model.py)
#   kernels       a subset of tests/test_verify_kernel.py: the kernels lowered and compiled
#                 for the GPU and equal to their references
#   speculative   a subset of tests/test_speculative.py: greedy SD through the kernel ==
#                 the reference, sampled SD matches the target distribution
# Missing Python packages travel as wheels in .whl/ (docs/gpu.md says which) and are installed
# to /tmp/site.
#
# --smoke: the same stages with tiny settings on the CPU (CI runs it: tests/test_gpu_check.py),
# the regime stage with its long tail, cost section and speculation gate's rollouts too.
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
PLAN=0  # --plan: each stage's command, one line each (name, limit, command), and nothing run:
        # tests/test_gpu_check.py parses the GPU settings' arguments on the CPU with it
OUT=out/gpu_check
ONLY=""  # --only: a comma-separated subset of the stages
SCALE=1  # --scale: every limit (and the time budgets inside the stages) times this
STAGES="env decode bench_model rl_steps bench_regime learner experts kernel_bench cost_model kernels speculative"
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --plan) PLAN=1 ;;
    --out) OUT=$2; shift ;;
    --only) ONLY=$2; shift ;;
    --scale) SCALE=$2; shift ;;
    *) echo "gpu_check.sh: unknown argument '$1' (usage: gpu_check.sh [--smoke] [--plan]" \
         "[--out DIR] [--only STAGE,...] [--scale N])" >&2
       exit 2 ;;
  esac
  shift
done
ONLY=${ONLY// /}  # "rl_steps, learner" as "rl_steps,learner" (the stages match on commas)
for s in ${ONLY//,/ }; do
  case " $STAGES " in
    *" $s "*) ;;
    *) echo "gpu_check.sh: --only $ONLY: no stage '$s'; the stages: ${STAGES// /, }" >&2; exit 2 ;;
  esac
done
case "$SCALE" in
  ''|*[!0-9]*|0*) echo "gpu_check.sh: --scale $SCALE: a whole number >= 1, e.g. --scale 2" >&2
                 exit 2 ;;
esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPORT=$OUT/report.md
BODY=$OUT/sections.md
PY=${PYTHON:-}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export JAX_COMPILATION_CACHE_DIR=$OUT/jax_cache
if [ $SMOKE = 1 ]; then
  export JAX_PLATFORMS=cpu
  # bench model: 2 x the long-tail model's width; stage limits generous (CI machines are slow)
  DECODE_ARGS="--quick --dtype float32 --iters 8 --shape 128,4,2,256,2,32"
  DECODE_SPARE=90  # decode's --budget_s: its limit less this (a cell's run past the budget)
  MODEL_ARGS="--hidden 256 --heads 8 --kv_heads 4 --intermediate 512 --layers 4"
  DTYPE=float32
  # no roofline (the GPU run skips it too; tests/test_bench_model.py checks its bytes)
  REGIME_ARGS="--prompts 1 --tail_prompts 2 --tail_n 2 --arms 3_1_4 --tail_arms 3_1_4
    --max_new_tokens 24 --threshold 2 --gate_rollouts 2 --gate_prompts 1 --skip_roofline"
  COST_ARGS="--batch_sizes 1,2 --arms 3_1_4 --iters 8 --rollouts 0 --learner 0"
  E2E_STEPS=1  # one step of each mode: that the stage runs and its table is read
  # TLT off reuses what TLT on compiled (the learner's programs): on a GPU each mode compiles
  # cold, as a run does; here only that the stage runs is checked
  E2E_CACHE="$OUT/jax_cache"
  E2E_EXTRA="--config.eval.num_prompts=16 --config.grpo.num_prompts=4 --config.grpo.n=4
    --config.grpo.micro_batch=16 --config.rollout.max_new_tokens=96 --config.cpu_devices=1
    --config.reward.num_workers=1"
  LEARNER_ARGS="--dtype float32 --max_len 64 --tokens 256 --samples 12 --steps 1
    --attention 1,128,4,2,16"
  EXPERTS_ARGS="--dims 64,32,8,2 --dtype float32 --tokens 64 --decode 1,16 --iters 2"
  # env decode bench_model rl_steps bench_regime kernel_bench cost_model kernels speculative
  # learner experts
  LIMIT=(30 240 120 300 300 120 240 240 240 240 120)
  # the lowerings only: the suite runs the whole of tests/test_verify_kernel.py itself
  KERNEL_TESTS="-k lower_to"
  KBENCH_ARGS="--batches 1 --ks 4 --vocab 256 --iters 2"
  SPEC_TESTS="-k strategy_validation"
else
  export JAX_PLATFORMS=cuda XLA_FLAGS=""
  if [ $PLAN = 0 ] && [ -d .whl ] && compgen -G ".whl/*.whl" > /dev/null; then
    "${PY:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
  fi
  DECODE_ARGS="--dtype bfloat16"  # (its default shape: the bench target's)
  DECODE_SPARE=7
  # ~1.1B params in 6 layers (hidden 4096, head_dim 32 kept, MLP 11008): weight-bandwidth-bound
  # like the 24-layer 1.13B shape, a quarter of its compile per executable (the RL steps
  # compile dozens), and wide like a 7B's matrices
  MODEL_ARGS="--hidden 4096 --heads 128 --kv_heads 64 --intermediate 11008 --layers 6"
  DTYPE=bfloat16
  REGIME_ARGS="--dtype bfloat16 --prompts 4 --arms 6_1_7 --skip_roofline --skip_tail
    --skip_costs --gate_rollouts 0"
  COST_ARGS="--dtype bfloat16 --batch_sizes 1 --arms 4_1_5 --iters 8 --rollouts 0 --learner 0"
  E2E_STEPS=2
  E2E_CACHE="$OUT/e2e/cache_"'$mode'  # each mode compiles cold (its own cache), as a run does
  E2E_EXTRA="--config.grpo.num_prompts=8 --config.grpo.n=4 --config.grpo.micro_batch=8
    --config.eval.num_prompts=32 --config.rollout.max_batch=32
    --config.rollout.buckets=1,2,4,8,16,32"
  # the packed attention alone first (7B heads, 4 rows of 4096: ~10 s with its compiles); one
  # length bucket of 512 (the bench target's positions), 16 rows a micro-batch; the LoRA
  # and xla variants each only if started within 40 s of the start (a second call's
  # --scale 2 leaves them 100 s)
  LEARNER_ARGS="--dtype bfloat16 --max_len 512 --tokens 8192 --samples 96 --steps 2"
  # Qwen3-30B-A3B's experts: a micro-batch of 2048 tokens (16k pairs; ragged_dot's padded
  # operand [128, 16k, 2048] in bf16: 8.6 GB), decode steps of 1, 8 and 64 tokens
  EXPERTS_ARGS="--dtype bfloat16 --tokens 2048 --decode 1,8,64 --iters 5"
  # env decode bench_model rl_steps bench_regime kernel_bench cost_model kernels speculative
  # learner experts
  # set from a fresh H200's cold run (2026-12-04: env 4 s, decode's cells ~10 s each after a
  # process's ~15 s, bench_model 39 s, the main job 95 s for 2 steps TLT on, bench_regime 64 s,
  # learner 56 s for the attention and the fused step, kernel_bench ~5 s a case, cost_model
  # ~45 s a batch size, kernels ~3 s a test, speculative > 20 s)
  # (env: +3 s for one failed allocation, device_memory.check_device)
  # (experts, not yet run on a GPU: its check's 4 compiles, the kernel's and ragged_dot's
  # steps, 3 decode cells: ~25 s; from decode's least valuable cells and kernel_bench's third)
  LIMIT=(8 67 50 150 75 15 45 20 25 60 25)  # 540 s: 9 minutes
  # (~3 s a test on a fresh H200: the lowerings and one chain parity per backend)
  KERNEL_TESTS="-k lower_to or (matches_reference and 1-7-None)"
  KBENCH_ARGS="--batches 64 --ks 4 --iters 20"  # (1 and 8: the reference wins, twice measured)
  SPEC_TESTS="-k (kernel_equals_reference and 2_1_3) or t1_3"
fi
for i in "${!LIMIT[@]}"; do LIMIT[i]=$(( LIMIT[i] * SCALE )); done
DECODE_ARGS="$DECODE_ARGS --budget_s $(( LIMIT[1] - DECODE_SPARE ))"
# the learner's LoRA and xla variants only if started 20 s before the stage's limit; the
# experts' cells 8 s before theirs
[ $SMOKE = 1 ] || LEARNER_ARGS="$LEARNER_ARGS --budget_s $(( LIMIT[9] - 20 ))"
[ $SMOKE = 1 ] || EXPERTS_ARGS="$EXPERTS_ARGS --budget_s $(( LIMIT[10] - 8 ))"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}

T0=$(date +%s)
: > "$BODY"

# stage NAME LIMIT_S FILTER CMD...: runs CMD under `timeout`, appends what FILTER keeps of its
# log (all: the whole log; md: the markdown it printed, its last 250 lines: on a GPU the decode
# stage's profiles alone are ~130; tail: the last 25 lines).
stage() {
  local name=$1 limit=$2 filter=$3
  shift 3
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",${name%%:*},"* ]]; then
    return 0
  fi
  if [ $PLAN = 1 ]; then
    printf '%s\t%s\t' "$name" "$limit"; printf '%q ' "$@"; echo
    return 0
  fi
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
            | cat -s | tail -n 250 ;;
      tail) echo '```'; tail -n 25 "$log"; echo '```' ;;
      *) echo '```'; cat "$log"; echo '```' ;;
    esac
    echo
    echo "exit $rc after $(( $(date +%s) - t )) s$([ $rc = 124 ] && echo ": cut off at ${limit} s")"
  } >> "$BODY"
  return 0
}

BENCH=$OUT/bench_model
if [ -n "$ONLY" ] && [ ! -f "$BENCH/model/config.json" ]; then  # the bench target, once
  for s in rl_steps bench_regime learner cost_model; do
    [[ ",$ONLY," == *",$s,"* ]] && ONLY="$ONLY,bench_model" && break
  done
fi
stage env "${LIMIT[0]}" all bash -c "nvidia-smi -L 2>/dev/null || echo 'no nvidia-smi';
  $PY -c 'import jax, flax, optax; print(\"jax\", jax.__version__, \"flax\", flax.__version__,
    \"optax\", optax.__version__); print(jax.devices())
from tlt_jax.device_memory import check_device; print(check_device())'"
# shellcheck disable=SC2086
stage decode "${LIMIT[1]}" md "$PY" scripts/gpu_decode.py --out "$OUT/decode" $DECODE_ARGS
# shellcheck disable=SC2086
stage bench_model "${LIMIT[2]}" tail "$PY" scripts/make_bench_model.py --out "$BENCH" \
  --source tlt_jax/assets/longtail --overwrite --no_regime $MODEL_ARGS
# The main job on one device: the long-tail workload (configs/longtail.py) on the widened
# target, TLT on then off: on gets half the stage, off what on left of it (both cold, each its
# own cache: ~21 programs over 0.3 s each on this CPU, 14 of them decode chunks); every step's
# phases (and seconds compiling) from its metrics.jsonl
HALF=$(( ${LIMIT[3]} * 4 / 7 ))  # TLT on first (the drafter's compiles too), off what is left
# TLT off's last step traced (not a first: its compiles make a trace slow to write; not TLT
# on's, whose time the trace would take from off's): where a plain step's device time goes
# (summary.json, the headline's busy / wall row), written after the step's metrics
E2E_PROFILE=""
[ "$E2E_STEPS" -ge 2 ] && E2E_PROFILE="--config.profile.steps=$E2E_STEPS"
E2E_EXTRA="--config.model.path=$BENCH/model --config.tlt.drafter.init=$BENCH/drafter
  --config.model.dtype=$DTYPE --config.model.param_dtype=$DTYPE --config.train.eval_every=0
  --config.train.export_policy=none --config.train.export_drafter=False
  --config.train.keep_checkpoints=1 $E2E_EXTRA"
E2E_EXTRA=$(echo $E2E_EXTRA)  # one line: it is pasted into the bash -c script below
TRAIN="$PY -m tlt_jax.train --config configs/longtail.py --config.train.steps=$E2E_STEPS
  $E2E_EXTRA"
TRAIN=$(echo $TRAIN)
# shellcheck disable=SC2086
[ $PLAN = 1 ] && stage rl_steps:train "$HALF" - $TRAIN  # (the command rl_steps runs per mode)
# shellcheck disable=SC2086
stage rl_steps "${LIMIT[3]}" all bash -c "t0=\$(date +%s); for mode in on off; do
    extra=''; limit=$HALF
    [ \$mode = off ] && extra='--config.tlt.enabled=False $E2E_PROFILE' \
      && limit=\$(( ${LIMIT[3]} - 12 - \$(date +%s) + t0 )) && [ \$limit -lt 5 ] && limit=5
    rm -rf '$OUT/e2e/'\$mode; mkdir -p '$OUT/e2e'
    timeout --kill-after=5 \$limit $TRAIN --workdir '$OUT/e2e/'\$mode \
      --config.compilation_cache=\"$E2E_CACHE\" \$extra 2>&1 \
      | tr '\r' '\n' | tee '$OUT/e2e/'\$mode.log \
      | grep -E '^(error|done|step 0|Traceback|rollout:|learner:)|Error' | tail -n 6
    echo \"TLT \$mode: exit \${PIPESTATUS[0]}\"
    rm -rf '$OUT/e2e/'\$mode/checkpoints  # never read; on the bench target ~10 GB each
  done; $PY scripts/gpu_headline.py --rl '$OUT'"
# shellcheck disable=SC2086
stage bench_regime "${LIMIT[4]}" md "$PY" scripts/bench_regime.py --bench "$BENCH" \
  --skip_regime --skip_hf --out "$OUT/bench_regime" $REGIME_ARGS
# shellcheck disable=SC2086
stage learner "${LIMIT[9]}" md "$PY" scripts/gpu_learner.py --target "$BENCH" \
  --out "$OUT/learner" $LEARNER_ARGS
# shellcheck disable=SC2086
stage experts "${LIMIT[10]}" md "$PY" scripts/gpu_experts.py --out "$OUT/experts" $EXPERTS_ARGS
# shellcheck disable=SC2086
stage kernel_bench "${LIMIT[5]}" md "$PY" scripts/bench_verify.py $KBENCH_ARGS
# shellcheck disable=SC2086
stage cost_model "${LIMIT[6]}" md "$PY" scripts/bench_cost_model.py --target "$BENCH" \
  --out "$OUT/cost_model" $COST_ARGS
stage kernels "${LIMIT[7]}" tail "$PY" -m pytest -p no:cacheprovider -q --tb=line \
  tests/test_verify_kernel.py ${KERNEL_TESTS:+"${KERNEL_TESTS%% *}" "${KERNEL_TESTS#* }"}
stage speculative "${LIMIT[8]}" tail "$PY" -m pytest -p no:cacheprovider -q --tb=line \
  tests/test_speculative.py ${SPEC_TESTS:+"${SPEC_TESTS%% *}" "${SPEC_TESTS#* }"}

[ $PLAN = 1 ] && exit 0
{
  echo "# GPU check ($(date -u +%Y-%m-%dT%H:%MZ), $([ $SMOKE = 1 ] && echo smoke on CPU || echo GPU))"
  echo
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); every stage time-boxed;"
  echo "each section ends with its exit status (124: cut off at the limit); total"
  echo "$(( $(date +%s) - T0 )) s."
  echo
  "$PY" scripts/gpu_headline.py "$OUT"
  cat "$BODY"
} > "$REPORT"
echo "[gpu_check] report: $REPORT" >&2
