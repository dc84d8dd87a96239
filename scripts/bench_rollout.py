"""Rollout throughput: tlt_jax's engine vs Hugging Face transformers `generate`, one run.

  python scripts/bench_rollout.py [--model DIR] [--batch_sizes 1,8,64] [--new_tokens 128]

Rows 1-2 (fixed length): every row decodes exactly --new_tokens tokens (no stop token), so
both engines do identical work; greedy and sampling (temperature 1) at each batch size.
Row 3 (long tail): the default task's real length distribution, --tail_batch prompts sampled
at temperature 1 with EOS, compaction on vs off (and HF as a peer).
Compile time is excluded (one warm-up run of each shape first) and reported separately.
Prints a markdown table of tokens/s and the ratios, measured in this one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np


def hf_generate(model, prompts, new_tokens, *, sample, eos, pad_id, seed=0):
  """Left-padded batched HF generate; returns useful tokens (up to and incl. EOS)."""
  import torch
  torch.manual_seed(seed)
  width = max(len(p) for p in prompts)
  ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
  mask = torch.zeros_like(ids)
  for i, p in enumerate(prompts):
    ids[i, width - len(p):] = torch.tensor(p)
    mask[i, width - len(p):] = 1
  kw = dict(max_new_tokens=new_tokens, do_sample=sample, pad_token_id=pad_id,
            eos_token_id=eos, attention_mask=mask)
  if sample:
    kw.update(temperature=1.0, top_k=0, top_p=1.0)
  else:
    kw.update(min_new_tokens=new_tokens if eos is None else 0)
  with torch.no_grad():
    out = model.generate(ids, **kw)[:, width:].numpy()
  tokens = 0
  for row in out:
    n = len(row)
    if eos is not None:
      hits = np.nonzero(np.isin(row, eos))[0]
      n = hits[0] + 1 if len(hits) else n
    tokens += n
  return tokens


def timed(fn, repeats=1):
  best = None
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    best = (out, dt) if best is None or dt < best[1] else best
  return best


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default=None, help="HF model dir (default: the embedded default)")
  ap.add_argument("--batch_sizes", default="1,8,64")
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--tail_batch", type=int, default=64)
  ap.add_argument("--tail_max_new", type=int, default=288)
  ap.add_argument("--chunk_size", type=int, default=16)
  ap.add_argument("--skip_hf", action="store_true")
  ap.add_argument("--drafter", default=None, help="drafter dir (default: the shipped one)")
  ap.add_argument("--spec_arm", default="4_1_5", help="chain strategy for the SD rows")
  ap.add_argument("--spec_threshold", type=int, default=16,
                  help="long-tail row: speculate once the live batch is <= this")
  ap.add_argument("--skip_spec", action="store_true")
  args = ap.parse_args()

  import jax
  import torch
  import transformers

  from tlt_jax.config import asset_path
  from tlt_jax.data.prompts import load_prompt_rows
  from tlt_jax.models.hf_io import load_hf_model, load_tokenizer, stop_token_ids
  from tlt_jax.rollout.engine import EngineConfig, Request, RolloutWorker
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

  from tlt_jax.drafter.model import load_drafter
  from tlt_jax.rollout.engine import SpecConfig
  dparams = None if args.skip_spec else load_drafter(
      args.drafter or asset_path("default", "drafter"), cfg)

  def engine(batch, new_tokens, stop_tokens, compaction=True, spec_threshold=0):
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < batch) + (batch,)
    # On CPU the verification runs as the jnp reference (Pallas interpret mode is a
    # debugging interpreter, not a fast path); on a GPU use_kernel=True lowers the kernel.
    spec = SpecConfig(strategy=args.spec_arm, bs_threshold=spec_threshold, patience=2,
                      use_kernel=jax.default_backend() == "gpu") if spec_threshold else None
    ecfg = EngineConfig(max_batch=batch, buckets=buckets, chunk_size=args.chunk_size,
                        compaction=compaction, max_prompt_len=max_prompt,
                        max_new_tokens=new_tokens, stop_tokens=stop_tokens, spec=spec)
    return RolloutWorker(params, cfg, ecfg, drafter_params=dparams if spec else None)

  def timed_engine(w, reqs, sp):
    run_engine(w, reqs, sp)  # warm-up: compiles every shape this run needs
    w.chunk_log.clear()
    ntok, dt = timed(lambda: run_engine(w, reqs, sp), repeats=2)
    sd = [c for c in w.chunk_log if c.mode != "plain"]
    toks, acc = sum(c.tokens for c in sd), sum(c.accepted for c in sd)
    return ntok / dt, (toks / max(toks - acc, 1) if sd else None)

  spec_rows = []

  def run_engine(worker, reqs, sp):
    res = worker.generate(reqs, sp, seed=0)
    return sum(r.num_tokens for r in res)

  table = []
  for b in [int(x) for x in args.batch_sizes.split(",")]:
    batch_prompts = [prompts[i % len(prompts)] for i in range(b)]
    reqs = [Request(p, request_id=i) for i, p in enumerate(batch_prompts)]
    for mode, sp in (("greedy", SamplingParams(temperature=0.0)),
                     ("sample", SamplingParams(temperature=1.0))):
      w = engine(b, args.new_tokens, ())
      run_engine(w, reqs, sp)  # warm-up: compiles every shape this run needs
      ntok, dt = timed(lambda: run_engine(w, reqs, sp), repeats=2)
      row = {"workload": f"batch {b}, {mode}, {args.new_tokens} tokens/row",
             "tlt": ntok / dt, "compile_s": w.compile_stats()["compile_seconds"]}
      if not args.skip_hf:
        hf_generate(hf, batch_prompts[:1], 4, sample=mode == "sample", eos=None, pad_id=pad_id)
        hf_tok, hf_dt = timed(lambda: hf_generate(hf, batch_prompts, args.new_tokens,
                                                  sample=mode == "sample", eos=None,
                                                  pad_id=pad_id), repeats=2)
        row["hf"] = hf_tok / hf_dt
      table.append(row)
      print(row, file=sys.stderr)
      if dparams is not None:
        # SD on from the start (threshold = batch) with the default task's real EOS.
        real = [Request(p, request_id=i) for i, p in enumerate(batch_prompts)]
        plain_tps, _ = timed_engine(engine(b, args.tail_max_new, stop), real, sp)
        sd_tps, acc_len = timed_engine(engine(b, args.tail_max_new, stop, spec_threshold=b),
                                       real, sp)
        spec_rows.append((f"batch {b}, {mode}, default task (EOS)", plain_tps, sd_tps, acc_len))
        print(spec_rows[-1], file=sys.stderr)

  # Long tail: the task's real length distribution, EOS on, sampling.
  tail_prompts = prompts[:args.tail_batch]
  reqs = [Request(p, request_id=i) for i, p in enumerate(tail_prompts)]
  sp = SamplingParams(temperature=1.0)
  tail = {}
  for compaction in (True, False):
    w = engine(args.tail_batch, args.tail_max_new, stop, compaction=compaction)
    run_engine(w, reqs, sp)
    ntok, dt = timed(lambda: run_engine(w, reqs, sp), repeats=2)
    tail[compaction] = (ntok, dt, w)
  lengths = [r.num_tokens for r in w.generate(reqs, sp, seed=0)]
  row = {"workload": f"long tail: {args.tail_batch} default-task prompts, sample, EOS "
                     f"(len p50 {np.percentile(lengths, 50):.0f}, max {max(lengths)})",
         "tlt": tail[True][0] / tail[True][1], "tlt_nocompact": tail[False][0] / tail[False][1],
         "compile_s": tail[True][2].compile_stats()["compile_seconds"]}
  if not args.skip_hf:
    hf_tok, hf_dt = timed(lambda: hf_generate(hf, tail_prompts, args.tail_max_new, sample=True,
                                              eos=list(stop), pad_id=pad_id), repeats=2)
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
  if dparams is not None:
    for mode, sp in (("greedy", SamplingParams(temperature=0.0)),
                     ("sample", SamplingParams(temperature=1.0))):
      plain_tps, _ = timed_engine(engine(args.tail_batch, args.tail_max_new, stop), reqs, sp)
      sd_tps, acc_len = timed_engine(engine(args.tail_batch, args.tail_max_new, stop,
                                            spec_threshold=args.spec_threshold), reqs, sp)
      spec_rows.append((f"long tail: batch {args.tail_batch}, {mode}, SD when live <= "
                        f"{args.spec_threshold}", plain_tps, sd_tps, acc_len))
      print(spec_rows[-1], file=sys.stderr)
    print(f"\n| workload (SD arm {args.spec_arm}) | plain tokens/s | SD tokens/s | SD / plain "
          "| tokens per verification |")
    print("|---|---:|---:|---:|---:|")
    for name, plain_tps, sd_tps, acc_len in spec_rows:
      acc_s = f"{acc_len:.2f}" if acc_len else "-"
      print(f"| {name} | {plain_tps:.0f} | {sd_tps:.0f} | {sd_tps / plain_tps:.2f}x | {acc_s} |")
  print(f"\nlong tail, compaction on vs off: {r['tlt']:.0f} vs {r['tlt_nocompact']:.0f} tokens/s "
        f"= {r['tlt'] / r['tlt_nocompact']:.2f}x")


if __name__ == "__main__":
  main()
