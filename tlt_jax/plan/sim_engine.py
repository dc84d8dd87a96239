"""The cluster simulator's device: the project's own rollout loop on a simulated device and
clock.

`SimEngine` is the rollout `Engine` with its device seam replaced (replica.py: `_apply`,
`_switch_off`, `_decode`, `_sync`, `_call`, `kv`, `exes`, `compiles`, `clock`): every chunk goes
through the engine's own `generate` / `_chunk` / `_page` / `_collect` / `_report`, so the
Scheduler (admission in order, refill, compaction, the speculation threshold and patience),
the page policy (admission by free pages, preemption of the youngest rows: pages.py), the
speculation gate (gate.py: probes, verdicts, the payoff rule pricing compiles), the bandit
(mab.py) and the attention-window rule (windows.py's `window`, `_window_pays`) decide
exactly as they do on devices. Nothing of them is copied here; a test runs the real engine and
the simulator on the same response lengths and compares every chunk.

What the device would do is priced by the cost model (cost.py) on a hardware profile:
  prefill      the distinct prompts of the rows (padded as prefill.py pads them); a
               preempted row's resume: a target forward per max_prompt_len of its tokens so
               far (and the drafter's over them in a tracked call)
  plain chunk  chunk_size decode steps at the bucket, attending over the chunk's window (with
               rollout.attention='paged': each row's live slots, mid-chunk); in a
               tracked call (one that may speculate) one drafter forward over the chunk's
               tokens besides ("drafter_tracking", inside the chunk's time)
  spec chunk   chunk_size verifications: the target over the arm's verify tokens, the
               drafter's catch-up over steps + 1 and steps - 1 more drafter steps of topk
               (`cost.spec_step`); each row's accepted drafts drawn per verification from
               the workload's acceptance (workload.py)
  switch-off   the drafter's catch-up and one target step over the whole cache
  host         the profile's `chunk_s` per chunk (dispatch, sync, the loop's own work) and
               `op_s` per layout operation (prefill, refill, resize)
  compile      `compile_s` per executable the first time it runs (0: a warm persistent
               cache; a drafter-only one, the tracking's, by its layers: 2 / (layers + 1));
               background compiles (SpecConfig.background_compile: each bucket's
               arms, and the attention windows and switch-offs the compile plan
               queues; rollout.compile_ahead: the plain executables of the buckets
               below a batch's) finish `compile_s` after they are queued, one at a time,
               beside decoding; a chunk that needs one still queued waits for it
Rows end at their drawn length (a stop token) or at max_new_tokens (truncated).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from tlt_jax.kernels.paged_attention import kernel_limits
from tlt_jax.models import ModelConfig
from tlt_jax.models.config import DTYPE_BYTES
from tlt_jax.plan import cost
from tlt_jax.plan.sim_device import Row, SimCompilePlan, SimExes, SimKV, SimState, exe_key
from tlt_jax.plan.workload import Acceptance
from tlt_jax.rollout import decode
from tlt_jax.rollout.plan_call import PlanCall
from tlt_jax.rollout.engine import Engine, engine_arms
from tlt_jax.rollout.executables import ExecKey
from tlt_jax.rollout.pages import share_prompts
from tlt_jax.rollout.prefill import prefill_rows, prompt_len, resume_chunks, to_feed
from tlt_jax.rollout.records import Request
from tlt_jax.rollout.sampling import plain_variant
from tlt_jax.rollout.scheduler import Prefill, Refill, Resize
from tlt_jax.rollout.policies.strategy import Strategy


class SimEngine(Engine):
  """One rollout worker on a simulated device (module docstring). `lengths`: request key ->
  its response length; `hw`: the profile; `tp`: the replica's tensor-parallel degree;
  `compile_s`: seconds per executable compiled (0: a warm cache); `jitter`: each chunk's
  device time x a log-normal factor of mean 1 and this sigma (a real device's measured
  chunks vary; 0: none), drawn apart from the acceptance's draws so the two modes and the
  same seed see the same drafts."""

  def __init__(self, cfg: ModelConfig, ecfg, hw: cost.Hardware, *, worker_id: int = 0,
               bandit: Any = None, acceptance: Acceptance | None = None, tp: int = 1,
               compile_s: float = 0.0, seed: int = 0, jitter: float = 0.0):
    # paged attention as a GPU replica resolves it where the kernel's check passes
    # (EngineConfig.resolve_attention): "auto" within the kernel's limits (Triton's blocks;
    # a tensor-parallel replica runs it per device), else the windows
    paged = (ecfg.paged_attention if ecfg.paged_attention is not None
             else kernel_limits(cfg.head_dim_, ecfg.page_size) is None)
    ecfg = dataclasses.replace(ecfg, paged_attention=paged)
    self.cfg, self.ecfg, self.worker_id = cfg, ecfg, worker_id
    self.hw, self.tp, self.compile_s = hw, tp, compile_s
    self.acceptance = acceptance or Acceptance()
    self.lengths: dict[Any, int] = {}
    self.rng = np.random.default_rng(seed * 1009 + worker_id)
    self.jitter = jitter
    self._jitter_rng = np.random.default_rng([seed, worker_id, 7])
    spec = ecfg.spec
    self.bandit, self.arms = engine_arms(spec, bandit)
    self.history = None
    self.params = self.drafter_params = None
    self._ran: set = set()
    self.kv = SimKV(ecfg)
    self.exes = SimExes(self.clock)
    self._compiles_reported = 0
    self.chunk_log = []
    self.preemptions = 0
    self.preempted_tokens = 0
    self.now = 0.0  # this device's clock
    self.busy = {"prefill": 0.0, "decode": 0.0, "verify": 0.0, "drafter_tracking": 0.0,
                 "compile": 0.0, "host": 0.0}
    nb = DTYPE_BYTES[cfg.dtype]
    slot = (cfg.num_layers + 1) * 2 * cfg.num_kv_heads * cfg.head_dim_ * nb
    weights = cost.forward(cfg, 1, 1, 0, tp=tp).bytes
    self.compiles = SimCompilePlan(self, weights, slot)
    # a drafter-only executable (the fc and one layer; a target's has num_layers and the
    # head): XLA's compile time grows with the program, priced by its layers
    self.drafter_compile = 2.0 / (cfg.num_layers + 1)

  # the clock the loop reads
  def clock(self) -> float:  # (an instance's method: shadows Engine.clock)
    return self.now

  def _spend(self, what: str, seconds: float) -> None:
    self.now += seconds
    self.busy[what] += seconds

  def _compile(self, key: ExecKey, scale: float = 1.0) -> None:
    """A chunk needs `key` now: compiled in the foreground (`compile_s` x `scale`), or waited
    for where the compile thread is compiling it (`SimCompilePlan.claim`)."""
    if key in self.exes:
      return
    due = self.compiles.claim(key) if key in self.exes.due else self.compiles.borrow(key)
    if due is None:
      self.exes.add(key, self.compile_s * scale, True)
    self._spend("compile", self.compile_s * scale if due is None else due - self.now)

  def _seconds(self, c: cost.Cost) -> float:
    return self.hw.seconds(c)

  def _noise(self) -> float:
    """A chunk's factor on its device time: log-normal, mean 1, sigma `jitter`."""
    if not self.jitter:
      return 1.0
    s = self.jitter
    return float(np.exp(self._jitter_rng.normal(0.0, s) - s * s / 2))

  # the device seam (engine.py)
  def _plan(self, gate: Any = None, selector: Any = None) -> PlanCall:
    return PlanCall(self.worker_id, None, None, self.bandit, gate, None, selector)

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
    starts = None
    if any(r.key in c.adopting for r in reqs):  # (Replica._adopt: no prefill)
      starts = c.adopt(reqs)
      self._compile(exe_key("adopt", op.bucket), 0.0)  # (no model in them)
      if warm:
        self._compile(exe_key("adopt_track", op.bucket), 0.0)
    else:
      if prefill_rows(reqs, op.bucket, self.ecfg) < op.bucket:  # a group's rows hold its pages
        share_prompts(c.pages, reqs)
      self._prefill(reqs, op.bucket, warm)
      if self.ecfg.spec is not None and not warm:  # (Replica._prefill's record)
        key = (op.bucket, prompt_len(reqs, self.ecfg))
        c.untracked_prefills.setdefault(key, key)
    done = [c.done(r) for r in reqs]
    self._resume(reqs, *to_feed(reqs, c.outputs, starts), op.bucket, warm)
    # a speculative prefill leaves no pending token: a first speculative step samples one
    new = [Row(r.key, self.lengths[r.key], produced=n, pending=int(warm),
               prompt=len(r.prompt_ids)) for r, n in zip(reqs, done)]
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
    rows = prefill_rows(reqs, bucket, self.ecfg)
    self._compile(exe_key("prefill", bucket, p))
    c = cost.prefill(self.cfg, rows, p, tp=self.tp)
    if warm:  # a tracked call's: the drafter's over the prompts (a drafter-only executable)
      self._compile(exe_key("track_prompt", bucket, p), self.drafter_compile)
      c = c + cost.draft(self.cfg, rows, p, max(p // 2, 1), tp=self.tp)
    self._spend("prefill", self._seconds(c))

  def _resume(self, reqs: Sequence[Request], texts, prompt, bucket: int, warm: bool) -> None:
    """The price of feeding new rows what their prefill did not give them (Replica._resume):
    per forward of `resume_chunks` (a prefill's width of their texts, the last one narrower),
    the target over it at the bucket (and in a tracked call the drafter's over its pairs),
    attending to the rows' text so far."""
    # what the rows hold before: their prompts less what is fed of them
    text = sum(len(r.prompt_ids) - p for r, p in zip(reqs, prompt)) // max(len(reqs), 1)
    for tokens, _, _ in resume_chunks(texts, prompt, bucket, self.ecfg):
      width = tokens.shape[1]
      self._compile(exe_key("extend", bucket, width))
      c = cost.forward(self.cfg, bucket, width, text + width // 2, tp=self.tp, live=len(reqs))
      if warm:
        self._compile(exe_key("resume_track", bucket, width), self.drafter_compile)
        c = c + cost.draft(self.cfg, bucket, width, self.ecfg.cache_len, tp=self.tp)
      self._spend("prefill", self._seconds(c))
      text += width

  def _switch_off(self, state, c):
    # the drafter's catch-up and one target step over the whole cache; the rows are tracked
    # again (no pending token: a next speculative step samples one first)
    b, m = state.batch_size, self.compiles.max_steps(c.plan) + 1
    self._compile(exe_key("switch_off", b))
    live = sum(r is not None for r in state.rows)
    fwd = (cost.forward(self.cfg, b, 1, self.ecfg.cache_len, tp=self.tp, live=live)
           + cost.draft(self.cfg, b, m, self.ecfg.cache_len, tp=self.tp))
    self._spend("drafter_tracking", self._seconds(fwd))
    for row in state.rows:
      if row is not None:
        row.pending = 1
    return state

  def _decode(self, state, c, arm: Strategy | None, kv_len: int):
    ecfg, b, n = self.ecfg, state.batch_size, self.ecfg.chunk_size
    first = False
    read = kv_len  # the KV slots a step reads per row: the window's
    # the rows still decoding: the others (empty, finished) route to no expert and read no
    # page (models/transformer.py's `forward`, given them as not live)
    going = [r for r in state.rows if r is not None and r.produced < r.target]
    live = len(going)
    if ecfg.paged_attention:  # each live row's own slots, mid-chunk
      read = max(1, -(-sum(r.prompt + r.produced + n // 2 for r in going) // b))
    if arm is None:
      hidden = c.capture or ecfg.spec is not None
      self._compile(exe_key("decode", b, kv_len, hidden))
      self.compiles.plain_ahead(c.plan, plain_variant(c.sp), hidden, kv_len, state)
      step = cost.forward(self.cfg, b, 1, read, tp=self.tp, live=live)
      per = np.ones((b, n), np.int64)
      what = "decode"
    else:
      key = exe_key("spec", b, arm, kv_len)
      self._compile(key)
      first = key not in self._ran
      self._ran.add(key)
      step = cost.spec_step(self.cfg, arm, b, read, tp=self.tp, live=live)
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
    self._spend(what, ran * self._seconds(step) * self._noise())
    if arm is None and state.spec:  # the drafter consumes the chunk's pairs (a drafter-only
      # executable per bucket, over the whole cache)
      self._compile(exe_key("track", b), self.drafter_compile)
      self._spend("drafter_tracking", self._seconds(cost.draft(self.cfg, b, n, ecfg.cache_len,
                                                               tp=self.tp)))
    out = decode.ChunkOutput(tokens=np.zeros(valid.shape, np.int32),
                             logprobs=np.zeros(valid.shape, np.float32), valid=valid,
                             hidden=None, steps=np.int32(ran))
    counts = (accepted, verifications) if arm is not None else (0, 0)
    return state, (out, done, stopped, counts), first


def _check_seam() -> None:
  """The simulator replaces the device seam only: the loop is the engine's (a test checks)."""
  for name in ("generate", "_chunk", "_page", "_collect", "_report", "_reach", "_feed_history"):
    assert getattr(SimEngine, name) is getattr(Engine, name), name
