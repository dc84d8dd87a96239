#!/usr/bin/env python
"""The GPU checklist's headline table, from what its stages wrote (scripts/gpu_check.sh).

    python scripts/gpu_headline.py OUT        # OUT: gpu_check.sh's --out directory
    python scripts/gpu_headline.py --rl OUT   # the rl_steps stage's per-phase table

One markdown table, a row per figure the checklist exists for (../shared/GPU.md): decode's share
of copy bandwidth at batch 1, 8 and 64 (the engine on XLA's defaults, and the fastest variant,
scripts/gpu_decode.py), the speculative step's, the engine's paged attention's step against the
attention windows' with its difference from XLA's attention, SD vs plain end to end (batch 1 and
8, scripts/bench_regime.py), RL steps on one GPU TLT on vs off (the main job, python -m
tlt_jax.train, on the long-tail workload; each run's metrics.jsonl), the cost model's predicted
/ measured speculative step (scripts/bench_cost_model.py). A stage that wrote
nothing gives "not measured" with where to look.
"""

from __future__ import annotations

import glob
import json
import os
import sys


def _load(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def rl_runs(out: str) -> dict[str, list[dict]]:
  """The rl_steps stage's runs: mode -> its metrics.jsonl step records."""
  runs = {}
  for mode in ("on", "off"):
    path = os.path.join(out, "e2e", mode, "metrics.jsonl")
    if os.path.exists(path):
      with open(path) as f:
        runs[mode] = [r for r in map(_record, f) if r and "time" in r]
  return runs


def _record(line: str) -> dict | None:
  """One metrics.jsonl line, or None (blank, or torn: a run killed at its limit mid-write)."""
  try:
    r = json.loads(line)
  except ValueError:
    return None
  return r if isinstance(r, dict) else None


def phase_sums(records: list[dict]) -> dict[str, float]:
  """Seconds per phase summed over the steps (every key of the records' `time`)."""
  out: dict[str, float] = {}
  for r in records:
    for k, v in r["time"].items():
      out[k] = out.get(k, 0.0) + v
  return out


def tail(records: list[dict]) -> float:
  """The long tail's share of the rollout's chunk seconds (metrics' rollout_tail), averaged
  over the steps."""
  shares = [r["rollout_tail"]["time_share"] for r in records if "rollout_tail" in r]
  return sum(shares) / len(shares) if shares else float("nan")


def mismatch(records: list[dict]) -> tuple[float, float]:
  """The rollout's distance from the learner's distribution on its sampled tokens (metrics'
  loss.rollout_k3, a KL a token, and loss.rollout_prob_diff, the mean |p_old - p_rollout|:
  tlt_jax/rl/mismatch.py), averaged over the steps that updated; nan where none did."""
  got = [(r["loss"]["rollout_k3"], r["loss"]["rollout_prob_diff"]) for r in records
         if "rollout_k3" in (r.get("loss") or {})]
  if not got:
    return float("nan"), float("nan")
  return (sum(k for k, _ in got) / len(got), sum(p for _, p in got) / len(got))


def rl_table(out: str) -> str:
  """The rl_steps stage's table: per phase, seconds summed over the steps, TLT on and off. A
  mode cut off before its first step (its metrics.jsonl is opened at start-up, so it exists
  and holds no step) is named below the table, with no column."""
  runs = rl_runs(out)
  done = {m: r for m, r in runs.items() if r}
  if not done:
    return "no RL step finished" + (f" (started: {', '.join(f'TLT {m}' for m in runs)})"
                                    if runs else "")
  sums = {m: phase_sums(r) for m, r in done.items()}
  keys = list(dict.fromkeys(k for s in sums.values() for k in s))  # every mode's phases
  lines = ["| phase (s, summed over the steps) | " + " | ".join(
      f"TLT {m} ({len(done[m])} steps)" for m in sums) + " |",
           "|---|" + "---:|" * len(sums)]
  for k in keys:
    lines.append(f"| {k} | " + " | ".join(f"{sums[m].get(k, 0.0):.2f}" for m in sums) + " |")
  lines.append("| the tail's share of the rollout (after 90% of the responses finished) | "
               + " | ".join(f"{tail(done[m]):.0%}" for m in sums) + " |")
  last = [done[m][-1].get("response_length") or {} for m in sums]
  lines.append("| response length p50 / max (last step) | " + " | ".join(
      f"{r.get('p50', float('nan')):.0f} / {r.get('max', float('nan')):.0f}" for r in last)
      + " |")
  gaps = [mismatch(done[m]) for m in sums]
  lines.append("| the rollout's distribution vs the learner's: KL (k3) a token / mean abs. "
               "difference of the sampled token's probability | " + " | ".join(
                   f"{k:.1e} / {p:.1e}" for k, p in gaps) + " |")
  lines += [f"TLT {m}: no step finished" for m in runs if m not in done]
  return "\n".join(lines)


def rows(out: str) -> list[tuple[str, str, str]]:
  """(figure, value, source) rows, stage by stage: a stage whose output cannot be read (cut
  off mid-write, a field missing) gives one row saying so, and the other stages' rows stay."""
  res: list[tuple[str, str, str]] = []
  for stage, section in (("decode", _decode), ("bench_regime", _regime), ("rl_steps", _rl),
                         ("cost_model", _cost), ("learner", _learner)):
    try:
      res += section(out)
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
      res.append((f"{stage} figures", f"unreadable ({type(e).__name__}: {e})", stage))
  return res


def _decode(out: str) -> list[tuple[str, str, str]]:
  res: list[tuple[str, str, str]] = []
  dec = _load(os.path.join(out, "decode", "gpu_decode.json"))
  if dec:
    sets = dec.get("flag_sets", {})
    base = {c["batch"]: c for c in sets.get("default", {}).get("cells", [])
            if c.get("code", "").replace(" profile", "") == "engine" and "error" not in c}
    best = {int(b): c for b, c in dec.get("best", {}).items()}
    for b in (1, 8, 64):
      if b in base:
        line = f"engine {base[b]['fraction']:.0%} ({base[b]['step_s'] * 1e3:.2f} ms)"
        if b in best:
          c = best[b]
          line += (f"; best {c['fraction']:.0%} ({c['step_s'] * 1e3:.2f} ms: {c['flags']}, "
                   f"{c['code']})")
        res.append((f"plain decode, batch {b}: % of copy bandwidth", line, "decode"))
    spec = [(n, c) for n, g in sets.items() for c in g.get("cells", [])
            if "spec" in c.get("code", "") and "error" not in c]
    for n, c in spec:
      res.append((f"speculative step {c['code'].split()[-1]}, batch {c['batch']}: % of copy "
                  "bandwidth", f"{c['fraction']:.0%} ({c['step_s'] * 1e3:.2f} ms; {n}, "
                  f"{c['code']})", "decode"))
    for c in sets.get("default", {}).get("cells", []):  # the attention windows' plain cells
      if c.get("code") == "windows" and "error" not in c and c["batch"] in base:
        eng = base[c["batch"]]
        res.append((f"paged attention (the engine's), batch {c['batch']}: step vs the windows",
                    f"{c['step_s'] / eng['step_s']:.2f}x ({eng['step_s'] * 1e3:.2f} vs "
                    f"{c['step_s'] * 1e3:.2f} ms; > 1: paged faster), largest difference "
                    f"from XLA's attention {eng['paged_parity']:.1e}", "decode"))
  else:
    res.append(("decode % of copy bandwidth", "not measured", "decode"))
  return res


def _regime(out: str) -> list[tuple[str, str, str]]:
  res: list[tuple[str, str, str]] = []
  reg = _load(os.path.join(out, "bench_regime", "summary.json"))
  found = False
  for key, label in (("batch 1, greedy, default task (EOS)", "batch 1 greedy"),
                     ("batch 8, greedy, default task (EOS)", "batch 8 greedy"),
                     ("batch 8, sampled, default task (EOS)", "batch 8 sampled")):
    for arm, r in (reg or {}).get(key, {}).items():
      if arm == "plain":
        continue
      found = True
      why = r.get("divergence") or []  # greedy rows that differ (tlt_jax/bench/divergence.py)
      ties = (f" (near-ties: {sum(bool(d.get('near_tie')) for d in why)} of {len(why)} "
              "differing rows)" if why else "")
      if any("error" in d for d in why):
        ties = " (divergence check failed)"
      res.append((f"SD vs plain, {label}, {arm}",
                  f"{r['speedup']:.2f}x end to end, {r['decode_speedup']:.2f}x decode-only, "
                  f"{r['accept'] or 0:.2f} tokens/verification, outputs = plain: "
                  f"{r['same']}{ties}", "bench_regime"))
  if not found:
    res.append(("SD vs plain (batch 1, 8)", "not measured", "bench_regime"))
  return res


def _rl(out: str) -> list[tuple[str, str, str]]:
  res: list[tuple[str, str, str]] = []
  runs = rl_runs(out)
  if runs.get("on") and runs.get("off"):
    n = min(len(runs["on"]), len(runs["off"]))  # the steps both modes finished
    on, off = (phase_sums(runs[m][:n]) for m in ("on", "off"))
    res.append((f"RL steps on one device ({n} of configs/longtail.py on the bench target), "
                "TLT on / off",
                f"speedup {off['total'] / on['total']:.2f}x (on {on['total']:.1f} s, off "
                f"{off['total']:.1f} s; of which compiling {on.get('compile', 0):.1f} / "
                f"{off.get('compile', 0):.1f} s, rollout {on['rollout']:.1f} / "
                f"{off['rollout']:.1f} s; the tail's share of the rollout, TLT off: "
                f"{tail(runs['off'][:n]):.0%})",
                "rl_steps"))
    (k_on, p_on), (k_off, p_off) = mismatch(runs["on"][:n]), mismatch(runs["off"][:n])
    res.append(("the rollout's distribution vs the learner's, TLT on / off (KL a token, k3; "
                "mean abs. difference of the sampled token's probability)",
                f"{k_on:.1e} / {k_off:.1e}; {p_on:.1e} / {p_off:.1e}", "rl_steps"))
  else:
    res.append(("RL steps on one device, TLT on / off",
                "not measured" + (f" (steps done: on {len(runs.get('on', []))}, off "
                                  f"{len(runs.get('off', []))})" if runs else ""), "rl_steps"))
  for mode in ("on", "off"):  # the traced step (config.profile: tlt_jax/profiling.py)
    prof = _load(next(iter(sorted(glob.glob(os.path.join(
        out, "e2e", mode, "tb", "plugins", "profile", "*", "summary.json")))), ""))
    lines = sorted((prof or {}).get("lines", []), key=lambda ln: -ln["busy_s_per_step"])
    if lines:
      busiest = lines[0]
      res.append((f"the main job's step {prof['steps'][0]} traced, TLT {mode}: the busiest "
                  f"{'device stream' if prof['device_plane'] else 'host XLA thread'}'s "
                  "busy / wall",
                  f"{busiest['busy_s_per_step'] / prof['wall_s']:.0%} "
                  f"({busiest['busy_s_per_step']:.2f} of {prof['wall_s']:.2f} s; "
                  f"{busiest['line']}: {busiest['events_per_step']:.0f} events; top: "
                  + ", ".join(f"{n[:40]} {t:.2f} s" for n, t, _ in busiest["top"][:3]) + ")",
                  "rl_steps"))
  for mode in ("on", "off"):
    mem = next((r["memory"] for r in runs.get(mode, []) if r.get("memory")), None)
    if mem is None:
      continue
    plan = mem.get("plan_gib", {})
    res.append((f"device memory, the main job's first step, TLT {mode}: peak so far at each "
                "phase's end (the memory plan's figure)",
                ", ".join(f"{k} {v:.1f}" + (f" ({plan[k]:.1f})" if k in plan else "")
                          for k, v in mem["peak_gib"].items())
                + f" GiB of {mem['limit_gib']:.1f}", "rl_steps"))
  return res


def _cost(out: str) -> list[tuple[str, str, str]]:
  res: list[tuple[str, str, str]] = []
  cm = _load(os.path.join(out, "cost_model", "cost_model.json"))
  if cm and cm.get("ratios"):
    for r in cm["ratios"]:
      res.append((f"cost model: spec / plain step, batch {r['batch']}, {r['arm']}",
                  f"predicted {r['predicted']:.2f}, measured {r['measured']:.2f} "
                  f"(predicted / measured {r['predicted'] / r['measured']:.2f})", "cost_model"))
  else:
    res.append(("cost model predicted / measured", "not measured", "cost_model"))
  return res


def _learner(out: str) -> list[tuple[str, str, str]]:
  res: list[tuple[str, str, str]] = []
  lr = [r for r in _load(os.path.join(out, "learner", "learner.json")) or []
        if "skipped" not in r]
  for r in lr:
    name = f"learner step (packed update), attention {r['attention']}" + (
        f", LoRA rank {r['lora_rank']}" if r.get("lora_rank") else "")
    if "error" in r:  # the variant failed (a kernel that does not compile here, say)
      res.append((name, f"fails: {r['error'][:200]}", "learner"))
      continue
    pred = (f"; predicted {r['predicted_update_s']:.3f} s (predicted / measured "
            f"{r['predicted_update_s'] / r['update_s']:.2f})" if "predicted_update_s" in r
            else "")
    parity = (f"; old log-probs vs the other attention: max |diff| {r['parity_max_abs']:.1e}"
              if "parity_max_abs" in r and not r.get("lora_rank") else
              f"; old log-probs (B = 0) vs the full model's: max |diff| {r['parity_max_abs']:.1e}"
              if "parity_max_abs" in r else "")
    res.append((name, f"update {r['update_s']:.3f} s, log-probs {r['logprobs_s']:.3f} s"
                f"{pred}{parity}", "learner"))
    if "sync_s" in r:
      res.append((f"LoRA weight sync (rank {r['lora_rank']}): merge + rollout layout",
                  f"{r['sync_s']:.3f} s; working memory {r['sync_temp_layers']:.2f} layers in "
                  f"float32 (plan {r['sync_plan_layers']})", "learner"))
  if not lr:
    res.append(("learner step (packed update)", "not measured", "learner"))
  att = _load(os.path.join(out, "learner", "attention.json"))
  if att:
    done = {r["impl"]: r for r in att["results"] if "ms" in r}
    parts = [f"{i} {r['ms']:.2f} ms" for i, r in done.items()]
    parts += [f"{r['impl']} fails" for r in att["results"] if "error" in r]
    if "flash" in done:
      parts += [f"flash {done[o]['ms'] / done['flash']['ms']:.2f}x of {o}'s speed"
                for o in ("mha", "xla") if o in done]
      if att.get("predicted_ms"):  # the simulator's price of ours (its attn_eff)
        parts.append(f"the simulator's price of flash {att['predicted_ms']:.2f} ms (predicted /"
                     f" measured {att['predicted_ms'] / done['flash']['ms']:.2f})")
    res.append((f"packed attention fwd+bwd ({att['rows']} x {att['t']} tokens, "
                f"{att['heads']}/{att['kv_heads']} heads of {att['head_dim']})",
                f"{', '.join(parts)}; flash visits {att['visited_blocks']} of "
                f"{att['causal_blocks']} causal blocks", "learner"))
  else:
    res.append(("packed attention fwd+bwd", "not measured", "learner"))
  return res


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--rl"] and len(argv) == 2:
    print(rl_table(argv[1]))
    return 0
  if len(argv) != 1:
    print("usage: gpu_headline.py [--rl] OUT", file=sys.stderr)
    return 2
  print("| figure | measured | stage |\n|---|---|---|")
  for figure, value, stage in rows(argv[0]):
    print(f"| {figure} | {value} | {stage} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
