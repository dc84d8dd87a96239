"""Rollout throughput: tlt_jax's engine vs Hugging Face transformers `generate`, one run.

  python scripts/bench_rollout.py [--model DIR] [--batch_sizes 1,8,64] [--new_tokens 128]
      [--spec_arms 4_1_5,4_4_16] [--skip_hf] [--skip_spec] [--repeats 3]

Table 0 (roofline, printed first; --only_roofline stops there): the plain decode step at each
batch size, bytes moved (weights + the KV window read) / step time against the copy bandwidth
measured in the same run (tlt_jax/bench/roofline.py).

Table 1 (plain decoding vs HF generate). Fixed length: every row decodes exactly --new_tokens
tokens (no stop token), so both engines do identical work; greedy and sampling (temperature 1)
at each batch size. Long tail: the default task's real length distribution, --tail_batch
prompts sampled at temperature 1 with EOS, compaction on vs off (and HF as a peer).

Table 2 (speculative decoding vs plain, same engine; the shipped drafter). For each batch size
and mode: the fixed-length workload, and the default task with EOS (--task_requests prompts
streamed through a batch of that size: rows are refilled as they finish); SD is on from the
first chunk. Long tail: SD switches on once the live batch is <= --spec_threshold. One column
pair per --spec_arms strategy (chains "<steps>_1_<steps+1>", EAGLE-2 trees "<steps>_<topk>_<n>"),
with tokens per verification (accepted drafts + 1).

Table 3 (--skip_hf off): HF assisted generation as the speculative peer, batch 1 (all HF
supports): `generate(..., assistant_model=A)`. HF's assistant must be a standalone causal LM
and our drafter is EAGLE-style (it reads the target's hidden states), so A is the target cut to
its first layer (its embedding, final norm and LM head, layer 0; written with save_hf_model):
the strongest assistant derivable from the target without training. Workloads run one prompt
at a time for HF; ours runs as in table 2.

Bounds: per-forward costs measured in compiled loops (tlt_jax/bench/spec_costs.py) at batch 1 and 8
give r = drafter step / plain step and the speedup bounds for each arm at its measured tokens
per verification.

Compile time is excluded (one warm-up run of each shape first) and reported separately. Every
timing is the best of --repeats runs (the machine may be shared: best-of filters other load).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from tlt_jax.bench.roofline import roofline_section
from tlt_jax.bench.rollout import first_layer_assistant, hf_assisted, hf_generate, timed
from tlt_jax.bench.spec_costs import bounds, measure_costs
from tlt_jax.rollout.scheduler import buckets_upto


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default=None, help="HF model dir (default: the embedded default)")
  ap.add_argument("--batch_sizes", default="1,8,64")
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--tail_batch", type=int, default=64)
  ap.add_argument("--tail_max_new", type=int, default=288)
  ap.add_argument("--task_requests", type=int, default=32,
                  help="default-task SD rows: prompts streamed through each batch size")
  ap.add_argument("--chunk_size", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--skip_hf", action="store_true")
  ap.add_argument("--drafter", default=None, help="drafter dir (default: the shipped one)")
  ap.add_argument("--spec_arms", default="4_1_5,6_4_24",
                  help="strategies for the SD rows (chains and/or trees)")
  ap.add_argument("--spec_threshold", type=int, default=16,
                  help="long-tail row: speculate once the live batch is <= this")
  ap.add_argument("--skip_spec", action="store_true")
  ap.add_argument("--skip_plain", action="store_true", help="skip table 1")
  ap.add_argument("--only_roofline", action="store_true",
                  help="only the roofline table (printed first in every run)")
  ap.add_argument("--hf_prompts", type=int, default=16,
                  help="table 3: HF decodes at most this many of a workload's prompts (one at a "
                       "time, slowly); tokens/s is a rate, so a subset measures the same thing")
  args = ap.parse_args()

  import jax
  import torch
  import transformers

  from tlt_jax.config import asset_path
  from tlt_jax.data.prompts import load_prompt_rows
  from tlt_jax.models.hf_io import load_hf_model
  from tlt_jax.models.tokenizer import load_tokenizer, stop_token_ids
  from tlt_jax.rollout.config import EngineConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import Request, tokens_per_verification
  from tlt_jax.rollout.sampling import SamplingParams

  model_dir = args.model or asset_path("default", "model")
  torch.set_num_threads(os.cpu_count() or 1)
  cfg, params = load_hf_model(model_dir)
  tok = load_tokenizer(model_dir)
  stop = stop_token_ids(model_dir, tok)
  hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
  rows, _ = load_prompt_rows(asset_path("default", "data", "test.jsonl"))
  prompts = [tok.encode(r.prompt) for r in rows]
  max_prompt = -(-max(len(p) for p in prompts) // 16) * 16
  print(f"model {model_dir}: {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M params; "
        f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} "
        f"with {torch.get_num_threads()} threads", file=sys.stderr)

  # How close plain decoding runs to the memory limit, per --batch_sizes (greedy, the task's
  # longest prompt; tlt_jax/bench/roofline.py)
  batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
  roofline_section(params, cfg, [(f"batch {b}, greedy", b, SamplingParams(temperature=0.0),
                                  max(len(p) for p in prompts)) for b in batch_sizes],
                   cache_len=max_prompt + args.new_tokens)
  if args.only_roofline:
    return

  from tlt_jax.drafter.model import load_drafter
  from tlt_jax.rollout.config import SpecConfig
  dparams = None if args.skip_spec else load_drafter(
      args.drafter or asset_path("default", "drafter"), cfg)
  arms = args.spec_arms.split(",")
  modes = (("greedy", SamplingParams(temperature=0.0)), ("sample", SamplingParams(temperature=1.0)))

  def engine(batch, new_tokens, stop_tokens, compaction=True, arm=None, spec_threshold=0):
    # On CPU the verification runs as the jnp reference (Pallas interpret mode is a
    # debugging interpreter, not a fast path); on a GPU use_kernel=True lowers the kernel.
    spec = SpecConfig(strategy=arm, bs_threshold=spec_threshold, patience=1,
                      use_kernel=jax.default_backend() == "gpu") if arm else None
    ecfg = EngineConfig(max_batch=batch, buckets=buckets_upto(batch),
                        chunk_size=args.chunk_size, compaction=compaction,
                        max_prompt_len=max_prompt, max_new_tokens=new_tokens,
                        stop_tokens=stop_tokens, spec=spec)
    return Engine(params, cfg, ecfg, drafter_params=dparams if spec else None)

  def run_engine(worker, reqs, sp):
    res = worker.generate(reqs, sp, seed=0)
    return sum(r.num_tokens for r in res)

  def timed_engine(w, reqs, sp):
    """(tokens/s best of --repeats, tokens per verification | None, decode-only tokens/s).
    Decode-only: tokens / wall time of the decode chunks (no prefill, refill or compaction),
    over all repeats."""
    run_engine(w, reqs, sp)  # warm-up: compiles every shape this run needs
    w.chunk_log.clear()
    ntok, dt = timed(lambda: run_engine(w, reqs, sp), repeats=args.repeats)
    sd = [c for c in w.chunk_log if c.mode != "plain"]
    decode = sum(c.tokens for c in w.chunk_log) / sum(c.wall_time for c in w.chunk_log)
    return ntok / dt, tokens_per_verification(sd), decode

  def sd_row(name, batch, new_tokens, stop_tokens, reqs, sp, threshold):
    """Plain vs every arm on one workload ->
    (name, (plain tok/s, plain decode-only tok/s), {arm: (tok/s, accept, decode-only tok/s)})."""
    plain, _, plain_dec = timed_engine(engine(batch, new_tokens, stop_tokens), reqs, sp)
    res = {}
    for arm in arms:
      res[arm] = timed_engine(engine(batch, new_tokens, stop_tokens, arm=arm,
                                     spec_threshold=threshold), reqs, sp)
    row = (name, (plain, plain_dec), res)
    print(row, file=sys.stderr)
    return row

  table, spec_rows = [], []
  for b in batch_sizes:
    batch_prompts = [prompts[i % len(prompts)] for i in range(b)]
    reqs = [Request(p, request_id=i) for i, p in enumerate(batch_prompts)]
    for mode, sp in modes:
      if not args.skip_plain:
        w = engine(b, args.new_tokens, ())
        run_engine(w, reqs, sp)  # warm-up: compiles every shape this run needs
        ntok, dt = timed(lambda: run_engine(w, reqs, sp), repeats=args.repeats)
        row = {"workload": f"batch {b}, {mode}, {args.new_tokens} tokens/row",
               "tlt": ntok / dt, "compile_s": w.compile_stats()["compile_seconds"]}
        if not args.skip_hf:
          hf_generate(hf, batch_prompts[:1], 4, sample=mode == "sample", eos=None,
                      pad_id=pad_id)
          hf_tok, hf_dt = timed(lambda: hf_generate(hf, batch_prompts, args.new_tokens,
                                                    sample=mode == "sample", eos=None,
                                                    pad_id=pad_id), repeats=args.repeats)
          row["hf"] = hf_tok / hf_dt
        table.append(row)
        print(row, file=sys.stderr)
      if dparams is not None:
        spec_rows.append(sd_row(f"batch {b}, {mode}, {args.new_tokens} tokens/row (no EOS)", b,
                                args.new_tokens, (), reqs, sp, b))
        task = [Request(prompts[i % len(prompts)], request_id=i)
                for i in range(max(args.task_requests, b))]
        spec_rows.append(sd_row(f"batch {b}, {mode}, default task (EOS), {len(task)} prompts",
                                b, args.tail_max_new, stop, task, sp, b))

  # Long tail: the task's real length distribution, EOS on, sampling.
  tail_prompts = prompts[:args.tail_batch]
  tail_reqs = [Request(p, request_id=i) for i, p in enumerate(tail_prompts)]
  if not args.skip_plain:
    sp = SamplingParams(temperature=1.0)
    tail = {}
    for compaction in (True, False):
      w = engine(args.tail_batch, args.tail_max_new, stop, compaction=compaction)
      run_engine(w, tail_reqs, sp)
      ntok, dt = timed(lambda: run_engine(w, tail_reqs, sp), repeats=args.repeats)
      tail[compaction] = (ntok, dt, w)
    lengths = [r.num_tokens for r in w.generate(tail_reqs, sp, seed=0)]
    row = {"workload": f"long tail: {args.tail_batch} default-task prompts, sample, EOS "
                       f"(len p50 {np.percentile(lengths, 50):.0f}, max {max(lengths)})",
           "tlt": tail[True][0] / tail[True][1],
           "tlt_nocompact": tail[False][0] / tail[False][1],
           "compile_s": tail[True][2].compile_stats()["compile_seconds"]}
    if not args.skip_hf:
      hf_tok, hf_dt = timed(lambda: hf_generate(hf, tail_prompts, args.tail_max_new,
                                                sample=True, eos=list(stop), pad_id=pad_id),
                            repeats=args.repeats)
      row["hf"] = hf_tok / hf_dt
    table.append(row)
    print(row, file=sys.stderr)

    print("\n| workload | tlt_jax tokens/s | HF generate tokens/s | tlt_jax / HF |")
    print("|---|---:|---:|---:|")
    for r in table:
      hf_s = f"{r['hf']:.0f}" if "hf" in r else "-"
      ratio = f"{r['tlt'] / r['hf']:.2f}x" if "hf" in r else "-"
      print(f"| {r['workload']} | {r['tlt']:.0f} | {hf_s} | {ratio} |")
    r = table[-1]
    print(f"\nlong tail, compaction on vs off: {r['tlt']:.0f} vs {r['tlt_nocompact']:.0f} "
          f"tokens/s = {r['tlt'] / r['tlt_nocompact']:.2f}x")
  if dparams is None:
    return

  for mode, sp in modes:
    spec_rows.append(sd_row(f"long tail: batch {args.tail_batch}, {mode}, SD when live <= "
                            f"{args.spec_threshold}", args.tail_batch, args.tail_max_new, stop,
                            tail_reqs, sp, args.spec_threshold))
  print("\nSD / plain: end to end (prefill, refill and host work included) and decode-only "
        "(decode chunks' wall time only); tokens per verification = accepted drafts + 1.")
  head = " | ".join(f"{a} tokens/s | {a} / plain | {a} decode-only / plain | "
                    f"{a} tokens per verification" for a in arms)
  print(f"\n| workload | plain tokens/s | {head} |")
  print("|---|---:|" + "---:|---:|---:|---:|" * len(arms))
  for name, (plain, plain_dec), res in spec_rows:
    cells = " | ".join(f"{res[a][0]:.0f} | {res[a][0] / plain:.2f}x | "
                       f"{res[a][2] / plain_dec:.2f}x | "
                       + (f"{res[a][1]:.2f}" if res[a][1] else "-") for a in arms)
    print(f"| {name} | {plain:.0f} | {cells} |")

  # Bounds: per-forward costs (in compiled loops) and the measured acceptance.
  print("\nSpeedup bounds from per-forward costs (scripts/profile_spec.py; plain step = 1), at "
        "the tokens per verification measured above (default task, same batch and mode):")
  print("\n| batch, mode | arm | plain step us | r = drafter/plain | forwards cost | step cost "
        "| tokens/verif | lead's bound | forwards bound | step bound | every draft accepted |")
  print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for b in (1, 8):
    for mode, sp in modes:
      costs = measure_costs(params, dparams, cfg, b, arms, sp, iters=100,
                            cache_len=max_prompt + args.tail_max_new)
      measured = {n: res for n, _, res in spec_rows}
      res = measured.get(f"batch {b}, {mode}, default task (EOS), "
                         f"{max(args.task_requests, b)} prompts")
      for arm in arms:
        acc = res[arm][1] if res and res[arm][1] else None
        if acc is None:
          continue
        bd = bounds(costs, arm, acc)
        print(f"| {b}, {mode} | {arm} | {costs['plain step'] * 1e6:.0f} | {bd['r']:.3f} | "
              f"{bd['ideal_cost']:.2f} | {bd['step_cost']:.2f} | {acc:.2f} | {bd['lead']:.2f}x | "
              f"{bd['ideal']:.2f}x | {bd['measured']:.2f}x | {bd['perfect']:.2f}x |")

  if args.skip_hf:
    return
  # HF assisted generation (batch 1) vs ours.
  import tempfile
  with tempfile.TemporaryDirectory() as tmp:
    assistant = first_layer_assistant(params, cfg, model_dir, tmp)
    print("\nHF assisted generation peer: assistant = the target's first layer (+ its embedding,"
          " final norm, LM head), HF defaults for the draft length schedule; batch 1, one "
          f"prompt at a time, at most {args.hf_prompts} prompts per workload. Ours: the runs of "
          "the SD table (long tail: our batched engine, SD once the live batch is small).")
    print("\n| workload | ours plain | ours best SD (arm) | HF generate | HF assisted "
          "(tokens/target fwd) | ours SD / HF assisted |")
    print("|---|---:|---:|---:|---:|---:|")
    task1 = [prompts[i % len(prompts)] for i in range(args.task_requests)]
    work = [(f"batch 1, {m}, {args.new_tokens} tokens/row (no EOS)", prompts[:1], args.new_tokens,
             None, m) for m, _ in modes]
    work += [(f"batch 1, {m}, default task (EOS), {len(task1)} prompts", task1,
              args.tail_max_new, list(stop), m) for m, _ in modes]
    work += [(f"long tail: batch {args.tail_batch}, {m}, SD when live <= {args.spec_threshold}",
              tail_prompts, args.tail_max_new, list(stop), m) for m, _ in modes]
    ours = {n: (plain, res) for n, (plain, _), res in spec_rows}
    for name, ps, new, eos, m in work:
      if name not in ours:  # --batch_sizes without 1
        continue
      sample = m == "sample"
      ps = ps[:args.hf_prompts]
      hf_assisted(hf, assistant, ps[:1], 4, sample=sample, eos=eos, pad_id=pad_id)  # warm-up
      (hf_tok, hf_acc), hf_dt = timed(lambda: hf_assisted(hf, assistant, ps, new, sample=sample,
                                                          eos=eos, pad_id=pad_id), repeats=2)
      plain_hf_tok, plain_hf_dt = timed(lambda: sum(
          hf_generate(hf, [p], new, sample=sample, eos=eos, pad_id=pad_id) for p in ps),
          repeats=2)
      plain, res = ours[name]
      best = max(arms, key=lambda a: res[a][0])
      print(f"| {name} | {plain:.0f} | {res[best][0]:.0f} ({best}) | "
            f"{plain_hf_tok / plain_hf_dt:.0f} | {hf_tok / hf_dt:.0f} ({hf_acc:.2f}) | "
            f"{res[best][0] / (hf_tok / hf_dt):.2f}x |")


if __name__ == "__main__":
  main()
