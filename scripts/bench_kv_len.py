#!/usr/bin/env python
"""Per-token decode time against the allocated response length (issue #25, item 1).

    python scripts/make_bench_model.py --out /tmp/bench
    python scripts/bench_kv_len.py --bench /tmp/bench --trees /work/main,.

Short responses (the default task's, ending by EOS after 20-40 tokens) should cost the same
per token whether the cache holds 256 or 4096 new tokens: attention reads the live tokens
(`kv_len`, tlt_jax/models/kv_cache.py), not the whole cache. For each checkout in --trees
(a tlt_jax source tree: compare a branch with main in one run, since a CPU's speed drifts
between runs), a child process decodes the same requests at each --lengths, greedy, plain and
with chain speculation, warm (a first pass compiles), and reports seconds per generated
token; the table gives each length's time relative to the shortest. Rounds interleave the
trees; the medians over rounds are printed. Outputs must be identical across lengths and trees.

Workloads: "batch" = --prompts default-task prompts at batch --batch (the issue's), and with
--tail the long tail of bench_regime.py (--tail_prompts x --tail_n sampled responses at batch
their count, speculation at live <= --threshold).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(args) -> dict:
  """Runs in a subprocess whose sys.path starts at the tree under test."""
  from tlt_jax.config import asset_path
  from tlt_jax.data.prompts import load_prompt_rows
  from tlt_jax.drafter.model import load_drafter
  from tlt_jax.models.hf_io import load_hf_model
  from tlt_jax.models.tokenizer import load_tokenizer, stop_token_ids
  from tlt_jax.rollout.config import EngineConfig, SpecConfig
  from tlt_jax.rollout.sampling import SamplingParams
  import tlt_jax
  # The child runs in whichever checkout --trees names, older ones included (their engine is
  # `RolloutWorker` with the records beside it, and they have no `buckets_upto`).
  try:
    from tlt_jax.rollout.engine import Engine
    from tlt_jax.rollout.records import Request
    from tlt_jax.rollout.scheduler import buckets_upto
  except ImportError:
    from tlt_jax.rollout.engine import Request
    from tlt_jax.rollout.engine import RolloutWorker as Engine
    buckets_upto = lambda n: tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < n) + (n,)

  model_dir, drafter_dir = (os.path.join(args.bench, x) for x in ("model", "drafter"))
  cfg, params = load_hf_model(model_dir)
  dparams = load_drafter(drafter_dir, cfg)
  tok = load_tokenizer(model_dir)
  stop = tuple(stop_token_ids(model_dir, tok))
  rows, _ = load_prompt_rows(asset_path("default", "data", "test.jsonl"))
  prompts = [tok.encode(r.prompt) for r in rows]
  max_prompt = -(-max(len(p) for p in prompts) // 16) * 16
  workloads = {"batch": ([Request(prompts[i], request_id=i) for i in range(args.prompts)],
                         args.batch, SamplingParams(temperature=0.0), args.batch)}
  if args.tail:
    n = args.tail_prompts * args.tail_n
    workloads["tail"] = ([Request(prompts[i], request_id=i, sample_index=j)
                          for i in range(args.tail_prompts) for j in range(args.tail_n)],
                         n, SamplingParams(temperature=1.0), args.threshold)
  out = {"tree": os.path.dirname(os.path.dirname(os.path.abspath(tlt_jax.__file__))),
         "times": {}, "outputs": {}}
  for wname, (reqs, batch, sp, threshold) in workloads.items():
    lengths = args.tail_lengths if wname == "tail" else args.lengths
    for mode in args.modes:
      workers = {}
      for length in lengths:
        spec = None if mode == "plain" else SpecConfig(
            strategy=args.arm, bs_threshold=threshold, patience=1, use_kernel=False)
        kw = {}
        if "kv_pages" in EngineConfig.__dataclass_fields__:  # the paged cache's pool: rows of
          # up to --kv_row_slots each at every length (one longest row at least), not
          # max_batch rows of max length (which at 4096 outgrow this machine's memory)
          row_pages = -(-(max_prompt + length) // 16)
          kw = dict(kv_pages=max(row_pages, batch * -(-args.kv_row_slots // 16)))
        ecfg = EngineConfig(max_batch=batch, buckets=buckets_upto(batch), chunk_size=args.chunk,
                            max_prompt_len=max_prompt, max_new_tokens=length,
                            stop_tokens=stop, spec=spec, **kw)
        workers[length] = Engine(params, cfg, ecfg, drafter_params=dparams if spec else None)
        workers[length].generate(reqs, sp, seed=0)  # compiles
      for length in lengths:  # timed, after every length compiled
        w = workers[length]
        t = time.perf_counter()
        res = w.generate(reqs, sp, seed=0)
        dt = time.perf_counter() - t
        ntok = sum(r.num_tokens for r in res)
        key = f"{wname}/{mode}/{length}"
        out["times"][key] = dt / ntok
        out["outputs"][key] = sorted((r.request_id, r.sample_index, r.response_ids.tolist())
                                     for r in res)
        del workers[length]  # frees its caches before the next length's run
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--bench", required=True, help="scripts/make_bench_model.py's --out")
  ap.add_argument("--trees", default=os.path.dirname(HERE),
                  help="comma-separated tlt_jax checkouts to compare (default: this one)")
  ap.add_argument("--rounds", type=int, default=2, help="interleaved runs per tree")
  ap.add_argument("--lengths", default="256,4096", help="--max_new_tokens values (batch)")
  ap.add_argument("--modes", default="plain,chain", help="plain and/or chain")
  ap.add_argument("--arm", default="4_1_5", help="the chain's strategy")
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--chunk", type=int, default=16)
  ap.add_argument("--tail", action="store_true", help="also bench_regime's long tail")
  ap.add_argument("--tail_lengths", default="256,1024")
  ap.add_argument("--tail_prompts", type=int, default=16)
  ap.add_argument("--tail_n", type=int, default=4)
  ap.add_argument("--threshold", type=int, default=8)
  ap.add_argument("--kv_row_slots", type=int, default=1024,
                  help="KV pool of a paged engine: this many slots per row of the batch")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  args.lengths = [int(x) for x in args.lengths.split(",")]
  args.tail_lengths = [int(x) for x in args.tail_lengths.split(",")]
  args.modes = [m if m == "plain" else "chain" for m in args.modes.split(",")]
  if args.child:
    print(json.dumps(child(args)))
    return 0
  if not os.path.isfile(os.path.join(args.bench, "model", "config.json")):
    print(f"error: --bench {args.bench}: no model/config.json; build it with "
          f"python scripts/make_bench_model.py --out {args.bench}", file=sys.stderr)
    return 2
  trees = [os.path.abspath(t) for t in args.trees.split(",")]
  fwd = [a for a in (argv if argv is not None else sys.argv[1:])]
  runs: dict[str, list[dict]] = {t: [] for t in trees}
  for r in range(args.rounds):
    for tree in trees:
      env = dict(os.environ, PYTHONPATH=tree)
      proc = subprocess.run([sys.executable, os.path.abspath(__file__), *fwd, "--child"],
                            env=env, cwd=tree, capture_output=True, text=True)
      if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
      res = json.loads(proc.stdout.strip().splitlines()[-1])
      if res["tree"] != tree:
        print(f"error: the child imported tlt_jax from {res['tree']}, not {tree}",
              file=sys.stderr)
        return 1
      runs[tree].append(res)
      print(f"round {r}, {tree}: " + ", ".join(f"{k} {v * 1e3:.1f} ms"
                                               for k, v in res["times"].items()), flush=True)
  ref = runs[trees[0]][0]["outputs"]
  print("\n| tree | workload | mode | max_new_tokens | ms/token (median) | vs shortest | "
        "outputs = shortest's, = first tree's |\n|---|---|---|---:|---:|---:|---|")
  for tree in trees:
    keys = list(runs[tree][0]["times"])
    med = {k: statistics.median(run["times"][k] for run in runs[tree]) for k in keys}
    outs = runs[tree][0]["outputs"]
    for k in keys:
      wname, mode, length = k.split("/")
      first = next(k2 for k2 in keys if k2.startswith(f"{wname}/{mode}/"))
      print(f"| {os.path.basename(tree) or tree} | {wname} | {mode} | {length} | "
            f"{med[k] * 1e3:.2f} | {med[k] / med[first]:.2f}x | "
            f"{outs[k] == outs[first]}, {outs[k] == ref.get(k)} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
