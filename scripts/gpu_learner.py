"""The learner on the GPU: a packed RL step's log-prob pass and update on the bench target,
the fused attention against XLA's and with LoRA, measured and predicted (gpu_check's learner
stage).

    python scripts/gpu_learner.py [--target DIR] [--dtype bfloat16] [--budget_s 60] [--out DIR]

One RL step's learner phases as a run does them (grpo.minibatches: packed micro-batches of
one length bucket; learner.prepare: the old log-probs, none for the first mini-batch;
learner.update), on random tokens of long-tailed lengths, in three variants: model.attention
"fused" (the Pallas flash-attention kernel; interpreted off a GPU); the same training LoRA
adapters of --lora_rank on every linear layer over the frozen base in the compute dtype (how
one GPU trains a 7B); "xla" (the masked reference). Each is compiled by one untimed step,
then the median of --steps timed ones. Parity: the old log-probs of every response token,
fused vs xla, and LoRA's (B = 0: the base's policy) vs fused. The LoRA variant also times its
weight sync (the base with the adapters attached -> the rollout's layout, merged a layer at a
time in one program: run.py's `_to_rollout` on one GPU), and sets XLA's working memory for it
against the memory plan's item (memory_phases.SYNC_LAYERS: layers in float32). Prediction:
plan/learner.learner_phases on the same layout at the cluster profile's assumed efficiencies
(docs/scale.md) for this device (H100 / H200; none on a CPU), so predicted / measured says
how far the simulator's learner is from this one. A variant not started within --budget_s
is reported as skipped, one that raises as failing (the others still run). Prints a markdown
table, each row as its variant finishes, and writes DIR/learner.json after each.

Before the steps: the packed attention alone, forward + backward of one layer at
--attention's shape (rows, tokens, heads, kv heads, head_dim; default Qwen2.5-7B's heads in
rows of 4096): our segment-skipping kernel, JAX's Pallas `mha` it replaced and XLA's
reference (tlt_jax/bench/packed_attention.py), into DIR/attention.json. At 512-token rows the
attention is a small part of the step; there it is the whole measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tlt_jax.bench import packed_attention  # noqa: E402
from tlt_jax.bench.bench_model import load_target  # noqa: E402
from tlt_jax.memory_phases import SYNC_LAYERS  # noqa: E402
from tlt_jax.models import lora, packed_impl  # noqa: E402
from tlt_jax.optim import make_optimizer  # noqa: E402
from tlt_jax.plan import cost  # noqa: E402
from tlt_jax.plan.learner import (Learner, Micro, fused_attention_s, learner_phases,  # noqa: E402
                                  remat_mode)
from tlt_jax.rl import batching, grpo  # noqa: E402
from tlt_jax.rl import learner as rl_learner  # noqa: E402
from tlt_jax.rollout.config import EngineConfig  # noqa: E402
from tlt_jax.rollout.replica import replica_shardings, to_replica_program  # noqa: E402
from tlt_jax.sharding import make_mesh  # noqa: E402


def samples(n: int, max_len: int, seed: int, vocab: int) -> list[batching.Sample]:
  """n samples: 64-token prompts, lognormal responses (median max_len / 5) capped to fit."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    k = int(min(max_len - 64, max(1, rng.lognormal(np.log(max_len / 5), 0.7))))
    out.append(batching.Sample(rng.integers(2, vocab, 64).astype(np.int32),
                           rng.integers(2, vocab, k).astype(np.int32), float(rng.normal())))
  return out


def device_profile() -> cost.Hardware | None:
  kind = jax.devices()[0].device_kind.lower()
  for name in ("h200", "h100"):
    if name in kind:
      return cost.profile(name)
  return None


def label(r: dict) -> str:
  """A variant's name in the tables: its attention, and LoRA's rank where it has adapters."""
  return r["attention"] + (f", LoRA rank {r['lora_rank']}" if r.get("lora_rank") else "")


def run_variant(params, cfg, attention: str, args, batch, lora_rank: int = 0) -> dict:
  """One variant's measured phases (median of args.steps after one compile step) and its
  first mini-batch-but-one's old log-probs; with lora_rank, also its weight sync
  (`sync_conversion`)."""
  mcfg = dataclasses.replace(cfg, attention=attention)
  mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  lcfg = lora.LoraConfig(lora_rank) if lora_rank else None
  spec = rl_learner.LearnerSpec(mcfg, grpo.GRPOConfig(), make_optimizer(1e-6), mesh,
                          micro_batch=1, pad_multiple=args.max_len, max_len=args.max_len,
                          micro_batch_tokens=args.tokens, lora=lcfg)
  state = rl_learner.init_learner(params, spec)
  times, logp = [], None
  for step in range(args.steps + 1):
    batches = batching.minibatches(batch, spec, 2, seed=0)
    t = time.perf_counter()
    prepared = rl_learner.prepare(state, batches, spec)
    jax.block_until_ready(prepared)
    lp = time.perf_counter() - t
    if logp is None:
      logp = [np.asarray(b.old_logp, np.float32) for b in prepared[1]]
    t = time.perf_counter()
    state, _ = rl_learner.update(state, prepared, spec)
    jax.block_until_ready(state.params)
    if step:
      times.append((lp, time.perf_counter() - t))
  shapes = [[Micro.of(mb.segment_ids) for mb in group] for group in batches]
  masks = [mb.loss_mask for mb in batches[1]]
  out = {"attention": attention, "why": packed_impl(mcfg, args.max_len)[1],
         "logprobs_s": statistics.median(a for a, _ in times),
         "update_s": statistics.median(b for _, b in times), "shapes": shapes,
         "_logp": logp, "_masks": masks, "remat": remat_mode(mcfg)}
  if lcfg is not None:
    out.update(adapters=lora.num_adapter_params(cfg, lcfg),
               **sync_conversion(state, spec, args.steps))
  return out


def sync_conversion(state, spec, steps: int) -> dict:
  """The LoRA run's weight sync on one device (run.py's `_to_rollout`: the base with the
  adapters attached -> the rollout's layout in one program, merged a layer at a time): its
  compile and median time over `steps` (at least 1), and XLA's working memory for it in
  layers of the model in float32, against the plan's 1.25."""
  cfg = spec.cfg
  tree = rl_learner.rollout_policy(state, spec)
  fused = EngineConfig().fuses()  # the rollout's layout on this backend
  rmesh = make_mesh({"data": 1, "tensor": 1}, devices=jax.devices()[:1])
  t = time.perf_counter()
  convert = to_replica_program(cfg, fused, replica_shardings(tree, cfg, fused, rmesh))
  compiled = convert.lower(tree).compile()
  compile_s = time.perf_counter() - t
  layer = 4 * sum(x.size for x in jax.tree.leaves(state.base["layers"])) / cfg.num_layers
  times = []
  for _ in range(max(steps, 1)):
    t = time.perf_counter()
    jax.block_until_ready(compiled(tree))
    times.append(time.perf_counter() - t)
  return {"sync_s": statistics.median(times), "sync_compile_s": compile_s,
          "sync_temp_layers": compiled.memory_analysis().temp_size_in_bytes / layer,
          "sync_plan_layers": SYNC_LAYERS}


def max_diff(a: dict, b: dict) -> float:
  """The largest |difference| of two variants' old log-probs over the response tokens."""
  return max(float(np.max(np.abs(x - y) * m))
             for x, y, m in zip(a["_logp"], b["_logp"], a["_masks"]))


def table_row(r: dict, tokens: int) -> str:
  """One variant's row of the table `main` prints."""
  if "skipped" in r or "error" in r:
    why = f"skipped: {r['skipped']}" if "skipped" in r else f"fails: {r['error'][:200]}"
    return f"| {label(r)} | {why} ||||"
  pred = ("no GPU profile", "-")
  if "predicted_update_s" in r:
    pred = (f"{r['predicted_logprobs_s']:.3f} / {r['predicted_update_s']:.3f}",
            f"{r['predicted_update_s'] / r['update_s']:.2f}")
  return (f"| {label(r)} | {r['logprobs_s']:.3f} | {r['update_s']:.3f} | "
          f"{tokens / r['update_s']:.0f} | {pred[0]} | {pred[1]} |")


def write(out: str, rows: list[dict]) -> None:
  """OUT/learner.json: the rows so far (their private fields, the log-probs, left out)."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "learner.json"), "w") as f:
    json.dump([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows], f,
              indent=2)


def attention_bench(args) -> None:
  """The packed attention alone (module docstring): its table, and DIR/attention.json."""
  t0 = time.perf_counter()
  rows, t, heads, kv_heads, head_dim = (int(x) for x in args.attention.split(","))
  res = packed_attention.bench(rows, t, heads, kv_heads, head_dim, args.dtype, iters=args.steps + 1)
  print("\n" + packed_attention.table(res) + "\n", flush=True)
  hw = device_profile()
  ours = next((r for r in res["results"] if r["impl"] == "flash" and "ms" in r), None)
  if hw is not None and ours is not None:  # the simulator's price of it, and its attn_eff
    learner = Learner(gpus=1)
    res["pairs"] = Micro.of(packed_attention.bench_segments(rows, t)).pairs
    res["predicted_ms"] = 1e3 * fused_attention_s(heads, head_dim, res["pairs"], hw, learner)
    ratio = res["predicted_ms"] / ours["ms"]
    print(f"the simulator's price of ours on the {hw.name} profile: {res['predicted_ms']:.2f} ms "
          f"(predicted / measured {ratio:.2f}: its attn_eff {learner.attn_eff} would be "
          f"{learner.attn_eff * ratio:.2f})\n", flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "attention.json"), "w") as f:
    json.dump(res, f, indent=2)
  print(f"attention bench: done in {time.perf_counter() - t0:.0f}s", file=sys.stderr,
        flush=True)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--target", default=None, help="a bench target dir (default: the shipped)")
  ap.add_argument("--dtype", default="bfloat16", help="compute dtype (params stay float32)")
  ap.add_argument("--max_len", type=int, default=512, help="row length: one length bucket")
  ap.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch")
  ap.add_argument("--samples", type=int, default=96, help="responses per RL step")
  ap.add_argument("--steps", type=int, default=2, help="timed steps per variant")
  ap.add_argument("--budget_s", type=float, default=0.0, help="start no variant after this "
                  "many seconds (0: no limit)")
  ap.add_argument("--lora_rank", type=int, default=64, help="the LoRA variant's rank on every "
                  "linear layer (0: no LoRA variant)")
  ap.add_argument("--attention", default="4,4096,28,4,128", help="the attention bench's "
                  "rows,tokens,heads,kv_heads,head_dim ('' to skip it)")
  ap.add_argument("--out", default=os.path.join(ROOT, "out", "gpu_learner"))
  args = ap.parse_args(argv)
  t0 = time.perf_counter()
  cfg, params, *_ = load_target(args.target)
  cfg = dataclasses.replace(cfg, dtype=args.dtype, param_dtype="float32")
  params = jax.tree.map(lambda x: x.astype(np.float32), params)
  batch = samples(args.samples, args.max_len, 0, cfg.vocab_size)
  hw = device_profile()
  tokens = sum(s.length for s in batch)
  # the table's head now and each variant's row once it is done: a stage cut off at its limit
  # keeps the rows (and OUT/learner.json) of the variants that finished
  print("\n".join([
      f"Packed learner step on {jax.devices()[0].device_kind} ({cfg.num_layers} layers, "
      f"hidden {cfg.hidden_size}, {args.dtype}; {args.samples} responses, {tokens} tokens "
      f"in rows of {args.max_len}, 2 mini-batches):", "",
      "| attention | log-probs s | update s | update tokens/s | predicted log-probs / "
      "update s | predicted / measured (update) |", "|---|---:|---:|---:|---:|---:|"]),
        flush=True)
  if args.attention:
    attention_bench(args)
  rows = []
  variants = [("fused", 0)] + ([("fused", args.lora_rank)] if args.lora_rank else []) + \
      [("xla", 0)]
  for attention, rank in variants:
    if args.budget_s and time.perf_counter() - t0 > args.budget_s:
      r = {"attention": attention, "skipped": "out of --budget_s"}
    else:
      try:  # a variant that fails (a kernel that does not compile here) is a finding, and
        r = run_variant(params, cfg, attention, args, batch, rank)  # the others still run
      except Exception as e:  # noqa: BLE001
        r = {"attention": attention, "error": f"{type(e).__name__}: {str(e)[:500]}"}
      if hw is not None and "error" not in r:
        learner = Learner(gpus=1, remat=r["remat"], fused_attention=attention == "fused")
        pred = learner_phases(cfg, hw, learner, r["shapes"], reference=False,
                              adapters=r.get("adapters", 0))
        r["predicted_logprobs_s"], r["predicted_update_s"] = pred["logprobs"], pred["update"]
    if rank:
      r["lora_rank"] = rank
    rows.append(r)
    print(f"{label(r)}: done at {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    print(table_row(rows[-1], tokens), flush=True)
    write(args.out, rows)
  lines = [""]
  done = {label(r): r for r in rows if "skipped" not in r and "error" not in r}
  full, adapted = done.get("fused"), next((r for r in done.values() if r.get("lora_rank")),
                                          None)
  if full is not None and "xla" in done:
    diff = max_diff(full, done["xla"])
    lines += [f"old log-probs, fused vs xla: max |difference| over response tokens "
              f"{diff:.2e} ({args.dtype}); the update with fused attention at "
              f"{done['xla']['update_s'] / full['update_s']:.2f}x the speed of xla's"]
    for r in (full, done["xla"]):
      r["parity_max_abs"] = diff
  if adapted is not None:
    if full is not None:  # B = 0: the adapters' policy is the base's
      adapted["parity_max_abs"] = max_diff(full, adapted)
      lines += [f"old log-probs, LoRA (B = 0) vs fused: max |difference| "
                f"{adapted['parity_max_abs']:.2e}; the LoRA update at "
                f"{full['update_s'] / adapted['update_s']:.2f}x the speed of the full one's"]
    lines += [f"LoRA weight sync (merge + the rollout's layout, one program): "
              f"{adapted['sync_s']:.3f} s (compile {adapted['sync_compile_s']:.1f} s); XLA's "
              f"working memory {adapted['sync_temp_layers']:.2f} layers in float32 (the memory "
              f"plan's item: {SYNC_LAYERS})"]
  lines += [f"attention ({label(r)}): {r['why']}" for r in done.values()]
  print("\n".join(lines))
  write(args.out, rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
