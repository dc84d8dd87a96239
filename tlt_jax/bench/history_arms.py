"""History drafts, drafter drafts and both under one bandit, in the RL regime
(scripts/bench_history_arms.py prints what `run` measures).

Workloads: GRPO groups sampled at temperature 1 with EOS, on the default model and its
shipped drafter or on the memory-bound bench target (scripts/make_bench_model.py):
- "batch 1": each group's samples decoded one at a time (max_batch 1), so each sees its
  finished siblings: the long tail's last row of a group.
- "batch 8": groups of 8 samples decoded 8 rows at a time (finished rows refilled from the
  next group), siblings in lockstep.
- "long tail": every prompt's samples admitted at once; speculation at <= `threshold` live
  rows, as in training.
Each workload runs `epochs` epochs over the same prompts (seed = epoch): epoch 1 starts from an
empty index, later ones find the earlier epochs' answers in it, as later RL steps do (the index
lives with the rollout worker). Configurations run interleaved per epoch, each with its own
index (and the bandit its own state, kept across epochs): plain decoding, drafter arms, history
arms, the hybrid, and a bucketed epsilon-greedy bandit over all kinds and "off" (a bandit per
live-batch bucket, the default buckets' bounds: a chunk's reward is its rows' tokens/s each,
comparable only between chunks of about the same live batch). The bandit
first decodes the workload untimed with a scratch index until it is past its exploration
phase (every arm measured `min_pulls` times in the buckets holding 90% of its chunks), at
most `bandit_warmup` times: its state after some RL steps (a workload of this size gives it a
few chunks per epoch, all exploration otherwise). One untimed
epoch per configuration with a throwaway index compiles the executables first; a compile inside
a timed epoch is subtracted from its time (a new attention window, a new prefill shape).
Configurations run in the listed order in odd epochs and reversed in even ones (this
machine's speed drifts over minutes: in a fixed order the last one paid for it, 10% in one
drift-heavy run). Reported per workload and epoch: tokens/s, speedup vs plain, tokens per
verification of the speculative chunks, and for the bandit the share of tokens per arm kind
and its speed against the fastest fixed arm.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any

import jax

from tlt_jax.bench.bench_model import load_target
from tlt_jax.rollout.config import EngineConfig, SpecConfig
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.sources.history import HistoryIndex
from tlt_jax.rollout.policies.cells import PolicyCells, Selector, make_selector
from tlt_jax.rollout.policies.mab import bandit_config, default_mab_buckets
from tlt_jax.rollout.records import Request, by_kind, tokens_per_verification
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.scheduler import buckets_upto
from tlt_jax.rollout.policies.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class Args:
  """scripts/bench_history_arms.py's flags (help text there) of the same names."""
  bench: str | None = None
  drafter_arms: str = "4_1_5"
  history_arms: str = "hist_4,hist_8"
  hybrid_arms: str = "hyb_4"
  bandit: bool = True
  bandit_warmup: int = 12
  min_pulls: int = 5
  workloads: str = "batch1,batch8,tail"
  prompts: int = 4
  samples: int = 8
  tail_prompts: int = 8
  tail_samples: int = 4
  threshold: int = 8
  epochs: int = 2
  max_new_tokens: int = 256
  temperature: float = 1.0


def workloads(args: Args, prompts) -> dict[str, tuple[list[Request], int, int]]:
  """name -> (requests, max_batch, speculation threshold)."""
  group = lambda n, s: [Request(prompts[i], request_id=i, sample_index=j)
                        for i in range(n) for j in range(s)]
  tail = args.tail_prompts * args.tail_samples
  every = {"batch1": (group(args.prompts, args.samples), 1, 1),
           "batch8": (group(args.prompts, 8), 8, 8),
           "tail": (group(args.tail_prompts, args.tail_samples), tail, args.threshold)}
  names = [w for w in args.workloads.split(",") if w]
  unknown = sorted(set(names) - set(every))
  if unknown:
    raise ValueError(f"--workloads {args.workloads}: unknown {unknown}; use "
                     f"{', '.join(every)}")
  return {w: every[w] for w in names}


def configurations(args: Args) -> dict[str, tuple[Any, bool]]:
  """label -> (selector factory or None for plain decoding, needs a history index)."""
  split = lambda s: [a for a in s.split(",") if a]
  drafter, history, hybrid = split(args.drafter_arms), split(args.history_arms), split(
      args.hybrid_arms)
  for a in drafter + history + hybrid:
    Strategy(a)  # a bad arm name fails before anything loads
  out: dict[str, tuple[Any, bool]] = {"plain": (None, False)}
  for a in drafter + history + hybrid:
    out[a] = (lambda a=a: make_selector("fixed", strategy=a), Strategy(a).history)
  every = drafter + history + hybrid
  if args.bandit and len(every) > 1:
    # one bandit per live-batch bucket, the default's bounds: a chunk's reward (tokens/s a
    # row) is comparable only between chunks of about the same live batch
    bounds = sorted(default_mab_buckets())
    out["bandit"] = (lambda: make_selector("beg", {lo: every + ["off"] for lo in bounds},
                                           seed=0, min_pulls=args.min_pulls),
                     bool(history or hybrid))
  return out


def explored(sel: Selector, share: float = 0.9) -> bool:
  """Whether the buckets holding `share` of the bandit's chunks have measured every arm
  `min_pulls` times (past the exploration rounds: choosing greedily, and by epsilon)."""
  pulls = sel.state.state_dict()["pulls"].values()
  total = sum(sum(d.values()) for d in pulls)
  done = sum(sum(d.values()) for d in pulls if min(d.values()) >= sel.cfg.min_pulls)
  return total > 0 and done >= share * total


def measure(args: Args, cfg, params, dparams, stop, reqs, max_batch: int, threshold: int,
            log=print) -> dict[str, list[dict]]:
  """One workload: every configuration, epoch by epoch, interleaved. -> label -> [per epoch:
  tokens, seconds, tokens/s, tokens per verification, by kind]."""
  confs = configurations(args)
  arms = sorted({a for a in (args.drafter_arms + "," + args.history_arms + ","
                             + args.hybrid_arms).split(",") if a})
  sp = SamplingParams(temperature=args.temperature)
  max_prompt = -(-max(len(r.prompt_ids) for r in reqs) // 16) * 16

  def engine(spec: SpecConfig | None) -> Engine:
    ecfg = EngineConfig(max_batch=max_batch, buckets=buckets_upto(max_batch), chunk_size=16,
                        max_prompt_len=max_prompt, max_new_tokens=args.max_new_tokens,
                        stop_tokens=stop, spec=spec)
    # (every configuration's arms: each call brings its own selector)
    return Engine(params, cfg, ecfg, drafter_params=dparams if spec else None,
                  bandit=bandit_config("eg", arms + ["off"]) if spec else None,
                  history=HistoryIndex() if spec else None)

  plain = engine(None)
  spec = engine(SpecConfig(strategy=arms[0], bs_threshold=threshold, patience=1,
                           use_kernel=jax.default_backend() == "gpu",
                           max_steps=max(Strategy(a).steps for a in arms)))
  selectors = {label: make() for label, (make, _) in confs.items() if make}
  indexes = {label: HistoryIndex() if hist else None for label, (_, hist) in confs.items()}

  def one(label: str, seed: int, index) -> dict:
    w = plain if confs[label][0] is None else spec
    if w is spec:
      w.history = index
    w.chunk_log.clear()
    compiled = sum(r.seconds for r in w.compile_log)
    t0 = time.perf_counter()
    res = w.generate(reqs, sp, seed=seed, policies=PolicyCells(selectors.get(label)))
    dt = time.perf_counter() - t0 - (sum(r.seconds for r in w.compile_log) - compiled)
    tokens = sum(r.num_tokens for r in res)
    chunks = [c for c in w.chunk_log if c.mode != "plain"]
    rewards: dict[str, list[float]] = {}  # what the selector was told, per arm
    for c in chunks:
      if not (c.compiled or c.first_run):
        rewards.setdefault(c.arm, []).append(c.row_speed)
    sel = selectors.get(label)
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / max(dt, 1e-9),
            "tokens_per_verify": tokens_per_verification(chunks),
            "by_kind": by_kind(chunks, sum(c.tokens for c in chunks)),
            "chunk_rewards": {a: {"median": statistics.median(r), "n": len(r)}
                              for a, r in sorted(rewards.items())},
            # the bandit's arm values per bucket after this pass (None: not measured)
            "values": {lo: sel.values(lo) for lo in sel.buckets}
            if sel is not None and sel.cfg.rule != "fixed" else None}

  t0 = time.perf_counter()
  for label, (make, hist) in confs.items():  # compiles; the bandit tries every arm
    one(label, 10_000, HistoryIndex() if hist else None)
  selectors = {label: make() for label, (make, _) in confs.items() if make}  # fresh state
  if "bandit" in confs:  # experience, as after some RL steps; its own index starts empty
    scratch, passes = HistoryIndex(), 0
    while passes < args.bandit_warmup and not explored(selectors["bandit"]):
      one("bandit", 20_000 + passes, scratch)
      passes += 1
    log(f"  (bandit: {passes} warm-up passes)")
  log(f"  (compiled in {time.perf_counter() - t0:.0f} s)")
  out: dict[str, list[dict]] = {label: [] for label in confs}
  for epoch in range(args.epochs):
    # this machine's speed drifts by minutes: a configuration's position in the epoch
    # alternates (forward, then reversed), so a steady drift cancels over each pair of epochs
    for label in list(confs)[::1 if epoch % 2 == 0 else -1]:
      r = one(label, epoch, indexes[label])
      out[label].append(r)
      log(f"  epoch {epoch + 1} {label}: {r['tokens']} tokens, {r['tokens_per_s']:.1f} tokens/s"
          + (f", {r['tokens_per_verify']:.2f} tokens/verification"
             if r["tokens_per_verify"] else ""))
  return out


def bandit_vs_best(res: dict[str, list[dict]]) -> tuple[str, list[float], float]:
  """The bandit against the fastest fixed arm over the whole run (the highest geometric mean
  of tokens/s over epochs; plain decoding is not an arm, the bandit's "off" is): (that arm,
  the bandit's tokens/s / that arm's per epoch, the ratio of their geometric means). Against each
  epoch's fastest arm instead, the noise's maximum would count against the bandit."""
  gmean = lambda rs: statistics.geometric_mean(r["tokens_per_s"] for r in rs)
  best = max((label for label in res if label not in ("plain", "bandit")),
             key=lambda label: gmean(res[label]))
  per_epoch = [b["tokens_per_s"] / f["tokens_per_s"] for b, f in zip(res["bandit"], res[best])]
  return best, per_epoch, gmean(res["bandit"]) / gmean(res[best])


def table(name: str, res: dict[str, list[dict]]) -> str:
  """A markdown table: a row per configuration, per epoch tokens/s, speedup vs plain, tokens
  per verification; the bandit's share of tokens by kind."""
  epochs = len(res["plain"])
  head = "| engine | " + " | ".join(
      f"epoch {e + 1} tokens/s | speedup | tokens/verif." for e in range(epochs)) + " |"
  lines = [f"### {name}", "", head, "|---|" + "---:|" * (3 * epochs)]
  for label, rs in res.items():
    cells = []
    for e, r in enumerate(rs):
      base = res["plain"][e]["tokens_per_s"]
      tpv = r["tokens_per_verify"]
      cells += [f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / base:.2f}x",
                "-" if tpv is None else f"{tpv:.2f}"]
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  if "bandit" in res:
    best, per_epoch, overall = bandit_vs_best(res)
    lines += ["", f"bandit / the fastest fixed arm ({best}): " + ", ".join(
        f"epoch {e + 1} {r:.2f}x" for e, r in enumerate(per_epoch))
        + f"; over the run (geometric means) {overall:.2f}x"]
    shares = []
    for e, r in enumerate(res["bandit"]):
      shares.append(f"epoch {e + 1}: " + ", ".join(
          f"{kind} {k['share_of_tokens']:.0%}" for kind, k in sorted(r["by_kind"].items())))
    lines += ["", "bandit's speculative tokens by kind: " + "; ".join(shares)]
    fixed = {label: rs[-1]["chunk_rewards"].get(label) for label, rs in res.items()
             if label not in ("plain", "bandit")}
    lines += ["", "each fixed arm's median chunk reward (tokens/s a row, last epoch): " + ", ".join(
        f"{a} {r['median']:.1f}" for a, r in fixed.items() if r)]
    last = res["bandit"][-1]["values"] or {}
    lines += ["", "bandit's arm values (median chunk reward, tokens/s a row) at the end, per "
              "bucket: " + "; ".join(f"{lo}: " + ", ".join(f"{a} {v:.1f}" for a, v in vals.items()
                                                  if v is not None)
                          for lo, vals in last.items() if any(v is not None
                                                              for v in vals.values()))]
  return "\n".join(lines)


def run(args: Args, log=print) -> dict[str, Any]:
  """Every workload of `args`; logs progress and each table; returns the summary."""
  cfg, params, dparams, _, stop, prompts = load_target(args.bench or None)
  summary: dict[str, Any] = {
      "machine": f"{jax.devices()[0].device_kind} ({jax.default_backend()}), "
                 f"{os.cpu_count()} CPU cores, jax {jax.__version__}",
      "target": args.bench or "default model + shipped drafter", "args": dataclasses.asdict(args)}
  for name, (reqs, max_batch, threshold) in workloads(args, prompts).items():
    log(f"{name}: {len(reqs)} requests, max_batch {max_batch}, speculation at <= {threshold}")
    res = measure(args, cfg, params, dparams, stop, reqs, max_batch, threshold, log)
    summary[name] = res
    log("\n" + table(name, res) + "\n")
  return summary
