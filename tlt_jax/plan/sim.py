"""The cluster simulator's RL steps: the project's own rollout loop (sim_engine.py's
`SimEngine`, the engine on a simulated device and clock) inside whole simulated steps.

`Simulation.step` runs one whole RL step: its rollouts (one; with grpo.filter_groups,
DAPO's dynamic sampling, step_rollouts.py's rule over groups that carry signal at a given
rate), each the coordinator's split of requests over workers (coordinator.split), each
worker's generate call on its own device clock (workers run side by
side, each on its own replica: simulated a chunk at a time in the order of their clocks,
turns.py, sharing the step's cells of the gate and the bandit as the process's workers share
a rollout's, so a verdict reaches the others at its moment; the states go from step to step
as the train state carries them), the barrier at the slowest worker, the
drafter trained in each worker's idle window (`spot_window`: the coordinator's rule, steps of
the drafter's cost until the barrier, the step in flight finished or dropped), the learner's
phases (log-probs, the update, the weight sync: learner.py's `learner_phases`), on a
`Timeline` driven by the simulated clock (the same record and plot as a run's).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from tlt_jax.coordinator.coordinator import split
from tlt_jax.coordinator.timeline import Timeline, WorkerState, concat_rollouts
from tlt_jax.models import ModelConfig
from tlt_jax.models.lora import num_adapter_params
from tlt_jax.plan import cost, turns
from tlt_jax.plan.learner import Layout, Learner, learner_phases, remat_mode
from tlt_jax.plan.sim_device import SimShare
from tlt_jax.plan.sim_engine import SimEngine
from tlt_jax.plan.workload import Acceptance, Lengths
from tlt_jax.rollout.records import EngineHooks, Request
from tlt_jax.rollout.policies.cells import PolicyCells


# -------------------------------------------------------------------------- the RL step
def spot_window(idle: float, step_s: float, on_barrier: str) -> tuple[int, float, float]:
  """A worker idle for `idle` seconds before the barrier, training the drafter in steps of
  `step_s` (the coordinator's `train_until`): (steps kept, seconds trained before the
  barrier, seconds past it on the critical path: the step in flight finished, or dropped)."""
  if idle <= 0 or step_s <= 0:
    return 0, 0.0, 0.0
  whole = int(idle // step_s)
  inflight = idle - whole * step_s > 0
  if on_barrier == "finish" and inflight:
    return whole + 1, idle, (whole + 1) * step_s - idle
  return whole, idle, 0.0


@dataclasses.dataclass
class StepResult:
  step: int
  phases: dict[str, float]  # seconds per phase (the step's wall time is their sum)
  per_worker: list[dict[str, Any]]
  live: list[tuple[float, int]]  # (seconds into the step, live rows over all workers)
  timeline: dict[str, Any]  # the step's Timeline.to_json (its rollouts', concat_rollouts)
  chunks: list[Any]
  preempted: int
  lengths: np.ndarray  # every response the step's rollouts drew
  spot: dict[str, Any]  # Timeline.summary() of the step (idle, trained, critical path)
  rollouts: int = 1  # (several with grpo.filter_groups)
  groups: int = 0  # the groups the learner trains on
  preempted_tokens: int = 0  # the tokens the preempted rows had (resumed from, not redone)

  @property
  def seconds(self) -> float:
    return sum(v for k, v in self.phases.items() if k not in ROLLOUT_PARTS)


# parts of the rollout phase, reported beside it (not added to the step)
ROLLOUT_PARTS = ("prefill", "bulk_decode", "tail_decode", "verification",
                 "drafter_tracking", "compile", "host", "idle", "drafter_training")


# a worker's load of an executable another compiled (port.py: a deserialization; from another
# process, exchange.py: a fetch from the coordinator before it), in compiles' time: an
# assumption until a GPU measures it
LOAD_SHARE = 1 / 30


class Simulation:
  """Workers, their shared gate and bandit, and the clock of a simulated run (`step`: one RL
  step)."""

  def __init__(self, spec, cfg: ModelConfig, hw: cost.Hardware, *, workers: int, tp: int,
               gpus: int, lengths: Lengths, acceptance: Acceptance, compile_s: float,
               seed: int = 0, prompt_tokens: int | None = None, signal: float = 1.0,
               jitter: float = 0.0):
    """signal: the share of groups whose rewards differ (grpo.filter_groups keeps them);
    jitter: the sigma of each chunk's log-normal time factor (SimEngine)."""
    self.spec, self.cfg, self.hw = spec, cfg, hw
    self.workers_n, self.tp, self.gpus = workers, tp, gpus
    self.lengths, self.seed, self.signal = lengths, seed, signal
    self._drawn = 0  # prompts drawn so far (each one distinct)
    self.ecfg = spec.engine_config((0,))
    self.tlt = spec.tlt
    # the bandit's and the gate's states between steps (a step's workers share them in cells)
    self.policies = spec.policies()
    bandit = self.policies.bandit.cfg if self.tlt else None
    self.engines = [SimEngine(cfg, self.ecfg, hw, worker_id=i, bandit=bandit,
                              acceptance=acceptance, tp=tp, compile_s=compile_s, seed=seed,
                              jitter=jitter)
                    for i in range(workers)]
    # the job's workers load what one of them compiled (of their process, or another's)
    share = SimShare(load_s=compile_s * LOAD_SHARE)
    for e in self.engines:
      e.compiles.share = share
      share.plans.append(e.compiles)
    self.prompt_tokens = prompt_tokens or max(self.ecfg.max_prompt_len // 2, 1)
    self.rng = np.random.default_rng(seed)
    g = spec.cfg.grpo
    self.num_prompts, self.group = int(g.num_prompts), int(g.n)
    self.learner = Learner(gpus, remat=remat_mode(cfg))
    self.adapters = 0 if spec.lora is None else num_adapter_params(cfg, spec.lora)  # LoRA's
    self.layout = Layout.of(spec.cfg, row_multiple=gpus,  # FSDP over every device
                            fused=self.learner.fused_attention)
    self.t = self._now = 0.0
    self.steps: list[StepResult] = []

  def _prompt(self, i: int) -> list[int]:
    """Prompt number i: `prompt_tokens` ids, distinct per i (a group's samples share it)."""
    v = max(self.cfg.vocab_size - 1, 2)
    ids = []
    for _ in range(self.prompt_tokens):
      ids.append(1 + i % v)
      i //= v
    return ids

  def drafter_step_s(self) -> float:
    """One spot-training step of the drafter on one replica: forward and backward (3 passes)
    over rows x row_len packed tokens."""
    if self.spec.buffer is None:
      return 0.0
    d = self.spec.cfg.tlt.drafter
    c = cost.draft(self.cfg, int(d.rows), int(d.row_len), int(d.row_len) // 2, tp=self.tp)
    return 3 * self.hw.seconds(c)

  def _rollout(self, k: int, reqs: list[Request], lens: np.ndarray, t0: float) -> dict[str, Any]:
    """One rollout of step k (index k) from `t0`: every worker's generate on its own clock,
    the barrier, spot training in the idle windows (the coordinator's rule), on a Timeline."""
    for e in self.engines:
      e.lengths = {r.key: int(lens[j]) for j, r in enumerate(reqs)}
    self._now = t0
    tl = Timeline(self.workers_n, clock=lambda: self._now)
    # spot training in each worker's idle window (the coordinator's rule), when wanted
    dstep = self.drafter_step_s()
    train = (dstep > 0 and self.spec.spot is not None and self.spec.spot.mode == "spot"
             and (self.policies.gate is None or self.policies.gate.drafter_wanted()))
    per, chunks, live = [], [], []
    cells = PolicyCells.of(self.policies)  # (the workers' calls share them, as in a run)
    before = [(len(e.chunk_log), e.preemptions, e.preempted_tokens) for e in self.engines]
    for e in self.engines:
      e.now = t0  # (each worker's replica decodes from the rollout's start)

    def call(e, share):  # one worker's generate, its chunks in turn by the clocks (turns.py)
      return lambda before_chunk: e.generate(share, self.spec.sampling, seed=k, policies=cells,
                                             hooks=EngineHooks(before_chunk=before_chunk))
    turns.run([call(e, share) for e, share in zip(self.engines, split(reqs, self.workers_n))],
              [lambda e=e: e.now for e in self.engines], t0)
    for i, e in enumerate(self.engines):
      self._now = t0
      tl.enter(i, WorkerState.GENERATING)
      (n, pre, pre_t) = before[i]
      new = e.chunk_log[n:]
      chunks += new
      live += [(m.t - m.wall_time, i, m.live) for m in new]
      live.append((e.now - t0, i, 0))
      per.append({"worker": i, "generating_s": e.now - t0, "chunks": len(new),
                  "preempted": e.preemptions - pre,
                  "preempted_tokens": e.preempted_tokens - pre_t})
      self._now = e.now
      tl.enter(i, WorkerState.TRAINING if train else WorkerState.IDLE)
    self.policies = cells.states()
    barrier = max(e.now for e in self.engines)
    self._now = barrier
    tl.mark_barrier()
    late = 0.0
    for i, e in enumerate(self.engines):
      idle = barrier - e.now
      steps, _, past = spot_window(idle, dstep, self.spec.spot.on_barrier) if train else (
          0, 0.0, 0.0)
      per[i].update(idle_s=idle, drafter_steps=steps)
      self._now = barrier + past
      tl.enter(i, WorkerState.DONE)
      late = max(late, past)
    self._now = barrier + late
    tl.mark_returned()
    tl.mark_released()
    tl.close()
    starts = [min(len(sh), self.ecfg.max_batch) for sh in split(reqs, self.workers_n)]
    return {"timeline": tl, "chunks": chunks, "live": live, "starts": starts, "per": per,
            "wall": barrier - t0, "late": late, "end": barrier + late}

  def step(self) -> StepResult:
    """One RL step: its rollouts (one; with grpo.filter_groups, DAPO's dynamic sampling, more
    while fewer than grpo.num_prompts groups carry signal, each group with probability
    `signal` independently of its lengths: step_rollouts.py's rule), then the learner on the
    groups that train."""
    k = len(self.steps)
    g = self.spec.cfg.grpo
    filtering = bool(g.get("filter_groups", False))
    rounds = int(g.max_rollouts) if filtering else 1
    draw = int(g.get("gen_prompts", 0) or self.num_prompts) if filtering else self.num_prompts
    busy0 = [dict(e.busy) for e in self.engines]
    t0 = start = self.t
    rolls, trained, drawn = [], [], []
    for _ in range(rounds):
      lens = self.lengths.draw(draw * self.group, self.ecfg.max_new_tokens, self.rng, step=k)
      first = self._drawn
      self._drawn += draw
      reqs = [Request(self._prompt(first + i), request_id=i, sample_index=s)
              for i in range(draw) for s in range(self.group)]
      r = self._rollout(k, reqs, lens, start)
      drawn.append(lens)
      rolls.append(r)
      start = r["end"]
      groups = lens.reshape(draw, self.group)  # (reqs: a prompt's samples side by side)
      trained += list(groups[self.rng.random(draw) < self.signal] if filtering else groups)
      if len(trained) >= self.num_prompts:
        break
    trained = trained[:self.num_prompts]
    spot, timeline = concat_rollouts([r["timeline"] for r in rolls])
    chunks = [c for r in rolls for c in r["chunks"]]
    per = [{**p, **{key: sum(r["per"][i][key] for r in rolls)
                    for key in ("generating_s", "chunks", "preempted", "preempted_tokens",
                                "idle_s",
                                "drafter_steps")}}
           for i, p in enumerate(rolls[0]["per"])]
    seq = [self.prompt_tokens + int(x) for group in trained for x in group]
    learner = (learner_phases(self.cfg, self.hw, self.learner, self.layout.shapes(seq, k),
                              reference=float(g.get("kl_coef", 0.0)) > 0,
                              epochs=self.layout.epochs, adapters=self.adapters) if seq else
               {"logprobs": 0.0, "update": 0.0, "weight_sync": 0.0})  # (no group: no update)
    parts = {k2: sum(e.busy[k2] - b[k2] for e, b in zip(self.engines, busy0)) / self.workers_n
             for k2 in ("prefill", "drafter_tracking", "compile", "host")}
    bulk, tail, verify = _decode_split(chunks)
    w = self.workers_n
    late = sum(r["late"] for r in rolls)
    phases = {"rollout": sum(r["wall"] for r in rolls), "drafter": late, **learner,
              "prefill": parts["prefill"], "bulk_decode": bulk / w, "tail_decode": tail / w,
              "verification": verify / w, "drafter_tracking": parts["drafter_tracking"],
              "compile": parts["compile"], "host": parts["host"], "idle": spot["idle_s"] / w,
              "drafter_training": spot["training_s"] / w}
    self.t = start + learner["logprobs"] + learner["update"] + learner["weight_sync"]
    live = [(t + r["timeline"].t0 - t0, i, n) for r in rolls for t, i, n in r["live"]]
    res = StepResult(k + 1, phases, per, live_batch(live, rolls[0]["starts"]), timeline,
                     chunks, sum(p["preempted"] for p in per), np.concatenate(drawn), spot,
                     len(rolls), len(trained), sum(p["preempted_tokens"] for p in per))
    self.steps.append(res)
    return res


def live_batch(events: Sequence[tuple[float, int, int]], start: Sequence[int]
               ) -> list[tuple[float, int]]:
  """(time, live rows summed over workers) at every chunk start of any worker, from
  (time, worker, live) events, `start` each worker's rows before its first chunk (a worker
  that finished counts 0 from its end event on)."""
  now = list(start)
  out = []
  for t, w, n in sorted(events):
    now[w] = n
    out.append((t, sum(now)))
  return out


def _decode_split(chunks) -> tuple[float, float, float]:
  """Seconds of plain chunks at each worker's first bucket (the bulk: the batch as it
  started), plain chunks below it (the tail: the batch compacted as rows finished) and
  speculative chunks, summed over workers."""
  top = {}
  for m in chunks:
    top.setdefault(m.worker_id, m.bucket)
  bulk = sum(m.wall_time for m in chunks if m.arm is None and m.bucket >= top[m.worker_id])
  tail = sum(m.wall_time for m in chunks if m.arm is None and m.bucket < top[m.worker_id])
  spec = sum(m.wall_time for m in chunks if m.arm is not None)
  return bulk, tail, spec
