"""The cluster simulator: the project's own rollout loop on a simulated device and clock.

`SimEngine` is the rollout `Engine` with its device seam replaced (engine.py: `_apply`,
`_switch_on`, `_decode`, `_sync`, `_call`, `kv`, `exes`, `compiles`, `clock`): every chunk goes
through the engine's own `generate` / `_chunk` / `_page` / `_collect` / `_report`, so the
Scheduler (admission in order, refill, compaction, the speculation threshold and patience),
the page policy (admission by free pages, preemption of the youngest rows: pages.py), the
speculation gate (gate.py: probes, verdicts, the payoff rule pricing compiles), the bandit
(mab.py) and the attention-window rule (compile_plan.py's `window`, `_window_pays`) decide
exactly as they do on devices. Nothing of them is copied here; a test runs the real engine and
the simulator on the same response lengths and compares every chunk.

What the device would do is priced by the cost model (cost.py) on a hardware profile:
  prefill      the distinct prompts of the rows (padded as prefill.py pads them)
  plain chunk  chunk_size decode steps at the bucket, attending over the chunk's window
  spec chunk   chunk_size verifications: the target over the arm's verify tokens, the
               drafter's catch-up over steps + 1 and steps - 1 more drafter steps of topk
               (`cost.spec_step`); each row's accepted drafts drawn per verification from
               the workload's acceptance (workload.py)
  switch-on    a forward of the target and the drafter over the rows' text so far
  host         the profile's `chunk_s` per chunk (dispatch, sync, the loop's own work) and
               `op_s` per layout operation (prefill, refill, resize)
  compile      `compile_s` per executable the first time it runs (0: a warm persistent
               cache); background compiles (each bucket's arms, SpecConfig.background_compile)
               finish `compile_s` after they are queued, one at a time, beside decoding
Rows end at their drawn length (a stop token) or at max_new_tokens (truncated).

`simulate` runs whole RL steps: the coordinator's split of requests over workers
(coordinator.split), each worker's generate call on its own device clock (workers run side by
side, each on its own replica: they are simulated one after the other and share the gate and
the bandit, as the process's workers do), the barrier at the slowest worker, the drafter
trained in each worker's idle window (`spot_window`: the coordinator's rule, steps of the
drafter's cost until the barrier, the step in flight finished or dropped), the learner's
phases (log-probs, the update, the weight sync: learner.py's `learner_phases`), on a `Timeline` driven by
the simulated clock (the same record and plot as a run's).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from tlt_jax.coordinator.coordinator import split
from tlt_jax.coordinator.timeline import Timeline, WorkerState
from tlt_jax.models import ModelConfig
from tlt_jax.plan import cost
from tlt_jax.plan.learner import Layout, Learner, learner_phases
from tlt_jax.plan.workload import Acceptance, Lengths
from tlt_jax.rollout import decode
from tlt_jax.rollout.compile_plan import CompilePlan, PlanCall
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.executables import CompileRecord, ExecKey
from tlt_jax.rollout.pages import PageAllocator
from tlt_jax.rollout.prefill import prompt_len
from tlt_jax.rollout.records import Request
from tlt_jax.rollout.scheduler import Prefill, Refill, Resize
from tlt_jax.rollout.policies.strategy import Strategy


# ----------------------------------------------------------------------------- the device
@dataclasses.dataclass
class Row:
  key: Any
  target: int  # tokens this response will have (its drawn length, capped)
  produced: int = 0
  stopped: bool = False  # ended by a stop token (else by max_new_tokens)
  pending: int = 0  # tokens its next speculative step emits besides its own (switch-on's)


class SimState:
  """A simulated decode state: its rows (None: an empty slot) and whether the drafter's
  state rides along (speculation switched on)."""

  def __init__(self, rows: list[Row | None], spec: bool = False):
    self.rows, self.spec = rows, spec

  @property
  def batch_size(self) -> int:
    return len(self.rows)


def exe_key(name: str, batch: int, *variant) -> ExecKey:
  """A simulated executable's key: its name, its variant (a spec chunk's arm first, as the
  engine's), its batch in place of the argument shapes."""
  return ExecKey(name, tuple(variant), (batch,))


class SimExes:
  """The executables a simulated engine has compiled (keys), and the compile records."""

  def __init__(self):
    self.keys: set = set()
    self.records: list[CompileRecord] = []
    self._here = 0

  def __contains__(self, key) -> bool:
    return key in self.keys

  def add(self, key: ExecKey, seconds: float, here: bool) -> None:
    self.keys.add(key)
    self.records.append(CompileRecord(key, key.shapes[0], seconds, None))
    self._here += here

  def compiled_here(self) -> int:
    return self._here

  def stats(self) -> dict[str, Any]:
    return {"executables": len(self.records),
            "compile_seconds": sum(r.seconds for r in self.records)}


class SimKV:
  """The page pool's host side only: the allocator is the engine's (pages.py)."""

  def __init__(self, ecfg):
    self.ecfg = ecfg

  def allocator(self) -> PageAllocator:
    e = self.ecfg
    return PageAllocator(e.pool_pages, e.page_size, e.row_pages)

  def table(self, pages, keys):
    return None

  def keep(self, state) -> None:
    pass


class SimCompilePlan(CompilePlan):
  """The compile plan's decisions (`choosable_pairs`, `ready`, `window`, `_window_pays`) as
  they are; what compiles is a key with a price on the engine's clock. Background compiles
  finish one after another on a compile clock beside decoding."""

  def __init__(self, engine: "SimEngine", weight_bytes: int, slot_bytes: int):
    super().__init__(engine.cfg, engine.ecfg, engine.exes, None)
    self.engine = engine
    self.use_kernel = True  # (the verification kernel's path: a label only here)
    self._bytes = (weight_bytes, slot_bytes)
    self._due: dict = {}  # (sp, bucket, arm) -> simulated time its background compile ends
    self._compile_free = 0.0  # when the compile thread is next free

  _abstract = staticmethod(lambda state: state)

  def _spec_key(self, call, sp, arm, state, kv_len):
    return exe_key("spec", state.batch_size, Strategy(arm), kv_len)

  def submit(self, call: PlanCall, sp, *_):
    e = self.engine
    for b, arms in self._wanted_pairs(call).items():
      for arm in arms:
        key = (sp, b, str(arm))
        if key in self._due:
          continue
        start = max(self._compile_free, e.now)
        self._compile_free = self._due[key] = start + e.compile_s
        e.exes.add(exe_key("spec", b, Strategy(arm), self.ecfg.cache_len), e.compile_s, False)
        e.exes.add(exe_key("switch_on", b, self.ecfg.cache_len), e.compile_s, False)

  def ready(self, call: PlanCall, sp, bucket: int) -> bool:
    if self.ecfg.spec.background_compile:
      now = self.engine.now
      with self._lock:
        done = self._ready.setdefault(sp, set())
        done.update((b, Strategy(a)) for (s, b, a), t in self._due.items()
                    if s == sp and t <= now)
    return super().ready(call, sp, bucket)

  def switch_length(self, call, state, need: int) -> int:
    return next(n for n in self.switch_lengths() if n >= need)


class SimEngine(Engine):
  """One rollout worker on a simulated device (module docstring). `lengths`: request key ->
  its response length; `hw`: the profile; `tp`: the replica's tensor-parallel degree;
  `compile_s`: seconds per executable compiled (0: a warm cache); `dcfg`: the drafter's
  model config (the target's with one layer)."""

  def __init__(self, cfg: ModelConfig, ecfg, hw: cost.Hardware, *, worker_id: int = 0,
               selector: Any = None, gate: Any = None, acceptance: Acceptance | None = None,
               tp: int = 1, compile_s: float = 0.0, seed: int = 0):
    from tlt_jax.rollout.policies.mab import make_selector
    self.cfg, self.ecfg, self.worker_id = cfg, ecfg, worker_id
    self.hw, self.tp, self.compile_s = hw, tp, compile_s
    self.acceptance = acceptance or Acceptance()
    self.lengths: dict[Any, int] = {}
    self.rng = np.random.default_rng(seed * 1009 + worker_id)
    spec = ecfg.spec
    self.selector = selector or (make_selector("fixed", strategy=spec.strategy) if spec else None)
    self.gate, self.history = gate, None
    self.params = self.drafter_params = None
    self._ran: set = set()
    self.kv = SimKV(ecfg)
    self.exes = SimExes()
    self._compiles_reported = 0
    self.chunk_log = []
    self.preemptions = 0
    self.now = 0.0  # this device's clock
    self.busy = {"prefill": 0.0, "decode": 0.0, "verify": 0.0, "switch_on": 0.0,
                 "compile": 0.0, "host": 0.0}
    nb = cost._BYTES[cfg.dtype]
    slot = (cfg.num_layers + 1) * 2 * cfg.num_kv_heads * cfg.head_dim_ * nb
    weights = cost.forward(cfg, 1, 1, 0, tp=tp).bytes
    self.compiles = SimCompilePlan(self, weights, slot)

  # the clock the loop reads
  def clock(self) -> float:  # (an instance's method: shadows Engine.clock)
    return self.now

  def _spend(self, what: str, seconds: float) -> None:
    self.now += seconds
    self.busy[what] += seconds

  def _compile(self, key: ExecKey) -> None:
    if key not in self.exes:
      self.exes.add(key, self.compile_s, True)
      self._spend("compile", self.compile_s)

  def _seconds(self, c: cost.Cost) -> float:
    return self.hw.seconds(c)

  # the device seam (engine.py)
  def _plan(self) -> PlanCall:
    return PlanCall(self.worker_id, None, None, self.selector, self.gate, None)

  def _sync(self, state):
    return state

  def _call(self, name, variant, fn, args, donate=()):
    # set_tables, once before each chunk (`_page`): the page tables are the allocator's; the
    # host's own work per chunk is priced here, outside the chunk's measured time as on devices
    self._spend("host", self.hw.chunk_s)
    return args[0]

  def _apply(self, op, state, c, warm: bool):
    self._spend("host", self.hw.op_s)
    if isinstance(op, Resize):
      rows = [state.rows[i] if v else None for i, v in zip(op.idx, op.valid)]
      return SimState(rows, state.spec)
    reqs = op.requests
    self._prefill(reqs, op.bucket, warm)
    # a speculative prefill leaves each row's first token pending, as switch-on does
    new = [Row(r.key, self.lengths[r.key], pending=int(warm)) for r in reqs]
    if isinstance(op, Prefill):
      return SimState(new + [None] * (op.bucket - len(reqs)), warm)
    if isinstance(op, Refill):
      rows = list(state.rows)
      for s, row in zip(op.slots, new):
        rows[s] = row
      return SimState(rows, state.spec)
    raise TypeError(f"unknown layout operation {op!r}")

  def _prefill(self, reqs: Sequence[Request], bucket: int, warm: bool) -> None:
    """A prefill's price: each distinct prompt once, padded as prefill.py pads them."""
    p = prompt_len(reqs, self.ecfg)
    distinct = len({tuple(r.prompt_ids) for r in reqs})
    u = self.ecfg.bucket_for(distinct)
    rows = u if u < bucket else bucket
    self._compile(exe_key("prefill_spec" if warm else "prefill", bucket, p))
    c = cost.prefill(self.cfg, rows, p, tp=self.tp)
    if warm:
      c = c + cost.draft(self.cfg, rows, p, max(p // 2, 1), tp=self.tp)
    self._spend("prefill", self._seconds(c))

  def _switch_on(self, state, c):
    if not self.compiles.ready(c.plan, c.sp, state.batch_size):
      return state, False
    seqs = [len(req.prompt_ids) + c.outputs[req.key].length
            for req in c.sched.slots[:state.batch_size] if req is not None]
    length = self.compiles.switch_length(c.plan, state, max(seqs, default=1))
    self._compile(exe_key("switch_on", state.batch_size, length))
    b = state.batch_size
    fwd = (cost.prefill(self.cfg, b, length, tp=self.tp)
           + cost.draft(self.cfg, b, length, max(length // 2, 1), tp=self.tp))
    self._spend("switch_on", self._seconds(fwd))
    for row in state.rows:  # the token the plain state had ready comes out with the first
      if row is not None:  # speculative step, beside the step's own
        row.pending = 1
    return SimState(list(state.rows), True), True

  def _decode(self, state, c, arm: Strategy | None, kv_len: int):
    ecfg, b, n = self.ecfg, state.batch_size, self.ecfg.chunk_size
    first = False
    if arm is None:
      self._compile(exe_key("decode", b, kv_len, c.capture))
      step = cost.forward(self.cfg, b, 1, kv_len, tp=self.tp)
      per = np.ones((b, n), np.int64)
      what = "decode"
    else:
      key = exe_key("spec", b, arm, kv_len)
      self._compile(key)
      first = key not in self._ran
      self._ran.add(key)
      step = cost.spec_step(self.cfg, arm, b, kv_len, tp=self.tp)
      per = self.acceptance.draw(arm, self.rng, (b, n)) + 1
      what = "verify"
    valid = np.zeros((b, n * int(per.max(initial=1)) + 1), bool)  # (+ a pending token)
    done = np.ones((b,), bool)
    stopped = np.zeros((b,), bool)
    accepted = verifications = ran = 0
    for i, row in enumerate(state.rows):
      if row is None or row.produced >= row.target:
        continue
      left = row.target - row.produced
      extra = row.pending if arm is not None else 0
      row.pending -= extra
      if extra >= left:  # its pending token ends it: one step, nothing verified
        steps, made, verified = 1, left, 0
      else:
        per[i, 0] += extra
        got = per[i].cumsum()
        steps = min(int(np.searchsorted(got, left)) + 1, n)  # steps until the row is done
        made = min(int(got[steps - 1]), left)
        verified = steps
      row.produced += made
      valid[i, :made] = True
      verifications += verified
      accepted += max(made - verified - extra, 0)
      ran = max(ran, steps)
      done[i] = row.produced >= row.target
      if done[i]:
        row.stopped = row.target < ecfg.max_new_tokens
        stopped[i] = row.stopped
    # the chunk's loop exits once every row is done (decode.py, speculative.py)
    self._spend(what, ran * self._seconds(step))
    out = decode.ChunkOutput(tokens=np.zeros(valid.shape, np.int32),
                             logprobs=np.zeros(valid.shape, np.float32), valid=valid,
                             hidden=None, steps=np.int32(ran))
    counts = (accepted, verifications) if arm is not None else (0, 0)
    return state, (out, done, stopped, counts), first


def _check_seam() -> None:
  """The simulator replaces the device seam only: the loop is the engine's (a test checks)."""
  for name in ("generate", "_chunk", "_page", "_collect", "_report", "_reach"):
    assert getattr(SimEngine, name) is getattr(Engine, name), name


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
  timeline: Timeline
  chunks: list[Any]
  preempted: int
  lengths: np.ndarray
  spot: dict[str, Any]  # Timeline.summary() of the step (idle, trained, critical path)

  @property
  def seconds(self) -> float:
    return sum(v for k, v in self.phases.items() if k not in ROLLOUT_PARTS)


# parts of the rollout phase, reported beside it (not added to the step)
ROLLOUT_PARTS = ("prefill", "bulk_decode", "tail_decode", "verification", "switch_on",
                 "compile", "host", "idle", "drafter_training")


class Simulation:
  """Workers, their shared gate and bandit, and the clock of a simulated run (`simulate`)."""

  def __init__(self, spec, cfg: ModelConfig, hw: cost.Hardware, *, workers: int, tp: int,
               gpus: int, lengths: Lengths, acceptance: Acceptance, compile_s: float,
               seed: int = 0, prompt_tokens: int | None = None):
    from tlt_jax.rollout.policies.gate import SpecGate
    self.spec, self.cfg, self.hw = spec, cfg, hw
    self.workers_n, self.tp, self.gpus = workers, tp, gpus
    self.lengths, self.seed = lengths, seed
    self.ecfg = spec.engine_config((0,))
    self.tlt = spec.tlt
    self.selector = spec.selector() if self.tlt else None
    self.gate = SpecGate(spec.gate) if (self.tlt and spec.gate is not None) else None
    self.engines = [SimEngine(cfg, self.ecfg, hw, worker_id=i, selector=self.selector,
                              gate=self.gate, acceptance=acceptance, tp=tp,
                              compile_s=compile_s, seed=seed) for i in range(workers)]
    self.prompt_tokens = prompt_tokens or max(self.ecfg.max_prompt_len // 2, 1)
    self.rng = np.random.default_rng(seed)
    g = spec.cfg.grpo
    self.num_prompts, self.group = int(g.num_prompts), int(g.n)
    self.learner = Learner(gpus)
    self.layout = Layout.of(spec.cfg, row_multiple=gpus)  # FSDP over every device
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

  def step(self) -> StepResult:
    k = len(self.steps)
    n = self.num_prompts * self.group
    lens = self.lengths.draw(n, self.ecfg.max_new_tokens, self.rng, step=k)
    reqs = [Request(self._prompt(k * self.num_prompts + i), request_id=i, sample_index=s)
            for i in range(self.num_prompts) for s in range(self.group)]
    for e in self.engines:
      e.lengths = {r.key: int(lens[j]) for j, r in enumerate(reqs)}
    sp = self.spec.sampling
    t0 = self.t
    self._now = t0
    tl = Timeline(self.workers_n, clock=lambda: self._now)
    # spot training in each worker's idle window (the coordinator's rule), when wanted
    dstep = self.drafter_step_s()
    train = (dstep > 0 and self.spec.spot is not None and self.spec.spot.mode == "spot"
             and (self.gate is None or self.gate.drafter_wanted()))
    per, chunks, live = [], [], []
    busy0 = [dict(e.busy) for e in self.engines]
    for i, (e, share) in enumerate(zip(self.engines, split(reqs, self.workers_n))):
      e.now = self._now = t0  # (each worker's replica decodes from the step's start)
      tl.enter(i, WorkerState.GENERATING)
      before, pre = len(e.chunk_log), e.preemptions
      e.generate(share, sp, seed=k)
      new = e.chunk_log[before:]
      chunks += new
      live += [(m.t - m.wall_time, i, m.live) for m in new]
      live.append((e.now - t0, i, 0))
      per.append({"worker": i, "generating_s": e.now - t0, "chunks": len(new),
                  "preempted": e.preemptions - pre})
      self._now = e.now
      tl.enter(i, WorkerState.TRAINING if train else WorkerState.IDLE)
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
    spot = tl.summary()
    seq = [self.prompt_tokens + int(x) for x in lens]
    learner = learner_phases(self.cfg, self.hw, self.learner, self.layout.shapes(seq, k),
                             reference=float(self.spec.cfg.grpo.get("kl_coef", 0.0)) > 0)
    parts = {k2: sum(e.busy[k2] - b[k2] for e, b in zip(self.engines, busy0)) / self.workers_n
             for k2 in ("prefill", "switch_on", "compile", "host")}
    bulk, tail, verify = _decode_split(chunks)
    w = self.workers_n
    phases = {"rollout": barrier - t0, "drafter": late, **learner,
              "prefill": parts["prefill"], "bulk_decode": bulk / w, "tail_decode": tail / w,
              "verification": verify / w, "switch_on": parts["switch_on"],
              "compile": parts["compile"], "host": parts["host"], "idle": spot["idle_s"] / w,
              "drafter_training": spot["training_s"] / w}
    self.t = barrier + late + learner["logprobs"] + learner["update"] + learner["weight_sync"]
    starts = [min(len(sh), self.ecfg.max_batch) for sh in split(reqs, w)]
    res = StepResult(k + 1, phases, per, live_batch(live, starts), tl, chunks,
                     sum(p["preempted"] for p in per), lens, spot)
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
