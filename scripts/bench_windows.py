#!/usr/bin/env python
"""Attention windows against executables: each scheme's speculative executables by count,
for the default config and the 7B recipe, and its attention time per decode step on this
machine (tlt_jax/bench/windows.py has the schemes).

    python scripts/bench_windows.py [--configs configs/default.py,configs/qwen2_5_7b_math.py]
        [--live 40,300] [--allocated 256,4096] [--batch 1,8] [--t 1,5]

Times: the default model's attention (all its layers) and the 7B architecture's (its layer
shapes, --layers_7b of them) per decode step, rows of --live tokens in caches of --allocated
new tokens past the prompt bucket, T = --t query tokens (1: plain decoding, 5: a chain-4
verification); each against "grid x2" (the engine's windows) at the same row, so a ratio
above 1 is what the scheme costs per step there.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--configs", default=",".join(
      os.path.join(os.path.dirname(HERE), "configs", c)
      for c in ("default.py", "qwen2_5_7b_math.py")))
  ap.add_argument("--live", default="40,300")
  ap.add_argument("--allocated", default="256,4096")
  ap.add_argument("--batch", default="1,8")
  ap.add_argument("--t", default="1,5")
  ap.add_argument("--layers_7b", type=int, default=2)
  ap.add_argument("--iters", type=int, default=50)
  a = ap.parse_args(argv)
  ints = lambda s: [int(x) for x in s.split(",") if x]

  from tlt_jax.bench.windows import SCHEMES, attention_step, count
  from tlt_jax.config import load_config_file, run_spec
  from tlt_jax.runtime import model_config

  print("| config | speculative (bucket, arm) pairs | cache slots | " + " | ".join(
      f"{s}: windows / executables" for s in SCHEMES) + " |")
  print("|---|---:|---:|" + "---:|" * len(SCHEMES))
  models = {}
  for path in a.configs.split(","):
    cfg = load_config_file(path)
    if not os.path.isdir(cfg.model.path):  # a GPU recipe: its shipped architecture
      with cfg.unlocked():
        cfg.model.path = "/nonexistent"
    c = count(run_spec(cfg))
    name = os.path.basename(path)
    print(f"| {name} | {c['pairs']} (buckets {c['buckets']}) | {c['cache_len']} | "
          + " | ".join(f"{c[s]['windows']} / {c[s]['executables']}" for s in SCHEMES) + " |")
    models[name] = (model_config(cfg), cfg.rollout.prompt_bucket)

  print("\nattention per decode step, relative to grid x2 at the same row (its time in us)")
  print("| model | batch | T | live | allocated | grid x2 us | " + " | ".join(SCHEMES[1:])
        + " |\n|---|---:|---:|---:|---:|---:|" + "---:|" * (len(SCHEMES) - 1))
  for name, (mcfg, base) in models.items():
    layers = None if mcfg.num_layers <= 8 else a.layers_7b
    for batch in ints(a.batch):
      for t in ints(a.t):
        for live in ints(a.live):
          for alloc in ints(a.allocated):
            if live + t > alloc + base:
              continue
            time = {s: attention_step(mcfg, batch=batch, t=t, live=live, allocated=alloc + base,
                                      scheme=s, base=base, layers=layers,
                                      iters=a.iters) for s in SCHEMES}
            ref = time["grid x2"]
            print(f"| {name}{'' if layers is None else f' ({layers} layers)'} | {batch} | {t} | "
                  f"{live} | {alloc} | {ref * 1e6:.0f} | "
                  + " | ".join(f"{time[s] / ref:.2f}x" for s in SCHEMES[1:]) + " |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
