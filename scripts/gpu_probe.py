#!/usr/bin/env python
"""GPU checklist items that need a model on the device (../shared/GPU.md 3-5), in one process.

    python scripts/gpu_probe.py --bench DIR [--dtype bfloat16] [--prompts 8] [--out OUT]

DIR is scripts/make_bench_model.py's --out (a widened target with the shipped model's function,
so acceptance is the real one). Prints markdown sections and writes OUT/gpu_probe.json:

  bandwidth   the device's copy bandwidth, measured here (tlt_jax/bench/roofline.py: an
              in-place `x + 1` over 1 GiB, bytes read + written / median time of 20).
  roofline    plain decode at batch 1 and 8 (the in-loop step of a compiled loop, with the
              attention window the engine picks): bytes a step moves (replica weights + the KV
              window it reads) / step time, against that bandwidth.
  bf16        greedy SD (Pallas verification kernel on) == greedy plain decoding in the
              compute dtype, batch 8, default-task prompts: identical responses, and where
              they differ the first differing position (bf16 ties/near-ties flip argmaxes).
  memory      each compiled executable's memory_analysis() (argument + output + temp) and the
              device's peak bytes in use, against weights + KV cache computed from shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

from tlt_jax.bench.roofline import (TABLE_HEAD, copy_bandwidth, decode_roofline,
                                    kv_bytes_per_token, table_row)
from tlt_jax.rollout.scheduler import buckets_upto

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--bench", required=True)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--max_new_tokens", type=int, default=256)
  ap.add_argument("--iters", type=int, default=50)
  ap.add_argument("--out", default=os.path.join(ROOT, "out", "gpu_probe"))
  args = ap.parse_args(argv)

  from tlt_jax.bench.bench_model import load_target
  from tlt_jax.rollout.config import EngineConfig, SpecConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import Request, tokens_per_verification
  from tlt_jax.rollout.sampling import SamplingParams

  out: dict = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
               "jax": jax.__version__, "dtype": args.dtype}
  print(f"## gpu_probe: {out['device']} ({out['backend']}), jax {jax.__version__}, "
        f"{args.dtype}\n", flush=True)

  bw = copy_bandwidth()
  out["copy_bandwidth"] = bw
  print(f"### bandwidth\n\ncopy bandwidth (in-place x + 1 over 1 GiB, read + write): "
        f"**{bw / 1e9:.0f} GB/s**\n", flush=True)

  cfg, params, dparams, _, stop, prompts = load_target(args.bench, args.dtype)
  prompts = prompts[:args.prompts]
  max_prompt = -(-max(len(p) for p in prompts) // 16) * 16
  greedy = SamplingParams(temperature=0.0)
  wbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  nparams = sum(x.size for x in jax.tree.leaves(params))
  kv_per_token = kv_bytes_per_token(cfg, cfg.compute_dtype)
  out["params"] = int(nparams)
  print(f"target: {nparams / 1e9:.2f}B params, {wbytes / 2**30:.2f} GiB weights, "
        f"KV {kv_per_token / 1024:.0f} KiB/token\n", flush=True)

  # ---- roofline: plain decode step in a compiled loop
  cache_len = max_prompt + args.max_new_tokens
  print(f"### roofline: plain decode at batch 1 and 8 (in-loop step time)\n\n{TABLE_HEAD}",
        flush=True)
  out["roofline"] = {}
  for b in (1, 8):
    r = decode_roofline(params, cfg, b, greedy, bw, prompt_len=64, cache_len=cache_len,
                        iters=args.iters)
    out["roofline"][b] = r
    print(table_row("plain decode", r), flush=True)

  # ---- bf16 greedy SD == plain, batch 8, kernel on
  def worker(spec):
    ecfg = EngineConfig(max_batch=8, buckets=buckets_upto(8), chunk_size=16,
                        max_prompt_len=max_prompt, prompt_bucket=16,
                        max_new_tokens=args.max_new_tokens, stop_tokens=stop, spec=spec)
    return Engine(params, cfg, ecfg, drafter_params=dparams if spec else None)

  reqs = [Request(p, request_id=i) for i, p in enumerate(prompts)]
  res = {}
  for label, spec in (("plain", None),
                      ("SD 4_1_5", SpecConfig(strategy="4_1_5", bs_threshold=8, patience=1,
                                              use_kernel=True)),
                      ("SD 4_2_8", SpecConfig(strategy="4_2_8", bs_threshold=8, patience=1,
                                              use_kernel=True))):
    w = worker(spec)
    w.generate(reqs, greedy, seed=0)  # compiles
    w.chunk_log.clear()
    t = time.perf_counter()
    got = {r.request_id: list(r.response_ids) for r in w.generate(reqs, greedy, seed=0)}
    dt = time.perf_counter() - t
    sp = [c for c in w.chunk_log if c.mode not in ("plain", "off")]
    res[label] = (got, dt, tokens_per_verification(sp) if sp else None, w)
  base = res["plain"][0]
  print(f"\n### {args.dtype}: greedy SD (Pallas kernel) vs greedy plain, batch 8, "
        f"{len(prompts)} default-task prompts\n\n| engine | identical responses | first "
        "divergence (token index) | tokens | seconds | tokens per verification | verify |\n"
        "|---|---:|---|---:|---:|---:|---|", flush=True)
  out["bf16_equality"] = {}
  for label, (got, dt, tpv, w) in res.items():
    same = sum(got[i] == base[i] for i in base)
    div = []
    for i in base:
      a, c = base[i], got[i]
      if a != c:
        div.append(next((k for k in range(min(len(a), len(c))) if a[k] != c[k]),
                        min(len(a), len(c))))
    ntok = sum(len(v) for v in got.values())
    out["bf16_equality"][label] = {"identical": same, "of": len(base), "divergence_at": div,
                                   "tokens": ntok, "seconds": dt, "tpv": tpv}
    print(f"| {label} | {same}/{len(base)} | {div or '-'} | {ntok} | {dt:.2f} | "
          f"{tpv if tpv is None else round(tpv, 2)} | {w.compiles.verify_path} |",
          flush=True)

  # ---- memory: compiled executables vs shapes
  kv_cache = 8 * cache_len * kv_per_token
  print(f"\n### memory (batch 8, cache {cache_len} slots)\n\nweights {wbytes / 2**20:.0f} MiB "
        f"+ KV cache {kv_cache / 2**20:.0f} MiB = {(wbytes + kv_cache) / 2**20:.0f} MiB from "
        "shapes\n\n| executable | batch | memory_analysis MiB |\n|---|---:|---:|", flush=True)
  out["memory"] = {"weights": wbytes, "kv_cache": kv_cache, "executables": []}
  for label, (_, _, _, w) in res.items():
    for r in w.compile_log:
      if r.memory_bytes is not None:
        out["memory"]["executables"].append((label, r.name, r.batch, r.memory_bytes))
        print(f"| {label}: {r.name} | {r.batch} | {r.memory_bytes / 2**20:.0f} |")
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    out["memory"]["peak"] = stats["peak_bytes_in_use"]
    print(f"\ndevice peak bytes in use (whole probe): {stats['peak_bytes_in_use'] / 2**30:.2f} GiB"
          f" of {stats.get('bytes_limit', 0) / 2**30:.1f} GiB")

  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "gpu_probe.json"), "w") as f:
    json.dump(out, f, indent=1, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
