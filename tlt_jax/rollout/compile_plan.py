"""Which speculative executables one engine has, and when they get compiled (and, a part of
it, plain decoding's: plain_ahead.py).

Speculation needs one executable per (engine bucket, arm) pair, and a switch-off per bucket
where a gate may close a speculating batch's bucket (switching.py); a tracked call adds the
drafter's tracking after its plain prefills and chunks (one drafter-only executable per
bucket it decodes plainly at, `track_ahead`, and one per prefill shape). Only the pairs the
bandit can choose are wanted (`choosable_pairs`), and with a gate only those it opens to this
engine now. They compile on first use (a chunk then pays the compile and reports nothing to
the bandit), all at once (`precompile`), or on a background thread
(SpecConfig.background_compile: `submit` as a call starts and before each chunk, in
`compile_order`, up to the bucket of the call's request count; a bucket speculates once one
of its arms is compiled, `ready`, so no chunk waits for a compile: readiness.py). With a gate,
only each bucket's first arm compiles ahead; another when a chunk's policies ask for it
(`want`: the bandit exploring it, a probe measuring it), at the window its rows need: an
executable nobody runs is not compiled (the 7B recipe, gate open, 3 simulated steps: 395
speculative executables compiled ahead, 96 of them ever ran). A program another worker of the
process compiles now is put off and then loaded from that compile (sharing.compile_each).

Attention windows (`kv_len`) are a third grid, a speculative executable per (bucket, arm,
window): windows.py. A Pallas verification kernel that fails to compile falls back to its jnp
reference (same decisions) once, with a warning; `verify_path` says which ran.

The plan holds no reference to its engine: every call is given a `PlanCall`, the engine's
view at that moment (its worker id, its weights' shapes and shardings, its bandit's arms, the
call's gate, its page pools). Background compile jobs keep the view they were queued with
(abstract weights: no device memory is held by a queued job).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp

from tlt_jax.models import ModelConfig
from tlt_jax.rollout.executables import ExecKey, ExecutableCache, background_compiler
from tlt_jax.rollout.plain_ahead import PlainAhead
from tlt_jax.rollout.plan_call import Pairs, PlanCall, abstract, choosable_pairs, resized
from tlt_jax.rollout.prefill import prefill_arrays, run_prefill
from tlt_jax.rollout.records import Request
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.readiness import Readiness
from tlt_jax.rollout.sharing import Elsewhere, compile_each, deferring
from tlt_jax.rollout.switching import Switching
from tlt_jax.rollout.windows import Windows
from tlt_jax.rollout.policies.strategy import Strategy

_log = logging.getLogger(__name__)


class CompilePlan(Readiness, Switching, Windows, PlainAhead):
  """See the module docstring. Thread-safe where the compile thread meets the engine's."""

  def __init__(self, cfg: ModelConfig, ecfg, exes: ExecutableCache,
               replicated: jax.sharding.Sharding):
    self.cfg, self.ecfg, self.exes = cfg, ecfg, exes
    self._replicated = replicated
    spec = ecfg.spec
    # True / False: always the kernel / the reference; None (a GPU's default): the kernel
    # where it measured faster (kernels.verify.kernel_pays)
    self.use_kernel: bool | None = (
        False if spec is None else spec.use_kernel if spec.use_kernel is not None
        else (None if jax.default_backend() == "gpu" else False))
    self.kernel_error: str | None = None
    self._lock = threading.Lock()
    self._ready: dict[SamplingParams, set[tuple[int, str]]] = {}  # compiled (bucket, arm)
    self._submitted: dict[SamplingParams, set[tuple[int, str]]] = {}  # handed to the thread
    self._window_submitted: set[tuple[int, str, int]] = set()  # (bucket, arm, kv_len) queued
    self._off_ahead: set[int] = set()  # batch sizes whose switch-off is compiled or queued
    self._tracked: set[int] = set()  # buckets whose drafter's tracking is queued
    self._queued: set[ExecKey] = set()  # switch-offs queued (`_have`)
    self._plain_queued: set = set()  # (bucket, plain variant) queued (`plain_ahead`)
    self._needs: dict[tuple[int, str, int], int] = {}  # (bucket, arm, kv_len) -> chunks needing it
    self.rollouts = 0  # generate calls of the engine (`_window_pays`'s time base)
    self._bytes: tuple[int, int] | None = None  # (weight bytes, KV bytes per slot)
    self._compiler = None  # one compile thread per engine, started on first use
    self._urgent: collections.deque = collections.deque()  # windows running chunks need

  @property
  def verify_path(self) -> str:
    """Which verification ran: "pallas" (the kernel), "jnp" (its reference) or "auto" (the
    kernel where it measured faster, a GPU's default)."""
    return {True: "pallas", False: "jnp", None: "auto"}[self.use_kernel]

  def max_steps(self, call: PlanCall) -> int:
    """Catch-up capacity of the speculative state: room for every arm's drafts."""
    spec = self.ecfg.spec
    arms = call.bandit.arms if call.bandit is not None else []
    return max([spec.max_steps, spec.strategy.steps, 1] + [a.steps for a in arms])

  # ------------------------------------------------------------------------ which pairs
  def choosable_pairs(self, call: PlanCall) -> Pairs:
    """Engine bucket -> the arms the bandit can return there (`choosable_pairs`)."""
    return choosable_pairs(self.ecfg, call.bandit)

  def _wanted_pairs(self, call: PlanCall) -> Pairs:
    """Bucket -> the arms to compile there: the choosable ones, or with a gate those it
    opens to this engine now (all where speculation pays, the probed ones on probation)."""
    pairs, gate = self.choosable_pairs(call), call.gate
    if gate is None:
      return pairs
    return {b: arms for b in pairs if (arms := gate.arms(call.worker_id, b))}

  def compiled_arms(self, sp: SamplingParams, bucket: int, arms) -> list[Strategy]:
    """Those of `arms` whose executables at `bucket` are compiled (without background
    compilation: all, each compiles on first use)."""
    if not self.ecfg.spec.background_compile:
      return list(arms)
    with self._lock:
      done = self._ready.get(sp, set())
      return [a for a in arms if (bucket, a) in done]

  def compile_order(self, pairs: Pairs, bandit, measured=None) -> list[tuple[int, Strategy]]:
    """The order the compile thread takes `pairs` in: each bucket's first arm, largest bucket
    first (speculation switches on at the largest and shrinks), then each one's second, ...:
    every bucket speculates after one compile, not after all of its arms'. A bucket's arms in
    `_ranked` order."""
    ranked = self._ranked(pairs, bandit, measured)
    depth = max(map(len, ranked.values()), default=0)
    return [(b, ranked[b][i]) for i in range(depth) for b in sorted(ranked, reverse=True)
            if i < len(ranked[b])]

  def _ahead(self, call: PlanCall, top: int | None = None) -> Pairs:
    """The wanted pairs compiled ahead of need (`submit`) at buckets up to `top` (the bucket
    of the call's request count: no batch of the call needs more; None: every bucket): with a
    gate, each bucket's first arm (`want` the others); else all."""
    pairs = {b: arms for b, arms in self._wanted_pairs(call).items()
             if top is None or b <= top}
    if call.gate is None:
      return pairs
    return {b: arms[:1] for b, arms in self._ranked(pairs, call.bandit, call.selector).items()}

  def _ranked(self, pairs: Pairs, bandit, measured=None) -> Pairs:
    """Each bucket's arms, "off" last: those `measured` (the call's bandit, a Selector) has
    values for at the bucket's largest live size, where most of a batch's chunks there run,
    fastest first; then the config's strategy (the gate's lead); then those `bandit` (the
    engine's: its `choosable`) may return at that size: a bucket spans the bandit's size
    bounds (32 rows hold 17-32 live), and an arm listed only at the lower one would leave the
    upper one nothing compiled but "off". (docs/engine.md, "Which arm first".)"""
    lead, top = self.ecfg.spec.strategy, self.ecfg.spec_top

    def ranked(b, arms):
      if len(arms) < 2:  # (nothing to order: no medians on every chunk's `submit`)
        return list(arms)
      n = min(b, top)  # the bucket's largest live size
      listed = bandit.choosable(n, n)
      values = measured.values(n) if measured is not None else {}
      return sorted(arms, key=lambda a: (a == "off", values.get(a) is None,
                                         -(values.get(a) or 0.0), a != lead, a not in listed))

    return {b: ranked(b, arms) for b, arms in pairs.items()}

  # ----------------------------------------------------------------------- when
  def submit(self, call: PlanCall, sp: SamplingParams, top: int | None = None,
             paying: bool = False) -> None:
    """Starts compiling the wanted (bucket, arm) pairs for `sp` that are not compiled or
    queued yet on the compile thread, largest bucket first (speculation switches on at the
    largest and shrinks), up to bucket `top` (that of the call's request count: no batch of
    the call needs more; a later call with more rows compiles the larger buckets then).
    Called as a generate call starts, before each of its chunks (`paying`: what a verdict
    opened since, on any worker; a no-op when nothing is new) and as it ends (`next_call`:
    what the next call starts with).
    With a gate, each bucket's first arm only (`want` queues the others when a chunk asks),
    and switch-off after the first arm where the gate may close a bucket (`leaves_at`), in
    two jobs: the buckets that pay and the one on probation, urgent (before every job not
    started), where none of their arms was queued before; then a first arm the bandit's
    measurements moved ahead where another was (`_ranked`) and, unless `paying`, the probe's
    arm at the closed buckets under it (`placement.below_probe`), after what is queued.
    Without a gate: one job, after what is queued. (docs/engine.md, "Mid-call, and what
    goes first", "Which arm first".)"""
    pairs, gate = self._ahead(call, top), call.gate
    if gate is None:
      self._queue_pairs(call, sp, pairs, urgent=False)
      return
    with self._lock:
      had = {b for b, _ in self._submitted.get(sp, ())}
    opens = {b for b in pairs if not gate.closes(b) or (gate.probes(b) and not paying)}
    self._queue_pairs(call, sp, {b: pairs[b] for b in opens - had}, urgent=True)
    self._queue_pairs(call, sp, {b: a for b, a in pairs.items()
                                 if b in had and b in opens or b not in opens and not paying},
                      urgent=False)

  def _queue_pairs(self, call: PlanCall, sp: SamplingParams, pairs: Pairs, urgent: bool):
    """`pairs` not compiled or queued yet, one job on the compile thread (`submit`)."""
    with self._lock:
      self._ready.setdefault(sp, set())
      submitted = self._submitted.setdefault(sp, set())
      pairs = {b: new for b, arms in pairs.items()
               if (new := [a for a in arms if (b, a) not in submitted])}
      if not pairs:
        return
      submitted.update((b, a) for b, arms in pairs.items() for a in arms)
      self._thread(call)

    def mark(pair):
      with self._lock:
        self._ready[sp].add(pair)

    def job():
      try:
        self._compile_pairs(call, sp, pairs, on_compiled=mark,
                            leaves_at=self.leaves_at(call, pairs))
      except Exception:  # noqa: BLE001 - the foreground compiles what it needs instead
        _log.exception("worker %d: background compilation failed; speculation compiles its "
                       "executables on first use", call.worker_id)
        with self._lock:
          self._ready[sp].update((b, a) for b, arms in pairs.items() for a in arms)

    self._submit(job, urgent=urgent)

  def _thread(self, call: PlanCall) -> None:
    """Starts this engine's compile thread if it has none (under the lock)."""
    if self._compiler is None:
      self._compiler = background_compiler(f"compile-worker-{call.worker_id}")

  def _submit(self, job: Callable[[], Any], urgent: bool = False) -> None:
    """Queues `job` on the compile thread; an urgent one (a window a running chunk needs)
    before every job not started yet (each job, and the arms' between executables, runs the
    urgent ones first): it waits for one compile at most, not for arms nobody has run yet."""
    if urgent:
      self._urgent.append(job)
      self._compiler.submit(self._run_urgent)
    else:
      self._compiler.submit(lambda: (self._run_urgent(), job()))

  def _run_urgent(self) -> None:
    with deferring(False):  # (a running chunk needs these: waited for, never put off)
      while self._urgent:
        try:  # (a failed window: its chunks run the wider one they have)
          self._urgent.popleft()()
        except Exception:  # noqa: BLE001
          _log.exception("background compilation of an attention window failed")

  def wait(self, timeout: float | None = None) -> None:
    """Blocks until background compilation started so far is done (tests, benchmarks)."""
    if self._compiler is not None:
      self._compiler.submit(lambda: None).result(timeout)

  def precompile(self, call: PlanCall, sp: SamplingParams, *, all_pairs: bool = False) -> int:
    """AOT-compiles the speculative executable of every choosable (bucket, arm) pair now, instead
    of on first use (the default, lazy; it compiles the same pairs, and only those chosen).
    all_pairs=True compiles every bandit arm at every engine bucket (what choosable-only
    saves, measured). Returns the number of new speculative executables."""
    pairs = self.choosable_pairs(call)
    if all_pairs and pairs:
      pairs = {b: call.bandit.arms for b in self.ecfg.buckets}
    before = sum(r.name == "spec" for r in self.exes.records)
    self._compile_pairs(call, sp, pairs)
    if self.ecfg.spec.background_compile:
      done = {(b, a) for b, arms in pairs.items() for a in arms}
      with self._lock:
        self._ready.setdefault(sp, set()).update(done)
        self._submitted.setdefault(sp, set()).update(done)
    return sum(r.name == "spec" for r in self.exes.records) - before

  def _compile_pairs(self, call: PlanCall, sp: SamplingParams, pairs: Pairs,
                     on_compiled: Callable | None = None, leaves_at: int | None = None) -> None:
    """The spec executables of `pairs`, and switch-off at bucket `leaves_at` right after its
    first arm (None: none).

    States are abstract: shapes and shardings come from the executable of a speculative
    prefill of dummy rows at the largest bucket (the state generate() will run), resized on
    the batch axis; no KV pool is touched (generate may be using it)."""
    if not pairs:
      return
    state = self.prefill_dummy(call, max(pairs), warm=True)

    def one(pair):
      b, arm = pair
      if on_compiled is not None:  # (on the compile thread: the windows chunks need first)
        self._run_urgent()
      self.spec(call, sp, arm, resized(state, b))
      if on_compiled is not None:
        on_compiled((b, arm))

    for b, arm in compile_each(self.compile_order(pairs, call.bandit, call.selector), one,
                               on_compiled is not None):
      if b == leaves_at:
        leaves_at = None
        self.switch_off(call, resized(state, b))

  # ----------------------------------------------------------------- the executables
  def track(self, call: PlanCall, dcache, tokens, hidden, valid):
    """The drafter's tracking of a plain chunk at a bucket (spec_state.track; args may be
    abstract: `track_ahead`). It donates the drafter's cache."""
    from tlt_jax.rollout import spec_state
    return self.exes.get("track", None, functools.partial(spec_state.track, cfg=self.cfg),
                         (call.params, call.drafter_params, dcache, tokens, hidden, valid),
                         donate=(2,))

  def track_ahead(self, call: PlanCall, bucket: int) -> None:
    """Queues the drafter's tracking (drafter-only executables, seconds each) at `bucket` and
    the next bucket down on the compile thread, once each (background compilation only): a
    tracked call's plain chunks at a bucket find it compiled, and the batch compacting finds
    the next one compiled too. Buckets a tracked batch never decodes plainly at compile none."""
    if not self.ecfg.spec.background_compile:
      return
    below = [b for b in self.ecfg.buckets if b < bucket]
    want = [b for b in (bucket, max(below, default=None)) if b is not None]
    with self._lock:
      want = [b for b in want if b not in self._tracked]
      self._tracked.update(want)
      if not want:
        return
      self._thread(call)
    for b in want:  # (ahead of queued arms: a plain chunk here would wait for it)
      self._submit(functools.partial(self._track_at, call, b), urgent=True)

  def _track_at(self, call: PlanCall, bucket: int) -> None:
    """Compiles the drafter's tracking at `bucket` (abstract arguments; the compile thread)."""
    c, d = self.ecfg.chunk_size, self.cfg.hidden_size
    rows = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=self._replicated)
    top = self.prefill_dummy(call, max(self.ecfg.buckets), warm=True).dcache
    self.track(call, resized(top, bucket), rows(bucket, c),
               rows(bucket, c, d, dtype=self.cfg.compute_dtype), rows(bucket, c, dtype=jnp.bool_))

  def call_starts(self, call: PlanCall, sp: SamplingParams, requests: int,
                  tracked: bool) -> int | None:
    """A speculating engine's call of `requests` requests starts: with background compiles,
    the drafter's tracking where its batch starts (tracked: first) and the arms are queued
    (`submit`). -> the call's top bucket (its requests', at most max_batch: nothing above it
    is compiled for it; None without background compilation)."""
    self.rollouts += 1
    if not self.ecfg.spec.background_compile:
      return None
    top = self.ecfg.bucket_for(min(max(requests, 1), self.ecfg.max_batch))
    if tracked:
      self.track_ahead(call, top)
    self.submit(call, sp, top)
    return top

  def next_call(self, call: PlanCall, sp: SamplingParams, top: int, ended) -> None:
    """As a call (`ended`: its `Call`) ends, what the next one will compile as it starts,
    queued to compile while the learner's phases run (`call.gate`: the gate as the next
    rollout will begin): what `submit` queues as a call starts, and where this call ran
    untracked and the next is tracked, the drafter's prefill after each of this call's
    prefills' shapes (`track_prompt`) and its tracking at the buckets this one decoded
    plainly at, ahead of the plain executables queued for tails to come (docs/engine.md,
    "Between rollouts"). From abstract shapes: the weights may be released meanwhile."""
    if call.gate.may_speculate() and not ended.track:
      for b in sorted(ended.plain_at, reverse=True):
        self.track_ahead(call, b)
      with self._lock:
        self._thread(call)
      for args in ended.untracked_prefills.values():  # (one per shape)
        self._submit(functools.partial(self._track_prompt_at, call, *args), urgent=True)
    self.submit(call, sp, top)

  def _track_prompt_at(self, call: PlanCall, batch: int, tokens, lens, src, keys,
                       max_new) -> None:
    """Compiles the drafter's prefill (`track_prompt`) after a target prefill of these shapes
    (the target's executable is compiled: only its outputs' shapes are read)."""
    self._prefill_abstract(call, batch, True, tokens, lens, src, keys, max_new)

  def prefill_dummy(self, call: PlanCall, batch: int, warm: bool = False):
    """What a prefill of `batch` distinct rows outputs (warm: a speculative one, the
    drafter's too), abstract (shapes and shardings as generate's; the shapes ahead-of-time
    compiles start from): no pool is touched. Row i's prompt is i's digits in base vocab_size
    (distinct rows even where the batch outnumbers the vocabulary, as the shipped 32-token
    models' 64-row bucket does: repeated prompts would make it a shared prefill of fewer rows)."""
    v, width = self.cfg.vocab_size, 1
    while v ** width < batch:
      width += 1
    dummy = [Request([i // v ** k % v for k in range(width)], i) for i in range(batch)]
    tokens, lens, _, keys, max_new = prefill_arrays(dummy, batch, jax.random.key(0), self.ecfg)
    return self._prefill_abstract(call, batch, warm, tokens, lens, None, keys, max_new)

  def _prefill_abstract(self, call: PlanCall, batch: int, warm: bool, tokens, lens, src, keys,
                        max_new):
    """A prefill of these arrays' shapes into `batch` rows (warm: the drafter's too), run
    abstractly (`exes.abstract_out`: compiled, not run; no pool touched)."""
    rows = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._replicated)
    cache = call.kv.abstract(False).replace(table=rows(batch, self.ecfg.row_pages),
                                            lengths=rows(batch))
    run = lambda name, variant, fn, args, donate: self.exes.abstract_out(  # noqa: E731
        name, variant, fn, args, donate=donate)
    return run_prefill(run, self.cfg, self.ecfg.spec is not None,
                       self.max_steps(call) if warm else 0,
                       call.params, call.drafter_params, cache,
                       call.kv.abstract(True) if warm else None, tokens, lens, src, keys,
                       max_new)

  def _have(self, key: ExecKey, job: Callable[[], Any], urgent: bool = False) -> bool:
    """Whether executable `key` is compiled. Compiling in the background, one that is not
    is queued once (`job`; urgent: before every job not started, `_submit`) and the caller
    goes on without it; without background compilation: True (it compiles as it runs)."""
    spec = self.ecfg.spec
    if spec is None or not spec.background_compile or self._compiler is None or key in self.exes:
      return True
    with self._lock:
      queue = key not in self._queued
      self._queued.add(key)
    if queue:
      self._submit(job, urgent)
    return False

  _abstract = staticmethod(abstract)  # (the simulator's states are their own abstraction)

  def _spec_key(self, call: PlanCall, sp: SamplingParams, arm: Strategy, state,
                kv_len: int) -> ExecKey:
    return ExecKey.of("spec", (arm, sp, self.use_kernel, kv_len), self._spec_args(call, arm, state))

  def _spec_args(self, call: PlanCall, arm: Strategy, state) -> tuple:
    """The arguments of an arm's executable: a drafter arm's chunk takes the state; a history
    arm's step (`speculative.history_step`) also the drafts, tokens and parents [B, N - 1]
    (abstract here: the engine passes the index's, same shapes)."""
    args = (call.params, call.drafter_params, state)
    if not arm.history:
      return args
    drafts = jax.ShapeDtypeStruct((state.batch_size, arm.verify_tokens - 1), jnp.int32,
                                  sharding=self._replicated)
    return args + (drafts, drafts)

  def spec(self, call: PlanCall, sp: SamplingParams, arm: Strategy, state,
           kv_len: int | None = None):
    """The (bucket, arm, attention window) executable (kv_len None: the whole cache); state
    may be abstract (ShapeDtypeStructs, `precompile`)."""
    from tlt_jax.rollout import speculative
    ecfg = self.ecfg
    kv_len = kv_len or ecfg.cache_len
    args = self._spec_args(call, arm, state)
    # a history arm's chunk is a host loop of single steps (the index drafts between them)
    fn, chunk = ((speculative.history_step, {}) if arm.history else
                 (speculative.spec_chunk, dict(chunk=ecfg.chunk_size)))

    def compiled(use_kernel: bool):
      fn_ = functools.partial(fn, cfg=self.cfg, sp=sp, stop_tokens=ecfg.stop_tokens,
                              strategy=arm, capture_hidden=ecfg.capture_hidden,
                              use_kernel=use_kernel, kv_len=kv_len, **chunk)
      return self.exes.get("spec", (arm, sp, use_kernel, kv_len), fn_, args, donate=(2,))

    if self.use_kernel is False:
      return compiled(False)
    try:
      return compiled(self.use_kernel)
    except Elsewhere:  # (another thread compiles it: compile_each)
      raise
    except Exception as e:  # noqa: BLE001 - any lowering/compile failure of the kernel
      # The kernel is an optimisation with a bit-identical reference: a GPU/Triton version
      # it does not compile on must cost speed, not the run.
      self.use_kernel = False
      self.kernel_error = f"{type(e).__name__}: {e}"[:2000]
      _log.warning("worker %d: the Pallas verification kernel failed to compile for arm %s "
                   "(%s); verifying with the jnp reference from now on (same decisions)",
                   call.worker_id, arm, self.kernel_error.splitlines()[0][:300])
      return compiled(False)
