"""Does the drafter keep up with a moving policy? (scripts/bench_drift.py; docs/drafter.md)

One TLT run of a config (the gate off, so the drafter is spot-trained in every idle window),
checkpointed every `every` steps and all kept; then, at step 0 and every checkpoint t, on
held-out prompts the policy never trained on:

  how far the policy moved   per-token KL(pi_t || pi_0) and pi_t's entropy over pi_t's own
                             samples at the rollout temperature (full distributions, exact per
                             position), held-out greedy accuracy, response-length percentiles;
  tokens per verification    of chain 4_1_5 for three drafters against pi_t:
    frozen   the drafter the run started from (step 0's),
    spot     the run's drafter at step t, trained as a TLT run trains it,
    ceiling  the frozen drafter fitted offline on pi_t's own rollouts (the training file's
             last prompts, `samples` each at the rollout temperature: by default as
             many responses as the spot trainer's buffer holds, 2 steps x 32 x 8) for as many
             tokens as the spot trainer had trained on by step t (the run's metrics), with
             the run's drafter optimizer settings: what the same budget buys with data that
             is all the current policy's;
  each greedy (read off pi_t's greedy responses) and at the rollout temperature (read off
  `eval_samples` of pi_t's samples per prompt), both with `drafter.acceptance.measure`: the
  engine's figure (exactly greedy, in expectation sampled: tests/test_acceptance.py), with
  its standard error over sequences; the three drafters are read off the SAME sequences, so
  their differences (spot - frozen, spot - ceiling) carry paired standard errors, which are
  what the claims rest on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRAFTERS = ("frozen", "spot", "ceiling")


# ------------------------------------------------------------------------------ the run
def train_run(workdir: str, *, config: str, steps: int, every: int, extra: Sequence[str],
              cache: str) -> None:
  """The RL run whose checkpoints the benchmark reads (resumes if `workdir` holds one)."""
  cmd = [sys.executable, "-m", "tlt_jax.train", "--config", config, "--workdir", workdir,
         f"--config.train.steps={steps}", f"--config.train.checkpoint_every={every}",
         f"--config.train.keep_checkpoints={steps // every + 1}",
         "--config.tlt.spec.gate.enabled=False", f"--config.compilation_cache={cache}",
         *extra]
  print("+", " ".join(cmd[1:]), file=sys.stderr, flush=True)
  subprocess.run(cmd, check=True, cwd=ROOT)


def load_step(workdir: str, step: int) -> tuple[dict, dict]:
  """(actor params, drafter params) of checkpoint `step` of the run in `workdir`."""
  from tlt_jax.checkpoint import Checkpointer
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=None)
  return ckpt.read_subtree("actor", step), ckpt.read_subtree("drafter/params", step)


def spot_tokens(workdir: str) -> dict[int, int]:
  """Drafter tokens the spot trainer had trained on after each step (the merge's counts)."""
  from tlt_jax.metrics import read_records
  total, out = 0, {0: 0}
  for r in read_records(os.path.join(workdir, "metrics.jsonl")):
    if "reward" in r:
      total += int((r.get("drafter") or {}).get("tokens", 0))
      out[int(r["step"])] = total
  return out


# ----------------------------------------------------------------------- measurements
def _engine(params, cfg, prompts, stop, *, max_new: int, dparams=None, capture=False,
            max_batch: int = 64):
  from tlt_jax.rollout.config import EngineConfig, SpecConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.scheduler import buckets_upto
  spec = None if dparams is None else SpecConfig(strategy="4_1_5", bs_threshold=max_batch,
                                                 patience=1, use_kernel=False)
  ecfg = EngineConfig(max_batch=max_batch, buckets=buckets_upto(max_batch), chunk_size=16,
                      max_prompt_len=16 * -(-max(map(len, prompts)) // 16),
                      max_new_tokens=max_new, stop_tokens=stop, spec=spec,
                      capture_hidden=capture)
  return Engine(params, cfg, ecfg, drafter_params=dparams)


def generate(params, cfg, prompts, stop, *, temperature: float, seed: int, max_new: int,
             dparams=None, capture=False):
  """-> (results sorted by request, the engine) for `prompts` at `temperature`."""
  from tlt_jax.rollout.records import Request
  from tlt_jax.rollout.sampling import SamplingParams
  engine = _engine(params, cfg, prompts, stop, max_new=max_new, dparams=dparams,
                   capture=capture)
  out = engine.generate([Request(p, request_id=i) for i, p in enumerate(prompts)],
                        SamplingParams(temperature=temperature), seed=seed)
  return sorted(out, key=lambda r: r.request_id), engine


def policy_figures(params, params0, cfg, seqs) -> dict[str, float]:
  """Per-token KL(pi_t || pi_0) and entropy of pi_t over the response positions of `seqs`
  ((prompt, response) sampled from pi_t), from the full distributions."""
  import jax
  import jax.numpy as jnp
  from tlt_jax.models import forward

  @jax.jit
  def logp(p, tok):
    pos = jnp.broadcast_to(jnp.arange(tok.shape[1], dtype=jnp.int32), tok.shape)
    return jax.nn.log_softmax(forward(p, tok, pos, cfg=cfg).logits.astype(jnp.float32), -1)

  t = -(-max(len(p) + len(r) for p, r in seqs) // 64) * 64
  tok = np.zeros((len(seqs), t), np.int32)
  mask = np.zeros((len(seqs), t), bool)
  for i, (p, r) in enumerate(seqs):
    tok[i, :len(p) + len(r)] = np.concatenate([p, r])
    mask[i, len(p) - 1:len(p) + len(r) - 1] = True  # positions that predict response tokens
  lt, l0 = np.asarray(logp(params, tok)), np.asarray(logp(params0, tok))
  pt = np.exp(lt)
  kl = (pt * (lt - l0)).sum(-1)[mask]
  ent = -(pt * lt).sum(-1)[mask]
  return {"kl": float(kl.mean()), "entropy": float(ent.mean())}


def fit_ceiling(params, dparams0, cfg, prompts, stop, *, tokens: int, run_cfg, seed: int,
                max_new: int, samples: int = 1) -> tuple[dict, int]:
  """The frozen drafter trained on pi_t's own rollouts of `prompts` (`samples` each) for
  `tokens` training tokens, as the spot trainer trains (its buffer windows with their
  context, packing, optimizer, loss). Returns (drafter params, optimizer steps)."""
  import jax
  from tlt_jax.drafter import train_step as dts
  from tlt_jax.drafter.buffer import BufferConfig, DrafterBuffer
  from tlt_jax.drafter.loss import LossConfig
  from tlt_jax.drafter.packing import fill_batch
  from tlt_jax.optim import make_optimizer
  d = run_cfg["tlt"]["drafter"]
  rows, row_len = int(d["rows"]), int(d["row_len"])
  steps = max(int(round(tokens / (rows * row_len))), 0)
  if steps == 0:
    return dparams0, 0
  results, engine = generate(params, cfg, [p for p in prompts for _ in range(samples)], stop,
                             temperature=run_cfg["rollout"]["temperature"], seed=seed,
                             max_new=max_new, capture=True)
  context = int(d.get("context", 0))
  buf = DrafterBuffer(BufferConfig(buffer_tokens=1 << 30, window=int(d["window"]),
                                   context=context,
                                   windows_per_response=int(d["windows_per_response"]),
                                   keep_steps=1), seed=seed)
  states = engine.prompt_hidden([r.prompt_ids for r in results]) if context else None
  for i, res in enumerate(results):
    if res.hidden is not None:
      off = res.hidden_offset
      with_prompt = states is not None and off == 0
      buf.add(0, res.response_ids[off:], res.hidden, None,
              key=(res.request_id, res.sample_index),
              prompt_ids=res.prompt_ids if with_prompt else (),
              prompt_hidden=states[i] if with_prompt else None)
  tx = make_optimizer(float(d["lr"]), warmup_steps=int(d["warmup_steps"]))
  step = dts.make_train_step(cfg, tx, LossConfig(unroll_steps=int(d["unroll"])), donate=True)
  state = dts.init_state(jax.tree.map(np.asarray, dparams0), tx)
  rng = np.random.default_rng([seed, 5])
  for _ in range(steps):
    batch, _ = fill_batch(lambda n: buf.sample(n, rng), rows, row_len)
    state, _ = step(state, params, batch)
  return jax.device_get(state.params), steps


# ------------------------------------------------------------------------------ the bench
def measure_step(t: int, params, dparams_spot, ctx: dict[str, Any]) -> dict[str, Any]:
  """Every figure of checkpoint `t` (module docstring)."""
  from tlt_jax.drafter.acceptance import difference, measure
  from tlt_jax.rl.rewards import get_reward_fn
  from tlt_jax.rollout.sampling import SamplingParams
  cfg, stop, max_new = ctx["cfg"], ctx["stop"], ctx["max_new"]
  prompts, answers = ctx["prompts"], ctx["answers"]
  greedy, _ = generate(params, cfg, prompts, stop, temperature=0.0, seed=0, max_new=max_new)
  reward = get_reward_fn(ctx["reward"])
  acc = np.mean([reward(ctx["tokenizer"].decode(r.response_ids, skip_special_tokens=True), a)
                 >= 1.0 for r, a in zip(greedy, answers)])
  temp = ctx["temperature"]
  sampled, _ = generate(params, cfg, [p for p in prompts for _ in range(ctx["eval_samples"])],
                        stop, temperature=temp, seed=1000 + t, max_new=max_new)
  lengths = np.asarray([len(r.response_ids) for r in sampled])
  row: dict[str, Any] = {"step": t, "accuracy": float(acc),
                         **policy_figures(params, ctx["params0"], cfg,
                                          [(r.prompt_ids, r.response_ids) for r in sampled]),
                         "length_p50": float(np.percentile(lengths, 50)),
                         "length_p90": float(np.percentile(lengths, 90)),
                         "length_max": int(lengths.max()),
                         "sequences": {"greedy": len(greedy), "sampled": len(sampled)}}
  ceiling, ceiling_steps = fit_ceiling(
      params, ctx["dparams0"], cfg, ctx["train_prompts"], stop, tokens=ctx["tokens"].get(t, 0),
      run_cfg=ctx["run_cfg"], seed=t, max_new=max_new, samples=ctx["samples"])
  row["spot_tokens"], row["ceiling_steps"] = ctx["tokens"].get(t, 0), ceiling_steps
  drafters = {"frozen": ctx["dparams0"], "spot": dparams_spot, "ceiling": ceiling}
  for kind, res, sp in (("greedy", greedy, SamplingParams(temperature=0.0)),
                        ("sampled", sampled, SamplingParams(temperature=temp))):
    seqs = [(r.prompt_ids, r.response_ids) for r in res]
    got = {name: measure(params, dp, seqs, cfg=cfg, depth=4, sampling=sp)
           for name, dp in drafters.items()}
    for name, m in got.items():
      row[f"{name}_{kind}"], row[f"{name}_{kind}_se"] = m["tokens_per_verify"], m["stderr"]
    for other in ("frozen", "ceiling"):
      d, se = difference(got["spot"], got[other])
      row[f"spot_minus_{other}_{kind}"], row[f"spot_minus_{other}_{kind}_se"] = d, se
  print(json.dumps(row), file=sys.stderr, flush=True)
  return row


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per checkpoint after step 0 and kind: the spot drafter over the ceiling (the 0.9 bar),
  the frozen drafter's decay since step 0 with its standard error (different sequences:
  unpaired), and the share of it the spot one recovered (the half bar; None where the decay
  is within two standard errors of none)."""
  out = []
  for r in rows[1:]:
    v: dict[str, Any] = {"step": r["step"]}
    for kind in ("greedy", "sampled"):
      decay = rows[0][f"frozen_{kind}"] - r[f"frozen_{kind}"]
      se = float(np.hypot(rows[0][f"frozen_{kind}_se"] or 0.0, r[f"frozen_{kind}_se"] or 0.0))
      v[f"spot_over_ceiling_{kind}"] = r[f"spot_{kind}"] / r[f"ceiling_{kind}"]
      v[f"decay_{kind}"], v[f"decay_{kind}_se"] = decay, se
      v[f"recovered_{kind}"] = (r[f"spot_minus_frozen_{kind}"] / decay if decay > 2 * se
                                else None)
    out.append(v)
  return out


def context(workdir: str, *, num_prompts: int, num_train_prompts: int, samples: int,
            eval_samples: int) -> dict[str, Any]:
  """What every checkpoint's measurement shares: the run's model config, its starting policy
  and drafter, held-out and training prompts (after those the run drew), the spot tokens."""
  from tlt_jax.data.prompts import load_files, split_paths
  from tlt_jax.drafter.model import load_drafter
  from tlt_jax.models.hf_io import load_hf_model
  from tlt_jax.models.tokenizer import load_tokenizer, stop_token_ids
  with open(os.path.join(workdir, "config.json")) as f:
    run_cfg = json.load(f)
  m = run_cfg["model"]
  cfg, params0 = load_hf_model(m["path"])
  dparams0 = load_drafter(run_cfg["tlt"]["drafter"]["init"], cfg)
  tok = load_tokenizer(m["path"])
  test = load_files(split_paths(run_cfg["data"]["test_path"]))  # (one file or several)
  train = load_files(split_paths(run_cfg["data"]["train_path"]), key="data.train_path")
  test, train = test[:num_prompts], train[-num_train_prompts:]
  return {"cfg": cfg, "params0": params0, "dparams0": dparams0, "tokenizer": tok,
          "stop": tuple(stop_token_ids(m["path"], tok)), "run_cfg": run_cfg,
          "max_new": int(run_cfg["rollout"]["max_new_tokens"]),
          "temperature": float(run_cfg["rollout"]["temperature"]),
          "reward": run_cfg["reward"]["name"],
          "prompts": [tok.encode(r.prompt) for r in test], "answers": [r.answer for r in test],
          "train_prompts": [tok.encode(r.prompt) for r in train],
          "tokens": spot_tokens(workdir), "samples": samples, "eval_samples": eval_samples}


def table(rows: list[dict[str, Any]]) -> str:
  """The policy's movement and the three drafters per checkpoint, then the paired differences
  with the two bars' figures."""
  fmt = lambda r, k: f"{r[k]:.2f}±{r[k + '_se']:.2f}"
  head = ("| step | KL(pi_t‖pi_0)/token | entropy | held-out acc | len p50/p90 | spot tokens | "
          "greedy: frozen / spot / ceiling | T=1: frozen / spot / ceiling |")
  out = [head, "|" + "---|" * 8]
  for r in rows:
    g = " / ".join(fmt(r, f"{d}_greedy") for d in DRAFTERS)
    s = " / ".join(fmt(r, f"{d}_sampled") for d in DRAFTERS)
    out.append(f"| {r['step']} | {r['kl']:.4f} | {r['entropy']:.3f} | {r['accuracy']:.3f} | "
               f"{r['length_p50']:.0f}/{r['length_p90']:.0f} | {r['spot_tokens']} | {g} | {s} |")
  out += ["", "| step | spot − frozen: greedy / T=1 | spot − ceiling: greedy / T=1 | "
          "spot / ceiling: greedy / T=1 | frozen's decay since step 0: greedy / T=1 | "
          "of it recovered by spot: greedy / T=1 |", "|" + "---|" * 6]
  pct = lambda x: "(no decay)" if x is None else f"{100 * x:.0f}%"
  for r, v in zip(rows[1:], verdicts(rows)):
    sf = " / ".join(f"{r[f'spot_minus_frozen_{k}']:+.2f}±{r[f'spot_minus_frozen_{k}_se']:.2f}"
                    for k in ("greedy", "sampled"))
    sc = " / ".join(f"{r[f'spot_minus_ceiling_{k}']:+.2f}±{r[f'spot_minus_ceiling_{k}_se']:.2f}"
                    for k in ("greedy", "sampled"))
    oc = " / ".join(f"{v[f'spot_over_ceiling_{k}']:.2f}" for k in ("greedy", "sampled"))
    dec = " / ".join(f"{v[f'decay_{k}']:.2f}±{v[f'decay_{k}_se']:.2f}"
                     for k in ("greedy", "sampled"))
    rec = " / ".join(pct(v[f"recovered_{k}"]) for k in ("greedy", "sampled"))
    out.append(f"| {r['step']} | {sf} | {sc} | {oc} | {dec} | {rec} |")
  return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = [r["step"] for r in rows]
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, kind in zip(axes, ("greedy", "sampled")):
    for d, c in zip(DRAFTERS, ("tab:gray", "tab:blue", "tab:green")):
      ax.errorbar(steps, [r[f"{d}_{kind}"] for r in rows],
                  yerr=[r[f"{d}_{kind}_se"] for r in rows], color=c, marker="o", capsize=3,
                  label=d)
    ax.set_xlabel("RL step")
    ax.set_ylabel("tokens per verification, chain 4_1_5 "
                  f"({'greedy' if kind == 'greedy' else 'T=1'})")
    kl = ax.twinx()
    kl.plot(steps, [r["kl"] for r in rows], color="tab:red", ls="--", label="KL")
    kl.set_ylabel("KL(pi_t || pi_0) per token", color="tab:red")
    ax.legend(loc="lower left")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
