"""The cost model's profile of the machine it runs on, and its predictions checked there.

`calibrate` times the rollout's forwards as the engine runs them (`bench/spec_costs.py`: N
repetitions inside one compiled loop, weights as arguments) at several batch sizes: the
target's forward over 1 and each arm's `verify_tokens` new tokens with a cache, and the
drafter's over 1, `topk` and `steps + 1`. It fits a `cost.Hardware` to those components
alone (`cost.fit`), then
predicts what it did not see: the plain decode step (a forward, sampling and the chunk's
bookkeeping) and each arm's whole speculative step (the verification forward over its
`verify_tokens`, the drafter's catch-up over steps + 1, steps - 1 more drafter steps of
topk tokens, the acceptance rule), and the ratio of the two, which is what decides whether
speculation pays. `scripts/bench_cost_model.py` prints the table; scripts/gpu_check.sh runs
the same on a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.lora import num_adapter_params
from tlt_jax.plan import cost
from tlt_jax.rollout.policies.strategy import Strategy

@dataclasses.dataclass
class Calibration:
  """What `calibrate` measured and fitted: `hardware`; per (batch, label) the measured
  seconds and the profile's prediction (`one_rate`: without its shape factors), `fitted`
  marking the components it was fitted on."""

  hardware: cost.Hardware
  rows: list[dict]

  def table(self) -> str:
    lines = ["| batch | forward | measured ms | predicted ms | predicted / measured | one rate "
             "/ measured | in fit |", "|---:|---|---:|---:|---:|---:|:---:|"]
    for r in self.rows:
      lines.append(f"| {r['batch']} | {r['label']} | {r['measured'] * 1e3:.3f} | "
                   f"{r['predicted'] * 1e3:.3f} | {r['predicted'] / r['measured']:.2f} | "
                   f"{r['one_rate'] / r['measured']:.2f} | {'yes' if r['fitted'] else ''} |")
    return "\n".join(lines)

  def ratios(self) -> list[dict]:
    """Per batch and arm: the speculative step over the plain step, measured and predicted."""
    by = {(r["batch"], r["label"]): r for r in self.rows}
    out = []
    for (b, label), r in by.items():
      if label.startswith("spec step "):
        plain = by[(b, "plain step")]
        out.append({"batch": b, "arm": label[len("spec step "):],
                    "measured": r["measured"] / plain["measured"],
                    "predicted": r["predicted"] / plain["predicted"],
                    "one_rate": r["one_rate"] / plain["one_rate"]})
    return out


def component_cost(cfg: ModelConfig, label: str, batch: int, cache_len: int,
                   kv_len: int) -> cost.Cost:
  """The cost of a `measure_costs` entry (its label) at `batch`: the loops attend over the
  whole cache (`cache_len`) except the plain step, which reads `kv_len`."""
  kind, _, rest = label.partition(" fwd T=")
  if label == "plain step":
    return cost.forward(cfg, batch, 1, kv_len)
  if kind == "verify":
    return cost.forward(cfg, batch, int(rest), cache_len)
  if kind == "drafter":
    return cost.draft(cfg, batch, int(rest), cache_len)
  if label.startswith("spec step "):
    return cost.spec_step(cfg, Strategy(label[len("spec step "):]), batch, cache_len)
  raise ValueError(f"component_cost: unknown forward {label!r}")


def calibrate(params, dparams, cfg: ModelConfig, sp, *, batches: Sequence[int] = (1, 4, 16),
              arms: Sequence[str] = ("4_1_5", "3_2_6"), iters: int = 64, prompt_len: int = 64,
              cache_len: int = 256, name: str = "this machine",
              progress=None) -> Calibration:
  """Times the forwards (module docstring) on this machine, fits a profile to the
  components, predicts every entry. progress(done, total, measured): called after each batch
  with its seconds per component ({label: s}), so a caller cut off later keeps them."""
  from tlt_jax.bench.spec_costs import measure_costs
  from tlt_jax.rollout.scheduler import kv_bucket
  kv_len = kv_bucket(prompt_len + iters, 16, cache_len)
  measured: dict[tuple[int, str], float] = {}
  for i, b in enumerate(batches):
    out = measure_costs(params, dparams, cfg, b, arms, sp, iters=iters, prompt_len=prompt_len,
                        cache_len=cache_len, kv_len=kv_len)
    for label, s in out.items():
      measured[(b, label)] = s
    if progress:
      progress(i + 1, len(batches), out)
  fitted = [k for k in measured if " fwd T=" in k[1]]
  costs = {k: component_cost(cfg, k[1], k[0], cache_len, kv_len) for k in measured}
  one_rate = cost.fit([costs[k] for k in fitted], [measured[k] for k in fitted], name=name)
  hw = dataclasses.replace(one_rate, shape_factors=shape_factors(
      one_rate, {k: (costs[k], measured[k]) for k in fitted}))
  rows = [{"batch": b, "label": label, "measured": measured[(b, label)],
           "predicted": hw.seconds(costs[(b, label)]),
           "one_rate": one_rate.seconds(costs[(b, label)]), "fitted": (b, label) in fitted}
          for b, label in sorted(measured, key=lambda k: (k[0], _order(k[1])))]
  return Calibration(hw, rows)


def shape_factors(hw: cost.Hardware, components: dict[tuple[int, str], tuple[cost.Cost, float]]
                  ) -> tuple[tuple[str, int, int, float], ...]:
  """Per measured component forward ((batch, label) -> (its cost, measured seconds)): how far
  `hw`'s size-dependent terms (roofline and per-layer) were off at its shape, measured over
  fitted with fixed_s and collectives aside (cost.py's module docstring)."""
  out = []
  for (b, label), (c, seconds) in sorted(components.items()):
    kind, _, tokens = label.partition(" fwd T=")
    sized = hw.roofline(c.bytes, c.flops) + hw.layer_s * c.layers
    rest = hw.fixed_s + c.collective_bytes / hw.link_bw
    out.append(({"verify": "target", "drafter": "drafter"}[kind], b, int(tokens),
                float(np.clip((seconds - rest) / sized, 0.05, 20.0)) if sized > 0 else 1.0))
  return tuple(out)


def _order(label: str) -> tuple:
  kind = 0 if label == "plain step" else 1 if "verify" in label else 2 if "drafter" in label \
      else 3
  return (kind, label)


# --------------------------------------------------------------------------- rollouts
def host_overhead(params, cfg: ModelConfig, hw: cost.Hardware, *, rows: int = 1,
                  new_tokens: int = 192, chunk: int = 16, seed: int = 0) -> cost.Hardware:
  """`hw` with the host's prices fitted on two probes of their own: `chunk_s` from a plain
  rollout of `rows` rows x `new_tokens` with no refill, `op_s` from 3 x `rows` requests through
  the same `rows` slots (refills and resizes); each decoded by the engine on this machine
  (the fastest of 3 calls after one that compiles), less the simulator's price of it on `hw`.
  At batch 1 by default, where the fitted profile prices the forwards best: a probe at batch 4
  also absorbed the profile's underpricing of 4-row forwards on CPU (7 ms "per chunk", which
  then overpredicted batch 1 by 2x). The validation (`validate_rollouts`) runs batch 1 with
  other lengths, batch 8 and a long tail."""
  import dataclasses

  base = EngineConfigFor(rows, chunk, new_tokens)
  probe = dataclasses.replace(hw, chunk_s=0.0, op_s=0.0)
  measured, sim, chunks, _ = _probe(params, cfg, probe, base, rows, new_tokens, seed)
  hw = dataclasses.replace(hw, chunk_s=max(measured - sim, 0.0) / max(chunks, 1), op_s=0.0)
  lens = [new_tokens // (1 + i % 3) for i in range(3 * rows)]
  measured, sim, _, ops = _probe(params, cfg, hw, base, len(lens), lens, seed)
  return dataclasses.replace(hw, op_s=max(measured - sim, 0.0) / max(ops, 1))


def _fastest(engine, reqs, sp, seed: int, repeats: int = 3) -> float:
  """The engine's fastest of `repeats` timed generate calls (its chunk log: the last one's)."""
  import time
  best = float("inf")
  for _ in range(repeats):
    engine.chunk_log.clear()
    t = time.perf_counter()
    engine.generate(reqs, sp, seed=seed)
    best = min(best, time.perf_counter() - t)
  return best


def EngineConfigFor(rows: int, chunk: int, new_tokens: int):
  from tlt_jax.rollout.config import EngineConfig
  return EngineConfig(max_batch=rows, buckets=tuple(b for b in (1, 2, 4, 8, 16) if b < rows)
                      + (rows,), chunk_size=chunk, max_prompt_len=16, max_new_tokens=new_tokens)


def _probe(params, cfg, hw, ecfg, n: int, lens, seed: int):
  """(engine seconds, simulated seconds, engine chunks, layout operations) of n requests of
  `lens` tokens (one number: all)."""

  from tlt_jax.plan.sim_engine import SimEngine
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import Request
  from tlt_jax.rollout.sampling import SamplingParams
  lens = [lens] * n if isinstance(lens, int) else list(lens)
  reqs = [Request([1 + (j % (cfg.vocab_size - 1))] * 6, request_id=j, max_new_tokens=int(m))
          for j, m in enumerate(lens)]
  sp = SamplingParams(temperature=1.0)
  engine = Engine(params, cfg, ecfg)
  engine.generate(reqs, sp, seed=seed)
  measured = _fastest(engine, reqs, sp, seed)
  s = SimEngine(cfg, ecfg, hw)
  s.lengths = {r.key: int(r.max_new_tokens) for r in reqs}
  ops = [0]
  apply = s._apply
  s._apply = lambda *a: ops.__setitem__(0, ops[0] + 1) or apply(*a)
  s.generate(reqs, sp, seed=seed)
  return measured, s.now, len(engine.chunk_log), ops[0]


def validate_rollouts(params, dparams, cfg: ModelConfig, hw: cost.Hardware, *,
                      arm: str = "4_1_5", new_tokens: int = 96, seed: int = 0,
                      progress=None) -> list[dict]:
  """Whole rollouts predicted by the simulator (sim.py, on profile `hw`), then decoded by the
  engine on this machine: batch 1, batch 8 and a long tail (24 rows of log-normal lengths at
  max_batch 8: refill, then compaction down to one row), each plainly and with `arm` from the
  first chunk, at temperature 1. Lengths are each request's max_new_tokens (no stop token), so
  both decode the same tokens; the arm's acceptance is the one the engine measured in the
  timed run (an input of the simulator, not what it predicts). The engine's executables are
  compiled and run once by a first, untimed run of each with the same seed (the same tokens,
  the same chunks: a fresh executable's first run is slow on CPU). Returns rows {workload,
  mode, predicted, one_rate (`hw` without its shape factors), measured,
  tokens_per_verification}."""
  from tlt_jax.plan.sim_engine import SimEngine
  from tlt_jax.plan.workload import Acceptance
  from tlt_jax.rollout.config import EngineConfig, SpecConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import Request
  from tlt_jax.rollout.sampling import SamplingParams
  rng = np.random.default_rng(seed)
  tail = np.clip(rng.lognormal(np.log(new_tokens / 3), 0.8, 24), 4, new_tokens).astype(int)
  prompt = [1 + i % (cfg.vocab_size - 1) for i in range(12)]
  workloads = {"batch 1": [new_tokens], "batch 8": [new_tokens] * 8, "tail": list(tail)}
  sp = SamplingParams(temperature=1.0)
  rows = []
  jobs = [(w, m) for w in workloads for m in ("plain", arm)]
  for i, (w, mode) in enumerate(jobs):
    lens = workloads[w]
    reqs = [Request(prompt[:4 + j % 8], request_id=j, max_new_tokens=int(n))
            for j, n in enumerate(lens)]
    spec = None if mode == "plain" else SpecConfig(strategy=mode, bs_threshold=8, patience=1,
                                                   background_compile=False)
    ecfg = EngineConfig(max_batch=8, buckets=(1, 2, 4, 8), chunk_size=16, max_prompt_len=16,
                        max_new_tokens=new_tokens, spec=spec)
    engine = Engine(params, cfg, ecfg, drafter_params=dparams if spec else None)
    engine.generate(reqs, sp, seed=seed)  # compiles (and runs once) every executable it needs
    measured = _fastest(engine, reqs, sp, seed)  # the same tokens, the same chunks
    log = engine.chunk_log
    verifs = sum(m.verifications for m in log)
    tpv = sum(m.tokens for m in log if m.arm is not None) / verifs if verifs else None
    predicted = {}
    for key, profile in (("predicted", hw),
                         ("one_rate", dataclasses.replace(hw, shape_factors=()))):
      s = SimEngine(cfg, ecfg, profile,
                    acceptance=Acceptance(tpv=((mode, tpv),)) if tpv else None)
      s.lengths = {r.key: int(r.max_new_tokens) for r in reqs}
      s.generate(reqs, sp, seed=seed)
      predicted[key] = s.now
    rows.append({"workload": w, "mode": mode, **predicted, "measured": measured,
                 "tokens_per_verification": tpv})
    if progress:
      progress(i + 1, len(jobs))
  return rows


def rollout_table(rows: list[dict]) -> str:
  """The rollouts' table, and per workload the speculative / plain ratio both ways."""
  lines = ["| workload | mode | tokens/verif. | measured s | predicted s | predicted / measured "
           "| one rate / measured |", "|---|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    tpv = f"{r['tokens_per_verification']:.2f}" if r["tokens_per_verification"] else ""
    lines.append(f"| {r['workload']} | {r['mode']} | {tpv} | {r['measured']:.3f} | "
                 f"{r['predicted']:.3f} | {r['predicted'] / r['measured']:.2f} | "
                 f"{r['one_rate'] / r['measured']:.2f} |")
  lines += ["", "| workload | arm / plain measured | predicted | predicted / measured | one rate "
            "/ measured |", "|---|---:|---:|---:|---:|"]
  by = {}
  for r in rows:
    by.setdefault(r["workload"], []).append(r)
  for w, (plain, spec) in by.items():
    m, p = spec["measured"] / plain["measured"], spec["predicted"] / plain["predicted"]
    o = spec["one_rate"] / plain["one_rate"]
    lines.append(f"| {w} | {m:.2f} | {p:.2f} | {p / m:.2f} | {o / m:.2f} |")
  return "\n".join(lines)


# --------------------------------------------------------------------------- the learner
def learner_setup(cfg):
  """The learner of a config as a run builds it (run.learner_spec on runtime's mesh and
  model): (LearnerSpec, LearnerState, the model's ModelConfig, the training prompts' token
  lengths)."""
  from tlt_jax import config as config_lib
  from tlt_jax import runtime
  from tlt_jax.rl import learner as rl_learner
  from tlt_jax.run import learner_spec
  spec = config_lib.run_spec(cfg)
  mesh = runtime.learner_mesh(cfg)
  model_cfg, params, tokenizer, _ = runtime.load_model(cfg, mesh=mesh)
  ls = learner_spec(spec, model_cfg, mesh)
  rows = runtime.load_train_rows(cfg)[:1024]
  prompts = [n for n in (len(tokenizer.encode(r.prompt)) for r in rows)
             if n <= cfg.data.max_prompt_len]
  return ls, rl_learner.init_learner(params, ls), model_cfg, prompts


def _learner_pass(ls, state, seq_lens: Sequence[int], prompt_lens: Sequence[int], seed: int,
                  minibatches: int):
  """One RL step's learner phases as rl_step runs and times them (the mini-batches packed and
  their old log-probs computed; then the update) on samples of these total lengths (random
  tokens); -> (state, log-prob seconds, update seconds)."""
  import time

  import jax
  import numpy as np

  from tlt_jax.rl import batching
  from tlt_jax.rl import learner as rl_learner
  rng = np.random.default_rng(seed)
  vocab = ls.cfg.vocab_size
  samples = []
  for i, n in enumerate(seq_lens):
    p = min(int(prompt_lens[i % len(prompt_lens)]), int(n) - 1)
    samples.append(batching.Sample(  # (rollout log-probs as a run records them)
        rng.integers(1, vocab, p).astype(np.int32),
        rng.integers(1, vocab, int(n) - p).astype(np.int32), float(rng.normal()),
        -rng.exponential(size=int(n) - p).astype(np.float32)))
  t = time.perf_counter()
  batches = batching.minibatches(samples, ls, minibatches, seed=seed)
  prepared = rl_learner.prepare(state, batches, ls)
  jax.block_until_ready(prepared)
  lp = time.perf_counter() - t
  t = time.perf_counter()
  state, _ = rl_learner.update(state, prepared, ls)
  jax.block_until_ready(state.params)
  return state, lp, time.perf_counter() - t


def learner_profile(ls, state, model_cfg: ModelConfig, hw: cost.Hardware, *,
                    repeats: int = 3):
  """The learner's prices on this machine (learner.Learner), fitted on probes of their own: two
  mini-batches of one or two micro-batches of one shape each, for two shapes (the narrowest
  length bucket and an 8x longer one). Per probe the fastest of `repeats` passes after one that
  compiles. The log-prob pass gives its FLOP rate and per-micro-batch cost; the update its
  rate, per-micro-batch cost and the optimizer step (non-negative least squares on relative
  residuals). -> (learner.Learner, the state the update probes left)."""
  import numpy as np
  from scipy.optimize import nnls

  from tlt_jax.models import packed_impl
  from tlt_jax.plan.learner import Learner, Micro, micro_flops, remat_mode
  from tlt_jax.rl import batching
  short, long_ = ls.pad_multiple, 8 * ls.pad_multiple
  rows = {}
  for t in (short, long_):
    (_, _, rows[t]), = batching.micro_layout([t], ls.micro_batch, ls.pad_multiple, ls.max_len,
                                         ls.micro_batch_tokens, ls.row_multiple)
  cases = [(short, 1), (short, 2), (long_, 1), (long_, 2)]
  lp, up = {}, {}
  for t, m in cases:
    # two mini-batches of m micro-batches each: the first one's old log-probs are not
    # computed (learner.prepare), so the second's are the pass timed
    lens = [t] * (2 * rows[t] * m)
    best = (float("inf"), float("inf"))
    for r in range(repeats + 1):
      state, a, b = _learner_pass(ls, state, lens, [t // 2], r, minibatches=2)
      if r:
        best = (min(best[0], a), min(best[1], b))
    lp[(t, m)], up[(t, m)] = best
  remat = remat_mode(model_cfg)
  passes = 4 if remat == "full" else 3  # (the probes' attention is a small share: as weights)
  skip = packed_impl(model_cfg, short)[0] == "fused"
  f = {t: micro_flops(model_cfg, Micro.whole(rows[t], t), fused=skip) for t in (short, long_)}
  # log-probs: t = k * (flops x a + c) over k = m micro-batches' forwards (+ 2m with the
  # reference's); update, per mini-batch: t / 2 = m * (passes x flops x a + c) + o; every
  # coefficient >= 0, relative residuals (cost.fit's way: a least-squares fit clipped after
  # the fact gave a negative per-micro-batch cost and a rate 2x too slow)
  forwards = 1 + 2 * (ls.gcfg.kl_coef > 0)
  t_lp = np.array([lp[k] for k in cases]) / forwards
  t_up = np.array([up[k] for k in cases]) / 2
  a_lp = nnls(np.array([[f[t] * m, m] for t, m in cases]) / t_lp[:, None], np.ones(len(cases)))[0]
  a_up = nnls(np.array([[passes * f[t] * m, m, 1.0] for t, m in cases]) / t_up[:, None],
              np.ones(len(cases)))[0]
  a_lp[0], a_up[0] = max(a_lp[0], 1e-30), max(a_up[0], 1e-30)
  learner = Learner(gpus=1, fused_attention=packed_impl(model_cfg, short)[0] == "fused",
                    fwd_eff=float(1.0 / (a_lp[0] * hw.flops)),
                    fwd_micro_s=float(a_lp[1]), train_eff=float(1.0 / (a_up[0] * hw.flops)),
                    train_micro_s=float(a_up[1]),
                    optimizer_s=float(a_up[2]), remat=remat)
  return learner, state


def validate_learner(ls, state, model_cfg: ModelConfig, hw: cost.Hardware, learner,
                     lengths, prompt_lens: Sequence[int], *, max_new_tokens: int,
                     responses: int, minibatches: int, steps: int = 3, seed: int = 0,
                     progress=None
                     ) -> list[dict]:
  """RL steps' learner phases predicted (learner.learner_phases on the learner's own packing,
  learner.Layout) and then run by the learner on this machine: `responses` samples per step,
  response lengths drawn from `lengths` (workload.Lengths), prompt lengths cycled from
  `prompt_lens`; one untimed pass first compiles every length bucket. Returns rows {step,
  phase, predicted, measured}."""
  import numpy as np

  from tlt_jax.plan.learner import Layout, learner_phases
  layout = Layout(ls.micro_batch, ls.micro_batch_tokens, ls.pad_multiple, ls.max_len,
                  minibatches, ls.row_multiple, ls.max_rows, ls.gcfg.ppo_epochs)
  warm, t = [], ls.pad_multiple
  while t < ls.max_len:
    warm.append(t)
    t *= 2
  warm.append(ls.max_len)
  for r in range(2):  # (each pass's mini-batches hold a random part of the buckets)
    state, _, _ = _learner_pass(ls, state, warm * 4, prompt_lens, seed + r, minibatches)
  rng = np.random.default_rng(seed)
  rows = []
  for k in range(steps):
    resp = lengths.draw(responses, max_new_tokens, rng, step=k)
    seq = [int(prompt_lens[i % len(prompt_lens)]) + int(n) for i, n in enumerate(resp)]
    pred = learner_phases(model_cfg, hw, learner, layout.shapes(seq, seed + k),
                          reference=ls.gcfg.kl_coef > 0, epochs=layout.epochs,
                          adapters=0 if ls.lora is None else num_adapter_params(model_cfg, ls.lora))
    state, lp, up = _learner_pass(ls, state, seq, prompt_lens, seed + k, minibatches)
    rows += [{"step": k + 1, "phase": "logprobs", "predicted": pred["logprobs"],
              "measured": lp},
             {"step": k + 1, "phase": "update", "predicted": pred["update"], "measured": up}]
    if progress:
      progress(k + 1, steps)
  return rows


def learner_table(learner, rows: list[dict]) -> str:
  lines = [f"learner fitted here: log-prob pass {learner.fwd_eff:.2f} x the profile's matmul "
           f"rate + {learner.fwd_micro_s * 1e3:.1f} ms per micro-batch; update "
           f"{learner.train_eff:.2f} x + {learner.train_micro_s * 1e3:.1f} ms per micro-batch "
           f"+ {(learner.optimizer_s or 0) * 1e3:.1f} ms per optimizer step", "",
           "| RL step | phase | measured s | predicted s | predicted / measured |",
           "|---:|---|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['step']} | {r['phase']} | {r['measured']:.3f} | {r['predicted']:.3f} | "
                 f"{r['predicted'] / r['measured']:.2f} |")
  return "\n".join(lines)
