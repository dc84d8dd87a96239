"""`python -m tlt_jax.plan`'s work: a recipe simulated TLT on and off, and what it prints.

`plan` resolves the recipe as a run would (config.run_spec; rollout.max_batch = 0 sized by the
memory plan for the hardware and device count), then runs the same steps on the simulator
(sim.py) with TLT on and with TLT off, on the same response lengths.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from tlt_jax.errors import ConfigError
from tlt_jax.plan import cost
from tlt_jax.plan.sim import ROLLOUT_PARTS, Simulation, StepResult
from tlt_jax.plan.workload import Acceptance, Lengths

PHASES = ("rollout", "drafter", "logprobs", "update", "weight_sync")


@dataclasses.dataclass
class Plan:
  name: str
  hardware: cost.Hardware
  gpus: int
  workers: int
  tp: int
  max_batch: int
  kv_pages: int
  lengths: Lengths
  acceptance: Acceptance
  compile_s: float
  on: list[StepResult]
  off: list[StepResult]
  gate: dict[str, Any] | None
  executables: dict[str, Any]  # on, off: totals; per_worker: executables, compile seconds, by_kind
  gate_mode: str
  signal: float = 1.0  # the share of groups with signal (grpo.filter_groups)
  jitter: float = 0.0  # the sigma of each chunk's log-normal time factor (SimEngine)
  filtering: bool = False  # grpo.filter_groups

  @property
  def speedup(self) -> float:
    return self.off[-1].seconds / self.on[-1].seconds


def _mode(cfg, tlt: bool, gate: str):
  """The recipe with TLT on or off; gate "open": speculation at every bucket under the
  threshold from the first step (the steady state a long run's gate reaches where drafts
  pay), "learn": the gate as the recipe configures it, from nothing."""
  c = cfg.copy_and_resolve_references()
  c.tlt.enabled = tlt
  if tlt and gate == "open" and c.tlt.spec.get("gate") is not None:
    c.tlt.spec.gate.enabled = False
  return c


def cluster(cfg, *, hardware: str, gpus: int, gate: str):
  """The simulated cluster, its inputs checked (ConfigError naming the flag): (the hardware
  profile, the memory plan's device kind, devices, rollout workers, tensor parallel)."""
  hw = cost.profile(hardware)
  # the memory plan's device: the profile's kind, else the recipe's (a fitted profile's file)
  device = hardware if hardware in cost.PROFILES else (cfg.memory.get("device") or "h100")
  n = int(gpus or cfg.memory.get("num_devices", 0) or 0)
  if n < 1:
    raise ConfigError("name the cluster's devices: --gpus N (or config.memory.num_devices)",
                      "--gpus", gpus)
  tp = int(cfg.rollout.tensor_parallel)
  workers = int(cfg.rollout.num_workers) or max(n // tp, 1)  # 0: one per tp devices
  if workers * tp > n:
    raise ConfigError(f"{workers} rollout workers x tensor_parallel {tp} need {workers * tp} "
                      f"devices; set --gpus or config.rollout.num_workers", "--gpus", n)
  if gate not in ("open", "learn"):
    raise ConfigError("use open (speculation wherever the threshold allows) or learn (the "
                      "gate probes from nothing)", "--gate", gate)
  return hw, device, n, workers, tp


def simulate(cfg, tlt: bool, *, gate: str, hw: cost.Hardware, device: str, gpus: int,
             workers: int, tp: int, model_cfg, sized: tuple[int, int] | None, lengths: Lengths,
             acceptance: Acceptance, steps: int, compile_s: float, seed: int, signal: float,
             jitter: float = 0.0, progress: bool = False
             ) -> tuple[Simulation, tuple[int, int] | None]:
  """`steps` RL steps of the recipe with TLT on or off (`_mode`) on the simulator; with
  rollout.max_batch = 0 the memory plan sizes it, once (`sized`: TLT on's plan, its
  drafter's memory too, sizes both modes; returned for the next call)."""
  from tlt_jax import memory
  from tlt_jax.config import run_spec
  spec = run_spec(_mode(cfg, tlt, gate))
  if spec.max_batch == 0:
    if sized is None:
      sized = memory.derive_max_batch(run_spec(_mode(cfg, True, gate)), model_cfg,
                                      device=device, num_devices=gpus)
    spec = spec.with_max_batch(*sized)
  sim = Simulation(spec, model_cfg, hw, workers=workers, tp=tp, gpus=gpus, lengths=lengths,
                   acceptance=acceptance, compile_s=compile_s, seed=seed, signal=signal,
                   jitter=jitter)
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=steps, desc=f"simulating TLT {'on' if tlt else 'off'}", unit="step",
               leave=False)
  for _ in range(steps):
    sim.step()
    if bar is not None:
      bar.update(1)
  if bar is not None:
    bar.close()
  return sim, sized


def plan(cfg, *, hardware: str = "h100", gpus: int = 0, lengths: Lengths, acceptance: Acceptance,
         steps: int = 3, compile_s: float = 0.0, gate: str = "open", seed: int = 0,
         progress: bool = False, signal: float = 1.0, jitter: float = 0.0) -> Plan:
  """The recipe `cfg` simulated for `steps` RL steps, TLT on and off (module docstring);
  signal: the share of groups whose rewards differ (grpo.filter_groups reads it); jitter: the
  sigma of each chunk's log-normal time factor (0: none)."""
  from tlt_jax.runtime import model_config
  hw, device, n, workers, tp = cluster(cfg, hardware=hardware, gpus=gpus, gate=gate)
  model_cfg = model_config(cfg)
  sized = None
  runs = {}
  for mode in ("on", "off"):
    runs[mode], sized = simulate(cfg, mode == "on", gate=gate, hw=hw, device=device, gpus=n,
                                 workers=workers, tp=tp, model_cfg=model_cfg, sized=sized,
                                 lengths=lengths, acceptance=acceptance, steps=steps,
                                 compile_s=compile_s, seed=seed, signal=signal,
                                 jitter=jitter, progress=progress)
  on, off = runs["on"], runs["off"]
  gate_after = on.policies.gate  # (None: no gate)
  ex = {"on": sum(len(e.exes.records) for e in on.engines),
        "off": sum(len(e.exes.records) for e in off.engines),
        # per worker: executables and the seconds compiling them (foreground or not), in all
        # and by kind (the executable's name: decode, prefill, spec, track, switch_off, ...)
        "per_worker": {m: _per_worker([x for e in r.engines for x in e.exes.records],
                                      len(r.engines))
                       for m, r in (("on", on), ("off", off))}}
  return Plan(name=cfg.model.get("architecture") or cfg.model.path, hardware=hw, gpus=n,
              workers=workers, tp=tp, max_batch=on.ecfg.max_batch,
              kv_pages=on.ecfg.pool_pages, lengths=lengths, acceptance=acceptance,
              compile_s=compile_s, on=on.steps, off=off.steps,
              gate=gate_after.summary() if gate_after is not None else None, executables=ex,
              gate_mode=gate, signal=signal, filtering=bool(cfg.grpo.get("filter_groups")),
              jitter=jitter)


def _per_worker(records, workers: int) -> dict[str, Any]:
  """Executables and their compile seconds per worker, in all and by kind (`by_kind`)."""
  kinds: dict[str, list] = {}
  for x in records:
    kinds.setdefault(x.name, []).append(x.seconds)
  return {"executables": round(len(records) / workers, 1),
          # loaded from another worker's compile (sharing.py, exchange.py)
          "loaded": round(sum(x.ported for x in records) / workers, 1),
          "compile_s": round(sum(x.seconds for x in records) / workers, 1),
          "by_kind": {k: {"executables": round(len(v) / workers, 1),
                          "compile_s": round(sum(v) / workers, 1)}
                      for k, v in sorted(kinds.items())}}


def _live(s: StepResult) -> str:
  if not s.live:
    return "no chunks"
  peak = max(n for _, n in s.live)
  end = s.phases["rollout"]
  marks = []
  for frac in (0.5, 0.1):
    t = next((t for t, n in s.live if n <= peak * frac), None)
    if t is not None:
      marks.append(f"<= {frac:.0%} of it after {t:.0f} s ({t / end:.0%} of the rollout)")
  return f"peak {peak} rows; " + "; ".join(marks)


def text(p: Plan) -> str:
  on, off = p.on[-1], p.off[-1]
  lines = [
      f"# {p.name}: {p.gpus} x {p.hardware.name}, {p.workers} rollout workers x tp {p.tp}, "
      f"max_batch {p.max_batch}, {p.kv_pages} KV pages per worker (predictions)",
      f"lengths: {p.lengths.describe()}; this step mean {on.lengths.mean():.0f}, "
      f"p90 {int(sorted(on.lengths)[int(0.9 * (len(on.lengths) - 1))])}, "
      f"max {on.lengths.max()} tokens",
      f"acceptance: {p.acceptance.describe()}; compiles {p.compile_s:g} s each "
      f"({'cold' if p.compile_s else 'a warm cache'})"
      + (f"; each chunk's time x log-normal noise, sigma {p.jitter:g}" if p.jitter else ""),
      f"profile: {p.hardware.note or p.hardware.name}",
      "",
      f"step {on.step} of {len(p.on)} (the bandit and the gate learn over the earlier ones)",
      "| phase | TLT on s | TLT off s |", "|---|---:|---:|"]
  for k in PHASES:
    lines.append(f"| {k} | {on.phases[k]:.1f} | {off.phases[k]:.1f} |")
  lines.append(f"| **step** | **{on.seconds:.1f}** | **{off.seconds:.1f}** |")
  for k in ROLLOUT_PARTS:
    lines.append(f"| rollout: {k} (per worker) | {on.phases[k]:.1f} | {off.phases[k]:.1f} |")
  spot = on.spot
  share = spot.get("idle_share_trained")
  arms: dict[str, int] = {}
  for m in on.chunks:
    if m.arm is not None:
      arms[str(m.arm)] = arms.get(str(m.arm), 0) + 1
  lines += [
      "",
      f"TLT on vs off: {p.speedup:.2f}x the step, "
      f"{off.phases['rollout'] / on.phases['rollout']:.2f}x the rollout",
      f"live batch, TLT off: {_live(off)}",
      *([f"rollouts this step (grpo.filter_groups, {p.signal:.0%} of the groups with signal): "
         f"TLT on {on.rollouts}, off {off.rollouts}; over the run "
         f"{sum(s.rollouts for s in p.on)} rollouts in {len(p.on)} steps"] if p.filtering else []),
      f"rows preempted for pages: TLT on {on.preempted}, off {off.preempted} (the tokens they "
      f"had, resumed from: {on.preempted_tokens}, {off.preempted_tokens})",
      f"idle worker time {spot['idle_s']:.0f} s (all workers), "
      + (f"{share:.0%} of it training the drafter" if share is not None else "none"),
      f"speculative chunks per arm (TLT on): {arms or 'none'}",
      f"gate ({p.gate_mode}): {p.gate['status'] if p.gate else 'none'}",
      f"executables compiled over the run: TLT on {p.executables['on']}, "
      f"off {p.executables['off']}; per worker: TLT on "
      f"{p.executables['per_worker']['on']['executables']} "
      f"({p.executables['per_worker']['on']['loaded']:g} loaded from another worker's compile; "
      f"{p.executables['per_worker']['on']['compile_s']:.0f} s compiling or loading), off "
      f"{p.executables['per_worker']['off']['executables']} "
      f"({p.executables['per_worker']['off']['loaded']:g} loaded; "
      f"{p.executables['per_worker']['off']['compile_s']:.0f} s)"]
  for m in ("on", "off"):
    kinds = p.executables["per_worker"][m]["by_kind"]
    lines.append(f"  per worker by kind, TLT {m}: " + ", ".join(
        f"{k} {v['executables']:g} ({v['compile_s']:.0f} s)" for k, v in kinds.items()))
  return "\n".join(lines)


def to_json(p: Plan) -> dict[str, Any]:
  def step(s: StepResult) -> dict[str, Any]:
    return {"step": s.step, "seconds": s.seconds, "phases": s.phases,
            "per_worker": s.per_worker, "preempted": s.preempted, "spot": s.spot,
            "live": s.live, "timeline": s.timeline, "rollouts": s.rollouts,
            "groups": s.groups,
            "lengths": {"mean": float(s.lengths.mean()), "max": int(s.lengths.max())}}
  return {"model": p.name, "hardware": dataclasses.asdict(p.hardware), "gpus": p.gpus,
          "workers": p.workers, "tp": p.tp, "max_batch": p.max_batch, "kv_pages": p.kv_pages,
          "lengths": p.lengths.describe(), "acceptance": dict(p.acceptance.tpv),
          "acceptance_default": p.acceptance.default,
          "acceptance_rate": None if p.acceptance.default is not None else
          p.acceptance.draft_rate(),
          "acceptance_history": p.acceptance.history, "compile_s": p.compile_s,
          "jitter": p.jitter,
          "speedup": p.speedup, "gate": p.gate, "executables": p.executables,
          "signal": p.signal if p.filtering else None,
          "on": [step(s) for s in p.on], "off": [step(s) for s in p.off]}


def plots(p: Plan, out: str) -> None:
  """OUT/timeline.png (the last step's workers, TLT on and off) and OUT/live_batch.png."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from tlt_jax.coordinator.timeline import plot
  on, off = p.on[-1], p.off[-1]
  plot({1: on.timeline, 2: off.timeline},
       {1: {"spot": on.spot}, 2: {"spot": off.spot}}, [1, 2],
       os.path.join(out, "timeline.png"),
       time_label="predicted seconds since the rollout began",
       labels={1: f"TLT on, step {on.step}", 2: f"TLT off, step {off.step}"})
  fig, ax = plt.subplots(figsize=(9, 3.2))
  for s, label in ((on, "TLT on"), (off, "TLT off")):
    if s.live:
      t, n = zip(*s.live)
      ax.step(t, n, where="post", label=label)
  ax.set_xlabel("predicted seconds since the rollout began")
  ax.set_ylabel("live rows (all workers)")
  ax.set_title(f"{p.name}: live batch over the rollout, {p.gpus} x {p.hardware.name}",
               fontsize=9, loc="left")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "live_batch.png"), dpi=120)
  plt.close(fig)
