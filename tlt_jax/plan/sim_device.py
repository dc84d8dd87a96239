"""The simulated device of sim_engine.py's `SimEngine`: its decode state (`SimState` of `Row`s:
what each row has produced, not its tokens), executables keyed by name, batch and variant with
the clock time each costs (`SimExes`, `exe_key`), the page allocator a call gets (`SimKV`),
and the engine's own `CompilePlan` on that clock
(`SimCompilePlan`: the background compile thread as a queue the simulated clock drains, one
job at a time beside decoding). Only the seam is replaced: the plan's policies are
CompilePlan's (tests/test_plan_sim.py checks)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tlt_jax.rollout.compile_plan import CompilePlan
from tlt_jax.rollout.executables import CompileRecord, ExecKey
from tlt_jax.rollout.pages import PageAllocator
from tlt_jax.rollout.plan_call import PlanCall
from tlt_jax.rollout.policies.strategy import Strategy


@dataclasses.dataclass
class Row:
  key: Any
  target: int  # tokens this response will have (its drawn length, capped)
  produced: int = 0
  stopped: bool = False  # ended by a stop token (else by max_new_tokens)
  # tokens its next speculative step emits besides its own (a tracked row has no pending
  # token: the step samples one first)
  pending: int = 0
  prompt: int = 0  # its prompt's cache slots


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
  """The executables a simulated engine has compiled (keys), and the compile records. A key
  queued on the compile thread (`queue`) counts as compiled once the clock passes its end."""

  def __init__(self, clock):
    self.keys: set = set()
    self.due: dict = {}  # key -> simulated time its background compile ends
    self.records: list[CompileRecord] = []
    self._here = 0
    self._clock = clock

  def __contains__(self, key) -> bool:
    return key in self.keys or self.due.get(key, float("inf")) <= self._clock()

  def add(self, key: ExecKey, seconds: float, here: bool) -> None:
    self.keys.add(key)
    self.records.append(CompileRecord(key, key.shapes[0], seconds, None, seconds))
    self._here += here

  def queue(self, key: ExecKey, seconds: float, start: float) -> float:
    """A background compile of `key` from `start`: when it ends (now, if compiled)."""
    if key in self.keys:
      return start
    if key not in self.due:
      self.due[key] = start + seconds
      self.records.append(CompileRecord(key, key.shapes[0], seconds, None, seconds))
    return self.due[key]

  def take(self, key: ExecKey) -> float | None:
    """A queued `key` a chunk needs now (it waits for it: a compile in its time): when its
    compile ends; None if it is not queued."""
    due = self.due.pop(key, None)
    if due is not None:
      self.keys.add(key)
      self._here += 1
    return due

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
  """The compile plan's decisions (`choosable_pairs`, `ready`, `window`, `_window_pays`,
  `plain_ahead`) as they are; what compiles is a key with a price on the engine's clock.
  Background compiles (each bucket's arms over the whole cache, the windows and switch-offs
  the plan queues, the plain executables compiled ahead) finish one after another on a
  compile clock beside decoding."""

  def __init__(self, engine: Any, weight_bytes: int, slot_bytes: int):
    super().__init__(engine.cfg, engine.ecfg, engine.exes, None)
    self.engine = engine
    self.use_kernel = True  # (the verification kernel's path: a label only here)
    self._bytes = (weight_bytes, slot_bytes)
    self._due: dict = {}  # (sp, bucket, arm) -> the key of its background compile
    self._compile_free = 0.0  # when the compile thread is next free
    self._took: dict = {}  # key -> its compile's seconds (queued keys)
    self._urgent_job = False  # the job running now was submitted urgent
    self._urgent: set = set()  # the keys queued urgent
    self.share: SimShare | None = None  # the job's workers (sim.py)
    self._loads: set = set()  # keys loaded from another worker's compile (`SimShare`)

  _abstract = staticmethod(lambda state: state)

  def _spec_key(self, call, sp, arm, state, kv_len):
    return exe_key("spec", state.batch_size, Strategy(arm), kv_len)

  def arm_due(self, sp, bucket: int, arm: str) -> float:
    """When the background compile of `arm` at `bucket` ends (queued: `_queue_pairs`)."""
    return self.engine.exes.due[self._due[(sp, bucket, arm)]]

  def _mine(self) -> list:
    """(key, due) of what this compile clock compiles (not a load from another worker's)."""
    return [(k, t) for k, t in self.engine.exes.due.items() if k not in self._loads]

  def _queue(self, key: ExecKey, scale: float = 1.0, urgent: bool = False) -> float:
    """A compile on the thread's clock: after what is queued, or (urgent: CompilePlan._submit)
    once the compile running now and the urgent ones queued before it end (in the order they
    came), what had not started yet moving back by its time. Where another worker of the
    job compiles it first, a load of that compile (`SimShare`) instead."""
    e, seconds = self.engine, self.engine.compile_s * scale
    if key in e.exes or key in e.exes.due:
      return e.exes.due.get(key, e.now)
    start = max(self._compile_free, e.now)
    if urgent:
      start = max([e.now] + [t for k, t in self._mine() if t - self._took[k] <= e.now < t]
                  + [e.exes.due[k] for k in self._urgent if e.exes.due.get(k, 0.0) > e.now])
    end = self.share.ends(key, self, start) if self.share is not None else None
    if end is not None:
      return self._load(key, end)
    if urgent:
      self._urgent.add(key)
      e.exes.due.update([(k, t + seconds) for k, t in self._mine()
                         if t - self._took[k] >= start])
      self._compile_free = max(self._compile_free, start) + seconds
    self._took[key] = seconds
    due = e.exes.queue(key, seconds, start)
    self._compile_free = max(self._compile_free, due)
    if self.share is not None:
      self.share.started(key, self, start, due)
    return due

  def _load(self, key: ExecKey, end: float) -> float:
    """`key` loaded once another worker's compile of it ends (`end`), `SimShare.load_s` later
    (executables.port: a worker loads, it does not compile)."""
    e, load = self.engine, self.share.load_s
    self._loads.add(key)
    self._took[key] = load
    due = e.exes.due[key] = max(end, e.now) + load
    e.exes.records.append(CompileRecord(key, key.shapes[0], load, None, e.compile_s, True))
    return due

  def handover(self, key: ExecKey, end: float) -> None:
    """Another worker started queued `key` first (`SimShare.started`): it leaves this compile
    clock (what was queued after it moves up) and is loaded from that compile."""
    e = self.engine
    due, took = e.exes.due[key], self._took[key]
    e.exes.due.update([(k, t - took) for k, t in self._mine() if t > due])
    self._compile_free -= took
    del e.exes.due[key]
    e.exes.records = [r for r in e.exes.records if r.key != key]
    self._load(key, end)

  def borrow(self, key: ExecKey) -> float | None:
    """A chunk needs `key`, not queued here: when another worker's compile of it, started by
    now, ends and it is loaded (the chunk waits: sharing.compile_once); None: none is."""
    end = self.share.ends(key, self, self.engine.now) if self.share is not None else None
    if end is None:
      return None
    self._load(key, end)
    return self.engine.exes.take(key)

  def claim(self, key: ExecKey) -> float | None:
    """A chunk needs queued `key` now (as sharing.compile_once serves it): when its
    started compile (or the load of another worker's) ends (the chunk waits); None where it
    has not started (the chunk compiles it itself: it leaves the compile clock and what
    follows moves up)."""
    e = self.engine
    due, took = e.exes.due[key], self._took[key]
    if due - took <= e.now or key in self._loads:
      return e.exes.take(key)
    del e.exes.due[key]
    e.exes.records = [r for r in e.exes.records if r.key != key]
    e.exes.due.update([(k, t - took) for k, t in self._mine() if t > due])
    self._compile_free -= took
    return None

  def spec(self, call, sp, arm, state, kv_len=None):
    """(From the compile thread: a window a chunk needs, or an arm one wants.)"""
    self._queue(self._spec_key(call, sp, arm, state, kv_len or self.ecfg.cache_len),
                urgent=self._urgent_job)

  def _queue_pairs(self, call: PlanCall, sp, pairs, urgent: bool):
    self._thread(call)
    pairs = {b: [a for a in arms if (sp, b, str(a)) not in self._due]
             for b, arms in pairs.items()}
    pairs = {b: arms for b, arms in pairs.items() if arms}
    leaves_at = self.leaves_at(call, pairs)
    for b, arm in self.compile_order(pairs, call.bandit, call.selector):
      with self._lock:  # (handed to the thread, as the engine's submit records it)
        self._submitted.setdefault(sp, set()).add((b, arm))
      whole = SimState([None] * b)
      key = self._due[(sp, b, str(arm))] = self._spec_key(call, sp, arm, whole,
                                                          self.ecfg.cache_len)
      self._queue(key, urgent=urgent)
      if b == leaves_at:
        leaves_at = None
        self._queue(self._switch_off_key(call, whole), urgent=urgent)

  def _thread(self, call) -> None:
    if self._compiler is None:
      self._compiler = True  # (no thread: a job runs at once, its compiles queue: _submit)

  def _submit(self, job, urgent: bool = False) -> None:
    """A job runs now; what it compiles is queued on the compile clock (`_queue`), an urgent
    one (CompilePlan._submit) ahead of what has not started."""
    self._urgent_job = urgent
    try:
      job()
    finally:
      self._urgent_job = False

  def _run_urgent(self) -> None:
    """(Urgent compiles are ordered on the compile clock as they are queued: `_queue`.)"""

  def _plain_at(self, call, static, hidden: bool, kv_len: int, top, bucket: int) -> None:
    self._queue(exe_key("decode", bucket, kv_len, hidden))

  def _track_at(self, call, bucket: int) -> None:
    self._queue(exe_key("track", bucket), self.engine.drafter_compile, urgent=self._urgent_job)

  def _track_prompt_at(self, call, bucket: int, p: int) -> None:
    self._queue(exe_key("track_prompt", bucket, p), self.engine.drafter_compile,
                urgent=self._urgent_job)

  def _switch_off_key(self, call: PlanCall, state) -> ExecKey:
    return exe_key("switch_off", state.batch_size)

  def switch_off_ahead(self, call: PlanCall, state) -> None:
    if self.ecfg.spec.background_compile and self._compiler is not None:
      self._queue(self._switch_off_key(call, state), urgent=True)

  def _settle(self, sp) -> None:
    """The arms whose background compile has ended by now join the compiled ones."""
    if self.ecfg.spec.background_compile:
      with self._lock:
        done = self._ready.setdefault(sp, set())
        done.update((b, Strategy(a)) for (s, b, a), key in self._due.items()
                    if s == sp and key in self.engine.exes)

  def ready(self, call: PlanCall, sp, bucket: int) -> bool:
    self._settle(sp)
    return super().ready(call, sp, bucket)

  def compiled_arms(self, sp, bucket: int, arms) -> list[Strategy]:
    self._settle(sp)
    return super().compiled_arms(sp, bucket, arms)


class SimShare:
  """The rollout workers of a job: a program one of them compiles, the others load instead of
  compiling it again, as the engine's `sharing.compile_once` has it (the workers of a process;
  exchange.py: the processes of a multi-host run): a worker whose compile of a key would
  start after another's started (or is queued to) loads from it once it ends; one that starts
  first takes it over from a worker that has it queued and has not reached it yet. A load
  costs `load_s`."""

  def __init__(self, load_s: float):
    self.load_s = load_s
    self.plans: list[SimCompilePlan] = []

  def ends(self, key: ExecKey, me: SimCompilePlan, start: float) -> float | None:
    """When the earliest compile of `key` by another worker, starting at or before `start`,
    ends (one already compiled: -inf); None: no other worker starts it by then."""
    ends = []
    for p in self.plans:
      if p is me or key in p._loads:
        continue
      if key in p.engine.exes.keys:
        ends.append(float("-inf"))
      elif key in p.engine.exes.due and p.engine.exes.due[key] - p._took[key] <= start:
        ends.append(p.engine.exes.due[key])
    return min(ends, default=None)

  def started(self, key: ExecKey, me: SimCompilePlan, start: float, end: float) -> None:
    """`me` compiles `key` from `start`: workers that queued it to start later, and have not
    reached that moment on their own clocks, load it from this compile instead."""
    for p in self.plans:
      e = p.engine
      if (p is not me and key in e.exes.due and key not in p._loads
          and e.exes.due[key] - p._took[key] > max(start, e.now)):
        p.handover(key, end)
