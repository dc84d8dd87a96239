#!/usr/bin/env python
"""What spot drafter training costs the rollout it fills, measured in one run.

    python scripts/bench_spot.py [--workers 2] [--prompts 32] [--n 8] [--passes 6]

Two (or more) rollout workers, each on its own device, decode the same long-tail rollout of
the default task (the default model and drafter, fixed strategy, the same seed every pass, so
every pass decodes exactly the same tokens), alternating passes with spot training on and off.
After each pass the drafter is reset to the shipped one, so training never changes what the
next pass decodes. Printed per mode (median over passes): the rollout wall time until the
barrier, each worker's generating time, the idle worker time and the share of it spent
training, drafter steps, and the ratio on / off of the barrier time: the slowdown a training
worker inflicts on the ones still generating. On this project's CPU machine all "devices" are
the same 2 cores, so the ratio measures core contention; where each worker has its own
accelerator, a training worker computes on its own device and the generating ones share only
the host (Python threads, the PCIe link).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time



def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--prompts", type=int, default=32)
  p.add_argument("--n", type=int, default=8, help="samples per prompt")
  p.add_argument("--passes", type=int, default=6, help="timed passes per mode (interleaved)")
  p.add_argument("--arm", default="3_1_4")
  p.add_argument("--bs_threshold", type=int, default=16)
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--row_len", type=int, default=256)
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args(argv)
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={a.workers}")

  import jax

  from tlt_jax.config import asset_path
  from tlt_jax.coordinator import Coordinator, ParamStore, SpotConfig, Worker
  from tlt_jax.data.prompts import load_prompt_rows
  from tlt_jax.drafter import train_step as dts
  from tlt_jax.drafter.buffer import BufferConfig, DrafterBuffer
  from tlt_jax.drafter.merge import make_merge
  from tlt_jax.drafter.model import load_drafter
  from tlt_jax.drafter.trainer import DrafterTrainer
  from tlt_jax.models.hf_io import load_hf_model
  from tlt_jax.models.tokenizer import load_tokenizer, stop_token_ids
  from tlt_jax.optim import make_optimizer
  from tlt_jax.rollout.config import EngineConfig, SpecConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import Request
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.sharding import make_mesh

  if len(jax.devices()) < a.workers:
    raise SystemExit(f"error: {a.workers} workers need {a.workers} devices, "
                     f"{len(jax.devices())} visible (XLA_FLAGS was set before this script?)")
  mdir = asset_path("default", "model")
  cfg, params = load_hf_model(mdir)
  tok = load_tokenizer(mdir)
  dparams = load_drafter(asset_path("default", "drafter"), cfg)
  rows, _ = load_prompt_rows(asset_path("default", "data", "train.jsonl"))
  prompts = [tok.encode(r.prompt) for r in rows[:a.prompts]]
  requests = [Request(ids, i, s) for i, ids in enumerate(prompts) for s in range(a.n)]
  ecfg = EngineConfig(max_batch=64, buckets=(1, 2, 4, 8, 16, 32, 64), chunk_size=16,
                      max_prompt_len=80, max_new_tokens=288, capture_hidden=True,
                      hidden_keep=512, stop_tokens=stop_token_ids(mdir, tok),
                      spec=SpecConfig(strategy=a.arm, bs_threshold=a.bs_threshold,
                                      patience=2))
  tx = make_optimizer(3e-4)
  step_fn = dts.make_train_step(cfg, tx)
  buffer = DrafterBuffer(BufferConfig(buffer_tokens=1 << 16, window=128,
                                      windows_per_response=4), seed=a.seed)
  meshes = [make_mesh((1, 1, 1), jax.devices()[i:i + 1]) for i in range(a.workers)]
  store_sh = dts.state_shardings(dparams, tx, meshes[0])
  fresh = dts.init_state(dparams, tx, store_sh)
  workers = []
  for i, m in enumerate(meshes):
    engine = Engine(params, cfg, ecfg, worker_id=i, mesh=m, drafter_params=dparams)
    trainer = DrafterTrainer(step_fn=step_fn, shardings=dts.state_shardings(dparams, tx, m),
                             buffer=buffer, rows=a.rows, row_len=a.row_len,
                             target_params=lambda e=engine: e.params, seed=i)
    workers.append(Worker(engine, trainer))
  store = ParamStore(params, fresh)
  merge = make_merge(store_sh, meshes[0], range(a.workers))
  coords = {"on": Coordinator(workers, store, spot=SpotConfig(mode="spot"), merge=merge),
            "off": Coordinator(workers, store, spot=SpotConfig(mode="off"))}
  coords["on"].push()
  for w in workers:
    w.trainer.compile(cfg.hidden_size)
  sp = SamplingParams(temperature=1.0)

  def one(mode):
    store.publish_drafter(fresh)  # every pass starts from (and decodes with) the same drafter
    coords[mode].push()
    out = coords[mode].rollout(
        requests, sp, seed=a.seed,
        on_response=lambda w, r: buffer.add(0, r.response_ids[r.hidden_offset:], r.hidden,
                                            key=(r.request_id, r.sample_index)))
    s = out.timeline.summary()
    return {"wall": out.wall, "tokens": sum(r.num_tokens for r in out.results),
            "gen": [pw["generating_s"] for pw in s["per_worker"]], "idle": s["idle_s"],
            "share": s["idle_share_trained"] or 0.0, "critical": s["critical_path_s"],
            "steps": (out.drafter or {}).get("steps", 0),
            "digest": hash(tuple(int(x) for r in out.results for x in r.response_ids))}

  t0 = time.perf_counter()
  for mode in ("off", "on"):  # warm-up: compiles every executable either mode uses
    one(mode)
  print(f"warm-up (compiles) {time.perf_counter() - t0:.0f}s", file=sys.stderr)
  runs = {"off": [], "on": []}
  for i in range(a.passes):
    for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
      runs[mode].append(one(mode))
      r = runs[mode][-1]
      print(f"pass {i} {mode:>3}: barrier {r['wall']:.2f}s, generating "
            f"{' / '.join(f'{g:.2f}' for g in r['gen'])}s, idle {r['idle']:.2f}s "
            f"({r['share']:.0%} trained, {r['steps']} steps)", file=sys.stderr)
  digests = {r["digest"] for rs in runs.values() for r in rs}
  med = {m: {k: statistics.median(r[k] for r in rs) for k in ("wall", "idle", "share",
                                                              "critical", "steps")}
         for m, rs in runs.items()}
  gen = {m: [statistics.median(r["gen"][w] for r in rs) for w in range(a.workers)]
         for m, rs in runs.items()}
  print(f"\n{a.workers} workers, {len(requests)} requests ({a.prompts} prompts x {a.n}), "
        f"{runs['on'][0]['tokens']} tokens per pass, {a.passes} interleaved passes per mode "
        f"(medians); identical tokens in every pass: {len(digests) == 1}")
  print("| spot training | barrier s | generating s per worker | idle s | idle share trained "
        "| drafter steps | after-barrier s |")
  print("|---|---:|---|---:|---:|---:|---:|")
  for m in ("off", "on"):
    print(f"| {m} | {med[m]['wall']:.2f} | {' / '.join(f'{g:.2f}' for g in gen[m])} | "
          f"{med[m]['idle']:.2f} | {med[m]['share']:.0%} | {med[m]['steps']:.0f} | "
          f"{med[m]['critical']:.3f} |")
  print(f"\nbarrier time on / off: {med['on']['wall'] / med['off']['wall']:.3f}x "
        "(> 1: training slowed the workers still generating)")
  for c in coords.values():
    c.close()


if __name__ == "__main__":
  main()
