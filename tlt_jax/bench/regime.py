"""Speculative rollout where it can pay on this CPU: the memory-bound benchmark target.

The measurement of scripts/bench_regime.py (its docstring lists the sections, 0-6): `run`
prints each table as it is measured and returns (and writes to OUT/summary.json) the summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from tlt_jax.bench.bench_model import load_target, regime_report
from tlt_jax.bench.divergence import describe, explain
from tlt_jax.bench.roofline import roofline_section
from tlt_jax.bench.rollout import first_layer_assistant, hf_assisted, hf_generate, timed
from tlt_jax.bench.spec_costs import bounds, measure_costs
from tlt_jax.rollout.scheduler import buckets_upto

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class BenchMissing(FileNotFoundError):
  """--bench names no scripts/make_bench_model.py output."""


@dataclasses.dataclass(frozen=True)
class RegimeArgs:
  """The run's settings; scripts/bench_regime.py's flags (help text there) of the same names."""
  bench: str
  prompts: int = 6
  tail_prompts: int = 16
  tail_n: int = 4
  threshold: int = 8
  arms: str = "3_1_4,4_1_5,6_1_7,4_2_8"
  tail_arms: str = "4_1_5,6_1_7"
  max_new_tokens: int = 288
  gate_rollouts: int = 10
  gate_prompts: int = 4
  only_gate: bool = False
  only_roofline: bool = False
  skip_hf: bool = False
  skip_regime: bool = False
  skip_roofline: bool = False
  skip_tail: bool = False
  skip_costs: bool = False
  dtype: str | None = None
  out: str = os.path.join(ROOT, "out", "bench_regime")


def _write(out_dir: str, summary: dict) -> None:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)


def tail_split(res, threshold: int, r1, prefill_s: float) -> dict:
  """Where the long tail's time goes: chunks with more than `threshold` live rows (no
  speculation there), chunks at <= threshold (where it switches on), and the rest (host work
  between chunks). Prefills are dispatched asynchronously, so their time is inside the next
  chunk's; `prefill_s` (the same requests capped at one token: prefill + one step) says how
  much of the first phase it is. Amdahl's bound: the whole run's speedup if the <= threshold
  phase ran at the batch-1 greedy decode speedup of the best arm (optimistic: batch 1 is where
  drafts pay most)."""
  def split(chunks, dt):
    big = sum(c.wall_time for c in chunks if c.live > threshold)
    small = sum(c.wall_time for c in chunks if c.live <= threshold)
    return {"big": big, "small": small, "other": dt - big - small, "total": dt}

  parts = {label: split(r[6], r[1]) for label, r in res.items()}
  p = parts["plain"]
  best1 = max(v["decode_speedup"] for k, v in r1.items() if k != "plain")
  bound = p["total"] / (p["big"] + p["other"] + p["small"] / best1)
  print(f"\n### long tail: where the time goes (s; chunks at live > {threshold} / at <= "
        f"{threshold} / host work between chunks)\n\n| engine | live > {threshold} | "
        f"live <= {threshold} | other | total | live <= {threshold} phase vs plain |\n"
        "|---|---:|---:|---:|---:|---:|")
  for label, q in parts.items():
    print(f"| {label} | {q['big']:.1f} | {q['small']:.1f} | {q['other']:.1f} | "
          f"{q['total']:.1f} | {p['small'] / q['small'] if q['small'] else 0:.2f}x |")
  print(f"\nprefill + first step of the same requests alone: "
        f"{prefill_s:.1f} s ({prefill_s / p['total']:.0%} of plain's total, inside its live > "
        f"{threshold} column)")
  print(f"plain spends {p['small'] / p['total']:.0%} of the long tail at live <= {threshold}; "
        f"were that phase {best1:.2f}x faster (batch-1 greedy, best arm), the whole would be "
        f"{bound:.2f}x (Amdahl)")
  return {"parts": parts, "small_share": p["small"] / p["total"], "phase_speedup": best1,
          "amdahl_bound": bound, "prefill_s": prefill_s}


def roofline(args, params, cfg, prompts, max_prompt: int, greedy, sample) -> dict:
  """Section 0: how close each workload's plain decode step runs to the memory limit
  (tlt_jax/bench/roofline.py): copy bandwidth, then per workload the bytes a step moves
  (weights + the KV window the engine picks for its longest prompt + 32 decoded tokens) /
  step time at its batch: batch 1, batch 8 (greedy and sampled), the long tail at batch 1
  (where it speculates; at its full batch it is the batch-8 regime)."""
  longest = lambda n: max(len(p) for p in prompts[:n])
  return roofline_section(params, cfg, (
      ("batch 1, greedy", 1, greedy, longest(args.prompts)),
      ("batch 8, greedy", 8, greedy, longest(args.prompts)),
      ("batch 8, sampled", 8, sample, longest(args.prompts)),
      ("long tail, sampled", 1, sample, longest(args.tail_prompts))),
      cache_len=max_prompt + args.max_new_tokens)


def gate_rollouts(args, prompts, worker, make_selector, Request, sp) -> dict:
  """The speculation gate (tlt_jax/rollout/policies/gate.py) as a training run meets it:
  rollouts of --gate_prompts new prompts x --tail_n responses each (sampled, max batch 8),
  compile included, three workers interleaved rollout by rollout: plain; BEG-MAB behind the
  gate (one probe arm, buckets opened as they are measured to pay); BEG-MAB ungated (every
  bucket's arms compiled in the background from the first rollout). Prints the time per
  rollout, the gate's verdicts and when they came."""
  from tlt_jax.rollout.policies.cells import SpecGate
  from tlt_jax.rollout.policies.gate import GateConfig
  arms = args.tail_arms.split(",")

  def beg():
    return make_selector("beg", buckets={1: arms + ["off"], 3: arms + ["off"]}, seed=0)

  gate = SpecGate(GateConfig(min_chunks=2, lead=arms[0]))
  ws = {"plain": worker(8), "gated BEG": worker(8, selector=beg(), gate=gate, background=True),
        "ungated BEG": worker(8, selector=beg(), background=True)}
  times = {k: [] for k in ws}
  status = []
  print(f"\n### the speculation gate over {args.gate_rollouts} rollouts ({args.gate_prompts} "
        f"new prompts x {args.tail_n} responses each, sampled, max batch 8, compile "
        "included)\n\n| rollout | plain s | gated BEG s | ungated BEG s | gate after it |\n"
        "|---:|---:|---:|---:|---|", flush=True)
  for i in range(args.gate_rollouts):
    reqs = [Request(prompts[(i * args.gate_prompts + k) % len(prompts)], request_id=k,
                    sample_index=j) for k in range(args.gate_prompts) for j in range(args.tail_n)]
    for label, w in ws.items():
      t = time.perf_counter()
      w.generate(reqs, sp, seed=i, policies=w.cells)
      times[label].append(time.perf_counter() - t)
    mark = {"probing": "probing", "pays": "PAYS", "declined": "declined", "closed": "-"}
    st = " ".join(f"{b}:{mark[s]}" for b, s in gate.summary()["status"].items())
    status.append(gate.summary()["status"])
    print(f"| {i + 1} | {times['plain'][-1]:.1f} | {times['gated BEG'][-1]:.1f} | "
          f"{times['ungated BEG'][-1]:.1f} | {st} |", flush=True)
  half = args.gate_rollouts // 2
  ratio = {k: sum(times["plain"]) / sum(v) for k, v in times.items()}
  late = {k: sum(times["plain"][half:]) / sum(v[half:]) for k, v in times.items()
          if sum(v[half:]) > 0}
  print(f"\nspeedup vs plain, all rollouts: gated {ratio['gated BEG']:.2f}x, ungated "
        f"{ratio['ungated BEG']:.2f}x; last {args.gate_rollouts - half}: gated "
        f"{late.get('gated BEG', 0):.2f}x, ungated {late.get('ungated BEG', 0):.2f}x"
        "\ncompile s: "
        + ", ".join(f"{k} {w.compile_stats()['compile_seconds']:.0f}" for k, w in ws.items())
        + "\ngate decisions: " + json.dumps(gate.state.decisions))
  return {"times": times, "speedup": ratio, "speedup_late": late, "status": status,
          "decisions": list(gate.state.decisions),
          "compile_s": {k: w.compile_stats()["compile_seconds"] for k, w in ws.items()}}


def run(args: RegimeArgs) -> dict:
  """Every section of the benchmark (scripts/bench_regime.py's docstring), printed as it is
  measured; returns the summary, also written to args.out/summary.json. BenchMissing when
  args.bench holds no bench model."""
  model_dir, drafter_dir = (os.path.join(args.bench, x) for x in ("model", "drafter"))
  if not os.path.isfile(os.path.join(model_dir, "config.json")):
    raise BenchMissing(f"--bench {args.bench}: no model/config.json; build it first with "
                       f"python scripts/make_bench_model.py --out {args.bench}")

  import jax

  from tlt_jax.config import asset_path
  from tlt_jax.rollout.config import EngineConfig, SpecConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import Request, tokens_per_verification
  from tlt_jax.rollout.policies.cells import PolicyCells, make_selector
  from tlt_jax.rollout.sampling import SamplingParams

  arms = args.arms.split(",")
  summary: dict = {"machine": f"{jax.devices()[0].device_kind} ({jax.default_backend()}), "
                              f"{os.cpu_count()} CPU cores, jax {jax.__version__}",
                   "args": dataclasses.asdict(args)}
  if not (args.skip_regime or args.only_roofline):
    report = regime_report(args.bench, os.path.dirname(asset_path("default", "model")))
    print(report, flush=True)
    summary["regime"] = report

  cfg, params, dparams, tok, stop, prompts = load_target(args.bench, args.dtype)
  max_prompt = -(-max(len(p) for p in prompts) // 16) * 16
  greedy, sample = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)

  def worker(batch, arm=None, threshold=None, selector=None, gate=None, background=False):
    spec = None
    if arm or selector:
      spec = SpecConfig(strategy=arm or "4_1_5", bs_threshold=threshold or batch,
                        patience=1, background_compile=background)  # the kernel: GPU only
    ecfg = EngineConfig(max_batch=batch, buckets=buckets_upto(batch), chunk_size=16,
                        max_prompt_len=max_prompt, prompt_bucket=16,
                        max_new_tokens=args.max_new_tokens, stop_tokens=stop, spec=spec)
    e = Engine(params, cfg, ecfg, drafter_params=dparams if spec else None,
               bandit=selector.cfg if selector else None)
    e.cells = PolicyCells(selector, gate)  # its calls' policies, kept across them (`run`)
    return e

  def run(w, batches, sp):
    """Decodes each request batch (one generate call each) -> (tokens, seconds, outputs,
    tokens per verification, decode-only seconds, tokens delivered per verification: what a
    stop token cut from a verification's accepted drafts is not delivered, the chunk log)."""
    w.chunk_log.clear()
    out, ntok = {}, 0
    t = time.perf_counter()
    for i, reqs in enumerate(batches):
      for r in w.generate(reqs, sp, seed=i, policies=w.cells):
        out[(r.request_id, r.sample_index)] = list(r.response_ids)
        ntok += r.num_tokens
    dt = time.perf_counter() - t
    spec = [c for c in w.chunk_log if c.mode not in ("plain", "off")]
    ver = sum(c.verifications for c in spec)
    return (ntok, dt, out, tokens_per_verification(spec), sum(c.wall_time for c in w.chunk_log),
            sum(c.tokens for c in spec) / ver if ver else None, list(w.chunk_log))

  def compare(name, batch, batches, sp, variants):
    """variants: [(label, worker kwargs)]; the first is plain. Warm-up run each (compiles),
    then the timed runs in turn. Prints one table."""
    ws = {label: worker(batch, **kw) for label, kw in variants}
    compile_s = {}
    for label, w in ws.items():
      run(w, batches, sp)
      compile_s[label] = w.compile_stats()["compile_seconds"]
    res = {label: run(w, batches, sp) for label, w in ws.items()}
    base = res[variants[0][0]]
    print(f"\n### {name}\n\n| engine | tokens | tokens/s | speedup vs plain | decode-only "
          "speedup | tokens per verification | outputs = plain | compile s |\n"
          "|---|---:|---:|---:|---:|---:|---|---:|")
    rows_ = {}
    for label, (ntok, dt, out, acc, dec, delivered, _) in res.items():
      same = out == base[2] if sp.greedy else "(sampled)"
      cell, why = same, None
      if same is False:  # greedy and different: where, and is it a bf16 near-tie?
        try:
          why = explain(params, cfg, {(r.request_id, r.sample_index): r.prompt_ids
                                      for b in batches for r in b}, base[2], out)
          cell = describe(why, len(base[2]), cfg.dtype)
        except Exception as e:  # noqa: BLE001 (a failed check must not end the run)
          why = [{"error": f"{type(e).__name__}: {e}"}]
          cell = f"False (divergence check failed: {why[0]['error'][:200]})"
      rows_[label] = {"tokens": ntok, "tokens_per_s": ntok / dt, "speedup": base[1] / dt,
                      "decode_speedup": (base[4] / base[0]) / (dec / ntok), "accept": acc,
                      "delivered": delivered, "same": same, "divergence": why,
                      "compile_s": compile_s[label]}
      print(f"| {label} | {ntok} | {ntok / dt:.1f} | {base[1] / dt:.2f}x | "
            f"{(base[4] / base[0]) / (dec / ntok):.2f}x | "
            f"{acc if acc is None else round(acc, 2)} | {cell} | {compile_s[label]:.0f} |",
            flush=True)
    summary[name] = rows_
    _write(args.out, summary)  # as it goes: a time-boxed run keeps what it measured
    return rows_, res

  if not (args.only_gate or args.skip_roofline):
    summary["roofline"] = roofline(args, params, cfg, prompts, max_prompt, greedy, sample)
  if args.only_roofline:  # section 0 alone
    _write(args.out, summary)
    return summary

  if args.only_gate:  # section 6 alone
    summary["gate"] = gate_rollouts(args, prompts, worker, make_selector, Request, sample)
    _write(args.out, summary)
    return summary

  spec_variants = [("plain", {})] + [(f"SD {a}", {"arm": a}) for a in arms]
  b1 = [[Request(prompts[i], request_id=i)] for i in range(args.prompts)]
  r1, _ = compare("batch 1, greedy, default task (EOS)", 1, b1, greedy, spec_variants)
  b8 = [[Request(prompts[i], request_id=i, sample_index=j) for i in range(args.prompts)
         for j in range(8)][k:k + 8] for k in range(0, 8 * args.prompts, 8)]
  for sp, mode in ((greedy, "greedy"), (sample, "sampled")):
    compare(f"batch 8, {mode}, default task (EOS)", 8, b8, sp,
            [("plain", {}), (f"SD {arms[0]}", {"arm": arms[0]})])

  if not args.skip_tail:
    long_tail(args, prompts, compare, worker, run, summary, sample, r1, Request, make_selector)
  if not args.skip_costs:
    summary["cost_model"] = cost_section(args, params, dparams, cfg, arms, greedy, r1,
                                         max_prompt)

  if args.gate_rollouts:
    summary["gate"] = gate_rollouts(args, prompts, worker, make_selector, Request, sample)
  if not args.skip_hf:
    hf_section(args, model_dir, tok, stop, b1, params, cfg, arms, r1, summary)
  _write(args.out, summary)
  return summary


def long_tail(args, prompts, compare, worker, run, summary, sample, r1, Request, make_selector):
  """Section 4: one RL step's worth of sampled responses through one worker."""
  tail = [[Request(prompts[i], request_id=i, sample_index=j)
           for i in range(args.tail_prompts) for j in range(args.tail_n)]]
  big = args.tail_prompts * args.tail_n
  tail_arms = args.tail_arms.split(",")
  beg = lambda: make_selector("beg", buckets={1: tail_arms + ["off"], 3: tail_arms + ["off"]},
                              seed=0)
  tail_name = f"long tail: {big} responses (one RL step), sampled, SD at live <= {args.threshold}"
  _, tail_res = compare(tail_name, big, tail, sample,
                        [("plain", {})] + [(f"SD {a}", {"arm": a, "threshold": args.threshold})
                                           for a in tail_arms]
                        + [("SD BEG-MAB", {"selector": beg(), "threshold": args.threshold})])
  w = worker(big)  # prefill (+ the first decode step) alone: each response capped at 1 token
  first = [[Request(r.prompt_ids, r.request_id, r.sample_index, max_new_tokens=1)
            for r in tail[0]]]
  run(w, first, sample)
  prefill_s = run(w, first, sample)[1]
  summary["long tail split"] = tail_split(tail_res, args.threshold, r1, prefill_s)


def cost_section(args, params, dparams, cfg, arms, greedy, r1, max_prompt) -> dict:
  """Section 5: what the engine should reach at batch 1 from per-forward costs."""
  from tlt_jax.rollout.policies.strategy import Strategy
  costs = measure_costs(params, dparams, cfg, 1, arms, greedy, iters=10,
                        cache_len=max_prompt + args.max_new_tokens)
  print("\n### cost model, batch 1 greedy (per-forward costs in compiled loops, plain step = 1)"
        f"\n\nplain step {costs['plain step'] * 1e3:.1f} ms\n\n| arm | verify fwd | drafter "
        "step | whole spec step | tokens per verification (delivered) | should reach (decode) | "
        "reached (decode-only) | gap |\n|---|---:|---:|---:|---:|---:|---:|---:|")
  model = {}
  for a in arms:
    row = r1[f"SD {a}"]
    if not row["accept"]:
      continue
    bd = bounds(costs, a, row["delivered"])  # tokens a verification actually delivers
    st = Strategy(a)
    gap = 1 - row["decode_speedup"] / bd["measured"]
    model[a] = {**bd, "reached": row["decode_speedup"], "gap": gap}
    print(f"| {a} | {costs[f'verify fwd T={st.verify_tokens}'] / costs['plain step']:.2f} | "
          f"{bd['r']:.3f} | {bd['step_cost']:.2f} | {row['accept']:.2f} "
          f"({row['delivered']:.2f}) | "
          f"{bd['measured']:.2f}x | {row['decode_speedup']:.2f}x | {gap:+.0%} |")
  return model


def hf_section(args, model_dir, tok, stop, b1, params, cfg, arms, r1, summary) -> None:
  """HF transformers' generate and assisted generation on the same checkpoint, batch 1."""
  import tempfile

  import torch
  import transformers
  torch.set_num_threads(os.cpu_count() or 1)
  hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  pad = tok.pad_token_id if tok.pad_token_id is not None else 0
  ps = [b[0].prompt_ids for b in b1]
  with tempfile.TemporaryDirectory() as tmp:
    assistant = first_layer_assistant(params, cfg, model_dir, tmp)
    hf_assisted(hf, assistant, ps[:1], 4, sample=False, eos=list(stop), pad_id=pad)  # warm-up
    gen_tok, gen_dt = timed(lambda: sum(hf_generate(hf, [p], args.max_new_tokens,
                                                    sample=False, eos=list(stop), pad_id=pad)
                                        for p in ps))
    (as_tok, as_acc), as_dt = timed(lambda: hf_assisted(hf, assistant, ps,
                                                        args.max_new_tokens, sample=False,
                                                        eos=list(stop), pad_id=pad))
  best = max(arms, key=lambda a: r1[f"SD {a}"]["tokens_per_s"])
  ours = r1[f"SD {best}"]["tokens_per_s"]
  print(f"\n### peer: HF transformers on the same checkpoint, batch 1 greedy, the same "
        f"{len(ps)} prompts\n\n| engine | tokens/s | tokens per target forward |\n"
        "|---|---:|---:|\n"
        f"| tlt_jax plain | {r1['plain']['tokens_per_s']:.1f} | 1 |\n"
        f"| tlt_jax SD {best} | {ours:.1f} | {r1[f'SD {best}']['accept']:.2f} |\n"
        f"| HF generate | {gen_tok / gen_dt:.1f} | 1 |\n"
        f"| HF assisted (first-layer assistant) | {as_tok / as_dt:.1f} | {as_acc:.2f} |\n\n"
        f"tlt_jax SD / HF assisted: {ours / (as_tok / as_dt):.2f}x")
  summary["hf"] = {"generate": gen_tok / gen_dt, "assisted": as_tok / as_dt,
                   "assisted_accept": as_acc, "ours_best": ours, "best_arm": best}

