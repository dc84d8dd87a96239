"""Host-side rollout engine: one model replica decoding its share of requests in chunks.

An `Engine` owns one model replica (one device, or a tensor-parallel sub-mesh): its weights,
its `ExecutableCache` (executables.py: each (function, bucket) compiled once, ahead of time,
with its compile time and memory recorded) and a `generate` that only sequences other
owners, once per chunk:

  plan (the pure host `Scheduler`, scheduler.py: which rows to prefill, refill or compact,
  whether this chunk speculates) -> apply its layout ops on the device state -> maybe switch
  speculation on -> pick the arm (the selector, mab.py; a bucket on probation runs the gate's
  probed arm, gate.py) -> decode one chunk of jitted steps (the only host sync) -> collect
  the rows' outputs (records.py) -> report the chunk to the gate and the selector.

Until speculation switches on, an engine decodes with the executables of an engine without a
drafter; at switch-on `speculative.switch_on` builds the drafter's state from the live rows'
sequences (one target forward over them). Which speculative (bucket, arm) executables exist,
and when they compile (first use, `precompile`, or a background thread), is the engine's
`CompilePlan` (compile_plan.py).

Reads and memory follow the rows' live lengths, not the cache's capacity
(max_prompt_len + max_new_tokens). KV memory is one paged pool per replica (`kv_pages` pages
of `page_size` slots, allocated at the first generate and kept until `release_params`: the
engine's `KVPages`, pages.py): a request holds the pages its row has reached plus one chunk's
reach, is admitted only while pages are free, and when a live row's next chunk finds none the
youngest rows are preempted and recomputed later (pages.py's policy). Each chunk attends over
a window of the rows' slots (`kv_len`, models/kv_cache.py) picked from the longest live
row the host knows of plus what the chunk can add (`chunk_reach`), on the `length_grid`
(prompt_bucket x 2^k). Executables are keyed by window, compiled lazily like batch buckets.

History arms (strategy.py: "hist_<K>", "histtree_<K>_<topk>_<N>") draft from a host index of
earlier text (`history=`: duck-typed, begin/extend/end/draft, rollout/sources/history.py) instead of
the drafter. A call keeps the index current on every chunk, whatever the arm: a row's
prompt when it starts (`begin`), its tokens as they are emitted (`extend`), and `end` when it
finishes (kept: a sibling or a later epoch drafts from it) or is preempted (dropped: it will
be decoded again); with a gate, only a call that starts while speculation's data is wanted
(`drafter_wanted`: where drafts cannot pay, feeding it is host work on every chunk for
nothing), and a call that did not feed it begins its live rows (prompt and tokens so far) the
first time a history arm runs. A history arm needs a lookup per verification, so its chunk is
a host loop of single jitted steps (history_chunk.py): draft every live row, verify, extend.

Hooks (`EngineHooks`, called on the engine's thread): each chunk's metrics, each finished
response (rewards start at once; the drafter buffer takes its hidden states), and a call
before every chunk (the coordinator pulls newer weights there). Several engines run
concurrently, each inside a coordinator `Worker` (tlt_jax/coordinator/).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tlt_jax.models import KVCache, ModelConfig, Params, replica_layout
from tlt_jax.rollout import decode
from tlt_jax.rollout.policies import payoff
from tlt_jax.rollout.compile_plan import CompilePlan, PlanCall
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.executables import CompileRecord, ExecutableCache
from tlt_jax.rollout.policies.mab import make_selector
from tlt_jax.rollout.history_chunk import history_chunk
from tlt_jax.rollout.pages import KVPages, PageAllocator, admission, grow_rows
from tlt_jax.rollout.prefill import prefill_arrays, prefill_call, prompt_problem
from tlt_jax.rollout.records import ChunkMetrics, EngineHooks, Output, Request, Result
from tlt_jax.rollout.sampling import SamplingParams, plain_variant
from tlt_jax.rollout.scheduler import Prefill, Refill, Resize, Scheduler
from tlt_jax.rollout.policies.strategy import Strategy
from tlt_jax.sharding import make_mesh, tree_shardings


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _to_replica(params: Params, dtype, cfg: ModelConfig, fused: bool) -> Params:
  """The replica layout where the params live: the compute dtype, layers unstacked and, with
  `fused`, projections fused (models.replica_layout); new buffers (each output keeps its
  input's sharding)."""
  return replica_layout(jax.tree.map(lambda x: x.astype(dtype), params), cfg, fused)


def replica_shardings(params: Params, cfg: ModelConfig, fused: bool, mesh: Mesh) -> Any:
  """The replica layout's shardings on `mesh` (params: any layout, or its shapes)."""
  return tree_shardings(jax.eval_shape(functools.partial(replica_layout, cfg=cfg, fused=fused),
                                       params), mesh)


def to_replica_layout(params: Params, cfg: ModelConfig, fused: bool, shardings: Any) -> Params:
  """Params in any layout (the learner's) -> the replica layout on `shardings`: cast and
  unstacked (fused) where they live (a bf16 replica of f32 master weights moves half the
  bytes), then resharded. Always a copy: the learner donates its params to its next update."""
  return jax.device_put(_to_replica(params, cfg.compute_dtype, cfg, fused), shardings,
                        may_alias=False)


def longest_row(sched: Scheduler, outputs: dict[Any, Output]) -> int:
  """The longest row in the batch: prompt + response so far, host-side (>= its committed
  cache length: a speculative row's pending token is emitted but not yet committed)."""
  return max((len(req.prompt_ids) + outputs[req.key].length
              for req in sched.slots if req is not None), default=1)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _prompt_forward(params: Params, tokens: jax.Array, *, cfg: ModelConfig) -> jax.Array:
  from tlt_jax.models import forward
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  return forward(params, tokens, pos, cfg=cfg, return_logits=False).hidden


def chunk_reach(arm: Strategy | None, chunk: int) -> int:
  """Cache slots past the longest row's length that a chunk of plain decoding (arm None) or
  of a speculative arm can read."""
  from tlt_jax.rollout import speculative
  return (decode.chunk_reach(chunk) if arm is None
          else speculative.chunk_reach(arm, chunk))


@dataclasses.dataclass
class Call:
  """One `generate` call: what it was given (sampling, its key, the selector and the gate it
  reports to, whether it captures hidden states, the hooks, the compile plan's view) and where
  it is besides the device state (the scheduler, the rows' outputs, the finished results, the
  pages its rows hold)."""
  sp: SamplingParams
  base_key: Any
  selector: Any
  gate: Any  # the gate this call measures (None: evaluation, or no gate)
  capture: bool
  hooks: EngineHooks
  t_start: float
  plan: PlanCall
  sched: Scheduler
  pages: PageAllocator
  history: Any  # the history index this call feeds (None: not fed, `_feed_history`)
  outputs: dict[Any, Output] = dataclasses.field(default_factory=dict)
  results: list[Result] = dataclasses.field(default_factory=list)


class Engine:
  """One model replica decoding its share of requests; see the module docstring."""

  def __init__(self, params: Params, cfg: ModelConfig, engine_cfg: EngineConfig, *,
               worker_id: int = 0, mesh: Mesh | None = None, drafter_params: Params | None = None,
               selector: Any = None, gate: Any = None, history: Any = None):
    self.cfg, self.ecfg, self.worker_id = cfg, engine_cfg, worker_id
    self.mesh = mesh if mesh is not None else make_mesh((1, 1, 1), jax.devices()[:1])
    self.fused = engine_cfg.fuses()  # the replica's projections fused (EngineConfig)
    self._param_shardings = replica_shardings(params, cfg, self.fused, self.mesh)
    self._replicated = NamedSharding(self.mesh, PartitionSpec())
    self.params = self.drafter_params = None
    self.set_params(params)
    if drafter_params is not None:
      self.set_drafter_params(drafter_params)
    elif engine_cfg.spec is not None:
      raise ValueError("EngineConfig.spec is set but the engine has no drafter_params")
    spec = engine_cfg.spec
    self.selector = selector or (make_selector("fixed", strategy=spec.strategy) if spec else None)
    self.gate = gate  # gate.py: the buckets speculation is measured to pay at (None: all)
    self.history = history  # the host's history index (module docstring), or None
    self._ran: set[int] = set()  # ids of the arm executables run so far (first runs: `_report`)
    arms = ([spec.strategy] + list(getattr(self.selector, "arms", None) or [])) if spec else []
    if history is None and any(a.history for a in arms):
      raise ValueError(f"history arms {[a for a in arms if a.history]} need a "
                       "history index: Engine(..., history=HistoryIndex(...))")
    self.kv = KVPages(cfg, self.mesh, self._replicated, num_pages=engine_cfg.pool_pages,
                      page_size=engine_cfg.page_size, row_pages=engine_cfg.row_pages)
    self.exes = ExecutableCache()
    self._compiles_reported = 0  # exes.records told to the gate (`_report_compiles`)
    self.compiles = CompilePlan(cfg, engine_cfg, self.exes, self._replicated)
    self.chunk_log: list[ChunkMetrics] = []
    self.preemptions = 0  # rows preempted for pages, over the engine's life

  # ---------------------------------------------------------------------------------- weights
  def set_params(self, params: Params) -> None:
    """New actor weights (after an RL update). Params already in the rollout layout (the
    coordinator's `to_rollout`: compute dtype, layers unstacked, this engine's devices hold
    its slices) are taken as they are, without a copy; others are cast to the compute dtype
    and unstacked where they are (a bf16 replica of f32 master weights moves and keeps half
    the bytes), then copied onto this engine's layout (a copy: the learner donates its params
    to its next update, which must not delete these; on a learner device the two layouts can
    coincide)."""
    from tlt_jax.sharding import local_view
    dt = self.cfg.compute_dtype
    layers = params["layers"]
    if isinstance(layers, (tuple, list)) and ("qkv" in layers[0]) == self.fused:
      view = local_view(params, self._param_shardings)
      if view is not None and all(x.dtype == dt for x in jax.tree.leaves(view)):
        self.params = view
        return
    self.params = to_replica_layout(params, self.cfg, self.fused, self._param_shardings)

  def release_params(self) -> bool:
    """Drops this engine's copy of the actor (after its rollout: the learner's phases get the
    memory back; the next `set_params` brings the updated weights). Not while background
    compilation still runs real prefills with them (the first steps): False then."""
    def drop():
      self.params = None
      self.kv.drop()
    return self.compiles.when_idle(drop)

  def set_drafter_params(self, dparams: Params) -> None:
    """New drafter weights (after spot training) on this engine's mesh: a view of the
    store's rollout layout where this engine's devices hold its slices, else a copy."""
    from tlt_jax.sharding import local_view
    shardings = tree_shardings(dparams, self.mesh)
    view = local_view(dparams, shardings)
    self.drafter_params = view if view is not None else jax.device_put(dparams, shardings)

  @property
  def compile_log(self) -> list[CompileRecord]:
    return self.exes.records

  def compile_stats(self) -> dict[str, Any]:
    return self.exes.stats()

  # ------------------------------------------------------------------------- device calls
  # The device seam: the chunk loop (`generate`, `_chunk`, `_page`, `_collect`, `_report`:
  # the Scheduler, the page policy, the gate, the selector) touches devices and time only
  # through `_call`, `_apply`, `_switch_on`, `_decode`, `_sync`, `kv`, `exes`, `compiles` and
  # `clock`; the cluster simulator (tlt_jax/plan/sim.py) runs the same loop on a simulated
  # device and clock by replacing them.
  clock = staticmethod(time.perf_counter)

  def _sync(self, state):
    """Waits for what was dispatched before the next chunk (its time is the chunk's own)."""
    return jax.block_until_ready(state)

  def _call(self, name: str, variant, fn: Callable, args: tuple, donate=()):
    return self.exes.get(name, variant, fn, args, donate=donate)(*args)

  def _plan(self) -> PlanCall:
    """The compile plan's view of this engine now (its selector: the arms compiled)."""
    return PlanCall.view(self.worker_id, self.params, self.drafter_params, self.selector,
                         self.gate, self.kv)

  def prompt_hidden(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """The post-norm hidden state of every position of each prompt ([P_i, D], host), by one
    forward of this engine's params over the distinct prompts on its devices (rows padded to
    a power of two, columns to max_prompt_len: a few executables). The drafter's training
    context (tlt_jax/drafter/buffer.py); the prefill does not keep them."""
    keys = list(dict.fromkeys(tuple(int(t) for t in p) for p in prompts))
    tok = np.zeros((1 << (len(keys) - 1).bit_length(), self.ecfg.max_prompt_len), np.int32)
    for i, k in enumerate(keys):
      tok[i, :len(k)] = k
    h = np.asarray(jax.device_get(_prompt_forward(
        self.params, jax.device_put(tok, self._replicated), cfg=self.cfg)))
    by_key = {k: h[i, :len(k)] for i, k in enumerate(keys)}
    return [by_key[tuple(int(t) for t in p)] for p in prompts]

  def choosable_pairs(self) -> dict[int, list[Strategy]]:
    """Engine bucket -> the arms the selector can choose there (compile_plan.py)."""
    return self.compiles.choosable_pairs(self._plan())

  def precompile(self, sp: SamplingParams, *, all_pairs: bool = False) -> int:
    """Compiles every choosable (bucket, arm) pair now (CompilePlan.precompile); returns the
    number of new speculative executables."""
    return self.compiles.precompile(self._plan(), sp, all_pairs=all_pairs)

  def _prefill(self, reqs: Sequence[Request], batch: int, c: Call, warm: bool,
               kv: KVCache, dkv: KVCache | None):
    """Prefill of `reqs` into a new state of `batch` rows whose k/v go to the pages the call's
    allocator holds for them in the pools kv (and the drafter's, dkv: warm, with the drafter's
    prefill, a SpecState); both pools are donated and come back in the state."""
    tokens, lens, src, keys, max_new = prefill_arrays(reqs, batch, c.base_key, self.ecfg)
    table = self.kv.table(c.pages, [r.key for r in reqs] + [None] * (batch - len(reqs)))
    cache = kv.replace(table=table, lengths=jnp.zeros((batch,), jnp.int32))
    max_steps = self.compiles.max_steps(c.plan) if warm else 0
    name, variant, fn, args, donate = prefill_call(
        self.cfg, warm, max_steps, self.params, self.drafter_params, cache, dkv, tokens, lens,
        src, keys, max_new)
    return self._call(name, variant, fn, args, donate=donate)

  def _reach(self, speculating: bool) -> int:
    """Slots past a row's length the next chunk can reach: plain decoding's, or the largest
    of the arms speculation can run."""
    ecfg = self.ecfg
    arms = ([ecfg.spec.strategy] + list(getattr(self.selector, "arms", None) or [])
            if speculating else [None])
    return max(chunk_reach(a, ecfg.chunk_size) for a in arms)

  def _page(self, state, c: Call, reach: int):
    """Before a chunk: every live row gets the pages its next chunk can reach; the rows the
    page policy preempts for them (pages.py's `grow_rows`) leave the scheduler, the state and
    the history index. Then the state's page tables are set from the allocator (rows without
    a request: none)."""
    sched = c.sched
    live = {sched.slots[s].key: s for s in sched.live}
    slots = {key: len(sched.slots[s].prompt_ids) + c.outputs[key].length + reach
             for key, s in live.items()}
    for victim in grow_rows(c.pages, slots):
      state = self._apply(sched.preempt(live[victim]), state, c, False)
      c.outputs.pop(victim)
      if c.history is not None:  # decoded again from its prompt later
        c.history.end(victim, keep=False)
      self.preemptions += 1
    table = self.kv.table(c.pages, [r.key if r is not None else None for r in sched.slots])
    return self._call("set_tables", None, decode.set_tables, (state, table), donate=(0,))

  def _apply(self, op, state, c: Call, warm: bool):
    """A scheduler layout operation on the device state (None before the first prefill);
    warm: the state carries the drafter's (a SpecState). Every op donates the state: its
    page pools pass through in place."""
    if isinstance(op, Prefill):
      return self._prefill(op.requests, op.bucket, c, warm, self.kv.take(False),
                           self.kv.take(True) if warm else None)
    if isinstance(op, Resize):
      idx, valid = jnp.asarray(op.idx, jnp.int32), jnp.asarray(op.valid)
      return self._call("take_rows", None, decode.take_rows, (state, idx, valid), donate=(0,))
    if isinstance(op, Refill):
      kv, dkv = decode.pools(state)
      rows = self._prefill(op.requests, op.bucket, c, warm, kv, dkv)
      # Padding rows of the prefill go to an out-of-range slot and are dropped.
      slots = np.full((op.bucket,), state.batch_size, np.int32)
      slots[:len(op.slots)] = op.slots
      return self._call("put_rows", None, decode.put_rows,
                        (decode.without_pools(state), rows, jnp.asarray(slots)), donate=(0, 1))
    raise TypeError(f"unknown layout operation {op!r}")

  def _switch_on(self, state, c: Call):
    """Speculation starts: each row's prompt and response so far -> the SpecState, over the
    shortest compiled length that holds them. Returns (state, True), or (state, False) while
    this bucket's executables are still compiling (the chunk decodes plainly)."""
    if not self.compiles.ready(c.plan, c.sp, state.batch_size):
      return state, False
    seqs = {row: c.outputs[req.key].sequence(req, self.ecfg.cache_len)
            for row, req in enumerate(c.sched.slots[:state.batch_size]) if req is not None}
    length = self.compiles.switch_length(c.plan, state,
                                         max(map(len, seqs.values()), default=1))
    if length is None:
      return state, False
    tokens = np.zeros((state.batch_size, length), np.int32)
    for row, seq in seqs.items():
      tokens[row, :len(seq)] = seq
    tokens = jax.device_put(tokens, self._replicated)
    dkv = self.kv.take(True)
    exe = self.compiles.switch_on(c.plan, state, length, dpool=dkv)
    return exe(self.params, self.drafter_params, state, dkv, tokens), True

  def _decode(self, state, c: Call, arm: Strategy | None, kv_len: int):
    """One chunk, and its one host sync. arm=None: plain decoding (before speculation starts:
    a DecodeState, the executables of an engine without a drafter), returning hidden states
    if the call captures them; else a strategy on the SpecState (whose executables return
    them if the engine captures at all: speculative chunks run only where the gate opens).
    kv_len: the attention window (CompilePlan.window; the state's caches hold at least that).
    Returns (state, host copies of (ChunkOutput, done [B], stopped [B], [accepted drafts,
    verifications]), whether the arm's executable ran for the first time)."""
    sp = c.sp
    if arm is not None:
      exe = self.compiles.spec(c.plan, sp, arm, state, kv_len)
      first = self._first_run(exe)
      if arm.history:  # a host loop of steps, the index drafting before each
        rows = {s: c.sched.slots[s].key for s in c.sched.live}
        state, host = history_chunk(exe, self.params, self.drafter_params, state, arm,
                                    self._feed_history(c), rows, self.ecfg.chunk_size,
                                    self._replicated)
        return state, host, first
      state, out, counts = exe(self.params, self.drafter_params, state)
    else:
      ecfg = self.ecfg
      # one executable for every temperature (greedy evaluation included): an argument
      static = plain_variant(sp)
      fn = functools.partial(decode.decode_chunk, cfg=self.cfg, sp=static,
                             stop_tokens=ecfg.stop_tokens, chunk=ecfg.chunk_size,
                             capture_hidden=c.capture, kv_len=kv_len)
      state, out = self._call("decode", (static, c.capture, kv_len), fn,
                              (self.params, state, np.float32(sp.temperature)), donate=(1,))
      counts, first = (0, 0), False
    base = state if isinstance(state, decode.DecodeState) else state.base
    return state, jax.device_get((out, base.done, base.stopped, counts)), first

  def _feed_history(self, c: Call):
    """The index a history arm drafts from, fed from now on in a call that did not feed it:
    its live rows begin with their prompts and the tokens they have so far."""
    if c.history is None:
      c.history = self.history
      for s in c.sched.live:
        req = c.sched.slots[s]
        c.history.begin(tuple(int(t) for t in req.prompt_ids), req.key, req.prompt_ids)
        for tokens in c.outputs[req.key].tokens:
          c.history.extend(req.key, tokens)
    return c.history

  def _first_run(self, exe) -> bool:
    """Whether `exe` (an arm's executable) runs for the first time on this engine."""
    first = id(exe) not in self._ran
    self._ran.add(id(exe))
    return first

  # ---------------------------------------------------------------------------------- generate
  def validate(self, requests: Sequence[Request]) -> None:
    for r in requests:
      problem = prompt_problem(r.prompt_ids, vocab_size=self.cfg.vocab_size,
                               max_prompt_len=self.ecfg.max_prompt_len)
      if problem:
        raise ValueError(f"request {r.request_id}: {problem}")

  def generate(self, requests: Sequence[Request], sp: SamplingParams, *, seed: int = 0,
               hooks: EngineHooks | None = None, selector: Any = None,
               speculate: bool = True) -> list[Result]:
    """Decodes all requests; returns results in completion order. `selector` overrides the
    engine's strategy selector for this call (same arms), e.g. so that evaluation chunks
    never feed the training bandit's reward windows; speculate=False decodes plainly, without
    the drafter."""
    self.validate(requests)
    ecfg = self.ecfg
    selector = selector or self.selector
    spec = ecfg.spec if speculate else None
    plan = self._plan()
    # only the training bandit's chunks measure the gate (evaluation samples greedily)
    gate = self.gate if spec is not None and selector is self.selector else None
    if gate is not None:
      gate.begin_rollout(self.worker_id, self.compiles.choosable_pairs(plan))
    if spec is not None:
      self.compiles.rollouts += 1
      if spec.background_compile:
        self.compiles.submit(plan, sp)
    # One batch at or under the threshold from the start (speculation would switch on at the
    # first check): speculate from the first chunk, the drafter prefilled with the prompts
    # (no switch-on forward after a plain prefill)
    at_once = (spec is not None and spec.patience == 1
               and len(requests) <= min(spec.bs_threshold, ecfg.max_batch)
               and self.compiles.ready(plan, sp, ecfg.bucket_for(len(requests))))
    # drafter data and history only while speculation can pay: with a gate, once a probe has
    # shown that drafts can pay on this hardware (where they cannot, the hidden states'
    # transfer and the history's host bookkeeping are pure overhead on every chunk)
    wanted = self.gate is None or self.gate.drafter_wanted()
    c = Call(
        sp=sp, base_key=jax.random.key(seed), selector=selector, gate=gate,
        capture=ecfg.capture_hidden and wanted,
        hooks=hooks or EngineHooks(), t_start=self.clock(), plan=plan,
        sched=Scheduler(requests, max_batch=ecfg.max_batch, buckets=ecfg.buckets,
                        compaction=ecfg.compaction,
                        bs_threshold=spec.bs_threshold if spec else None,
                        patience=spec.patience if spec else 1, speculating=at_once),
        pages=self.kv.allocator(), history=self.history if wanted else None)
    state, started = None, at_once  # started: every chunk from here on speculates
    try:
      while not c.sched.done:
        state, started = self._chunk(state, started, c)
    finally:  # the pools go back to the engine (lost if a device call failed midway)
      self.kv.keep(state)
    return c.results

  def _chunk(self, state, started: bool, c: Call):
    """One chunk of `generate`: plan -> layout ops -> pages -> switch-on -> arm -> decode ->
    collect -> report. Returns (state, started)."""
    ecfg, sched, gate = self.ecfg, c.sched, c.gate
    if c.hooks.before_chunk:
      c.hooks.before_chunk()
    reach = self._reach(started or sched.speculating)
    for op in sched.plan(admission(c.pages, reach)):
      # refills once speculation runs carry the drafter's prefill
      state = self._apply(op, state, c, started)
      for r in getattr(op, "requests", ()):
        c.outputs[r.key] = Output(ecfg.hidden_keep)
        if c.history is not None:
          # siblings and later epochs of a prompt share its history: keyed by the prompt's text
          c.history.begin(tuple(int(t) for t in r.prompt_ids), r.key, r.prompt_ids)
    speculating = sched.check_speculation()
    state = self._page(state, c, self._reach(started or speculating))
    live = sched.live
    if speculating and not started:
      state, speculating = self._switch_on(state, c)
    started = started or speculating
    arm = None
    if speculating:
      # with a gate, among the arms it paid to compile here; a bucket on probation runs the
      # probed arms
      paid = gate.arms(self.worker_id, state.batch_size) if gate is not None else None
      arm = c.selector.select(len(live), arms=paid) if paid else c.selector.select(len(live))
      if gate is not None:
        arm = gate.probe_arm(state.batch_size, arm)
    for s in live if speculating else ():
      c.outputs[sched.slots[s].key].speculating()
    # the attention window the rows reach this chunk (their pages hold it: `_page`)
    kv_len = self.compiles.window(c.plan, c.sp, arm, state, longest_row(sched, c.outputs)
                                  + chunk_reach(arm, ecfg.chunk_size))
    if arm is not None or gate is not None:
      # the chunk's time is the arm's own (the selector's reward, the gate's rates): what was
      # dispatched before it (a refill's prefill, the page tables) finishes first. Otherwise
      # at batch 1, where every chunk starts a new answer, each reward carried a prefill.
      state = self._sync(state)
    compiles, t0 = self.exes.compiled_here(), self.clock()
    state, host, first = self._decode(state, c, arm, kv_len)  # the host sync
    dt = self.clock() - t0
    # a history chunk extended the index step by step
    extend = c.history is not None and not (arm and arm.history)
    produced = self._collect(c, live, host, extend)
    self._report(ChunkMetrics(
        worker_id=self.worker_id, bucket=state.batch_size, live=len(live), tokens=produced,
        steps=int(host[0].steps), wall_time=dt, mode=arm or "plain", accepted=int(host[3][0]),
        verifications=int(host[3][1]), t=self.clock() - c.t_start,
        compiled=self.exes.compiled_here() != compiles, first_run=first), c)
    return state, started

  def _report_compiles(self, gate) -> None:
    """This engine's compiles since the last report (background ones too) to the gate, which
    prices what speculation would compile by them (payoff.py): plain decode chunks, an arm's
    speculative chunk, a bucket's one-off speculative compiles (switch-on, the speculative
    prefill)."""
    records = self.exes.records[self._compiles_reported:]
    self._compiles_reported += len(records)
    for r in records:
      kind = payoff.KIND.get(r.name)
      if kind is not None:
        gate.compiled(kind, r.batch, r.key.variant[0] if kind == payoff.SPEC else None,
                      r.seconds)

  def _collect(self, c: Call, live: list[int], host, extend: bool) -> int:
    """A chunk's tokens into the live rows' outputs (and the history index's, if `extend`);
    finished rows leave the scheduler (and end in the index, kept) and become Results
    (appended, and handed to the hook at once). Returns the tokens produced."""
    sched, outputs, hooks = c.sched, c.outputs, c.hooks
    out, done, stopped, _ = host
    produced = 0
    for s in live:
      req, v = sched.slots[s], out.valid[s]
      produced += int(v.sum())
      outputs[req.key].append(out.tokens[s][v], out.logprobs[s][v],
                              out.hidden[s][v] if c.capture and out.hidden is not None else None)
      if extend:
        c.history.extend(req.key, out.tokens[s][v])
      if done[s]:
        sched.finish(s)
        c.pages.release(req.key)
        if c.history is not None:
          c.history.end(req.key, keep=True)
        res = outputs.pop(req.key).result(req, stopped=bool(stopped[s]), worker_id=self.worker_id,
                                          t=self.clock() - c.t_start)
        c.results.append(res)
        if hooks.on_result:
          hooks.on_result(res)
    return produced

  def _report(self, m: ChunkMetrics, c: Call) -> None:
    """A chunk's measurements to the gate and the selector, then to the log and the hook. A
    chunk that compiled its executable reports nothing to either: compile time is not the
    arm's speed (the arm stays untried and is chosen again); nor does an executable's first run
    to the selector (the gate discounts its own warm-up chunks)."""
    gate, hooks = c.gate, c.hooks
    if gate is not None:
      self._report_compiles(gate)
      if not m.compiled:
        gate.record(m.bucket, m.arm, m.wall_time, m.steps, m.accepted, m.verifications)
    if m.arm is not None and not (m.compiled or m.first_run):
      # Reward (DESIGN.md 4) = accepted tokens x batch size / wall time of draft + verify
      # (ChunkMetrics.speed). "off" (plain decoding in the spec state: one token per
      # verification) is measured the same way.
      c.selector.update(m.arm, m.live, m.speed)
    self.chunk_log.append(m)
    if hooks.on_chunk:
      hooks.on_chunk(m)
