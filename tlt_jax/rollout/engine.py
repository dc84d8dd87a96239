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
a window of the rows' slots (`kv_len`, models/transformer.py) picked from the longest live
row the host knows of plus what the chunk can add (`chunk_reach`), on the `length_grid`
(prompt_bucket x 2^k). Executables are keyed by window, compiled lazily like batch buckets.

History arms (strategy.py: "hist_<K>", "histtree_<K>_<topk>_<N>") draft from a host index of
earlier text (`history=`: duck-typed, begin/extend/end/draft, rollout/history.py) instead of
the drafter. The engine keeps the index current on every chunk, whatever the arm: a row's
prompt when it starts (`begin`), its tokens as they are emitted (`extend`), and `end` when it
finishes (kept: a sibling or a later epoch drafts from it) or is preempted (dropped: it will
be decoded again). A history arm needs a lookup per verification, so its chunk is a host loop
of single jitted steps (history_chunk.py): draft every live row, verify, extend.

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

from tlt_jax.errors import ConfigError
from tlt_jax.models import KVCache, ModelConfig, Params, unstack_layers
from tlt_jax.rollout import decode, payoff
from tlt_jax.rollout.compile_plan import CompilePlan
from tlt_jax.rollout.executables import CompileRecord, ExecutableCache
from tlt_jax.rollout.mab import FixedSelector
from tlt_jax.rollout.history_chunk import history_chunk
from tlt_jax.rollout.pages import KVPages, PageAllocator, admission, grow_rows
from tlt_jax.rollout.records import ChunkMetrics, EngineHooks, Output, Request, Result
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.scheduler import Prefill, Refill, Resize, Scheduler, bucket_for
from tlt_jax.rollout.strategy import DEFAULT_ARM, Strategy
from tlt_jax.sharding import make_mesh, tree_shardings


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Adaptive speculative decoding: on once the live batch stays <= bs_threshold for
  `patience` consecutive chunk checks (then on for the rest of the generate call)."""

  strategy: str = DEFAULT_ARM  # an arm name (strategy.py), e.g. "4_1_5", "hist_4", "off"
  bs_threshold: int = 32
  patience: int = 2
  use_kernel: bool | None = None  # Pallas verification kernel vs jnp reference; None: GPU only
  # Compile the speculative executables in a background thread from the first generate on;
  # speculation starts at a bucket only once every arm choosable there is compiled (until
  # then the rows decode plainly): no chunk waits for a compile, the bandit sees no compile
  # time, and on an accelerator host the compiles overlap decoding for free. Off: each
  # executable compiles on first use (speculation from the first generate call).
  background_compile: bool = False
  max_steps: int = 0  # catch-up capacity (>= every strategy's steps); 0 -> the strategies'

  def __post_init__(self):
    try:
      Strategy.parse(self.strategy)
    except ValueError as e:
      raise ConfigError(str(e), "strategy", self.strategy) from None
    if self.bs_threshold < 1:
      raise ConfigError("must be >= 1", "bs_threshold", self.bs_threshold)
    if self.patience < 1:
      raise ConfigError("must be >= 1", "patience", self.patience)
    if self.max_steps < 0:
      raise ConfigError("must be >= 0", "max_steps", self.max_steps)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  max_batch: int = 64  # rows decoded at once by one worker
  buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # batch sizes compiled for
  chunk_size: int = 16  # decode steps between host checks (compaction / refill / metrics)
  compaction: bool = True  # shrink to the smallest bucket that holds the live rows
  max_prompt_len: int = 128  # cache capacity is max_prompt_len + max_new_tokens
  max_new_tokens: int = 256
  prompt_bucket: int = 16  # prompts are padded to a multiple of this (fewer prefill compiles)
  # return per-token last-layer hidden states (drafter data); with a speculation gate, only
  # while it wants the drafter trained (none on hardware where drafts cannot pay)
  capture_hidden: bool = False
  hidden_keep: int = 0  # > 0: keep only each response's last hidden_keep states (host memory)
  stop_tokens: tuple[int, ...] = ()
  spec: SpecConfig | None = None  # speculative decoding (needs drafter params on the worker)
  page_size: int = 16  # KV slots per page of the paged cache
  # pages in the replica's KV pool; 0: max_batch rows of max length (admission never waits)
  kv_pages: int = 0

  def __post_init__(self):
    if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) \
        or self.buckets[0] < 1:
      raise ConfigError("a strictly increasing tuple of batch sizes, e.g. (1, 2, 4, 8)",
                        "buckets", self.buckets)
    if self.max_batch < 1:
      raise ConfigError("must be >= 1", "max_batch", self.max_batch)
    if self.buckets[-1] < self.max_batch:
      raise ConfigError(f"the largest bucket must be >= max_batch ({self.max_batch})",
                        "buckets", self.buckets)
    for name in ("chunk_size", "max_prompt_len", "max_new_tokens", "prompt_bucket", "page_size"):
      if getattr(self, name) <= 0:
        raise ConfigError("must be > 0", name, getattr(self, name))
    if self.hidden_keep < 0:
      raise ConfigError("must be >= 0 (0 = all)", "hidden_keep", self.hidden_keep)
    if self.kv_pages and self.kv_pages < self.row_pages:
      raise ConfigError(f"a KV pool must hold one row of max_prompt_len + max_new_tokens = "
                        f"{self.cache_len} slots: >= {self.row_pages} pages of {self.page_size}"
                        " (0: max_batch such rows)", "kv_pages", self.kv_pages)

  @property
  def cache_len(self) -> int:
    return self.max_prompt_len + self.max_new_tokens

  @property
  def row_pages(self) -> int:
    """Pages of a row at its longest (a page table's width)."""
    return -(-self.cache_len // self.page_size)

  @property
  def pool_pages(self) -> int:
    return self.kv_pages or self.max_batch * self.row_pages

  def bucket_for(self, n: int) -> int:
    return bucket_for(self.buckets, n)


@functools.partial(jax.jit, static_argnums=1)
def _to_replica(params: Params, dtype) -> Params:
  """The replica layout where the params live: the compute dtype, layers unstacked
  (models.unstack_layers); new buffers (each output keeps its input's sharding)."""
  return unstack_layers(jax.tree.map(lambda x: x.astype(dtype), params))


def to_replica_layout(params: Params, dtype, shardings: Any) -> Params:
  """Params in any layout (the learner's) -> the replica layout on `shardings`: cast and
  unstacked where they live (a bf16 replica of f32 master weights moves half the bytes), then
  resharded. Always a copy: the learner donates its params to its next update."""
  return jax.device_put(_to_replica(params, dtype), shardings, may_alias=False)


def longest_row(sched: Scheduler, outputs: dict[Any, Output]) -> int:
  """The longest row in the batch: prompt + response so far, host-side (>= its committed
  cache length: a speculative row's pending token is emitted but not yet committed)."""
  return max((len(req.prompt_ids) + outputs[req.key].length
              for req in sched.slots if req is not None), default=1)


def chunk_reach(arm: str | None, chunk: int) -> int:
  """Cache slots past the longest row's length that a chunk of plain decoding (arm None) or
  of a speculative arm can read."""
  from tlt_jax.rollout import speculative
  return (decode.chunk_reach(chunk) if arm is None
          else speculative.chunk_reach(Strategy.parse(arm), chunk))


def prompt_len(reqs: Sequence[Request], ecfg: EngineConfig) -> int:
  """The padded length of these prompts' prefill: a multiple of prompt_bucket."""
  longest = max(len(r.prompt_ids) for r in reqs)
  return min(-(-longest // ecfg.prompt_bucket) * ecfg.prompt_bucket, ecfg.max_prompt_len)


def prefill_arrays(reqs: Sequence[Request], batch: int, base_key, ecfg: EngineConfig):
  """A prefill's inputs for `reqs` at `batch` rows: tokens [U, P] right-padded to a multiple
  of prompt_bucket, lens [U], src [batch] (row -> its prompt, `decode.expand_rows`; None when
  row i is prompt i), keys [batch, 2] (each row's own stream: (request_id, sample_index)
  folded into the call's key), max_new [batch]. A group's responses share their prompt: each
  distinct prompt is prefilled once (U rows) when that makes a smaller batch."""
  p = prompt_len(reqs, ecfg)
  keys = np.zeros((batch, 2), np.uint32)
  max_new = np.zeros((batch,), np.int32)
  src = np.full((batch,), -1, np.int32)  # row -> its distinct prompt
  distinct: dict[tuple[int, ...], int] = {}
  for i, r in enumerate(reqs):
    src[i] = distinct.setdefault(tuple(int(t) for t in r.prompt_ids), len(distinct))
    k = jax.random.fold_in(jax.random.fold_in(base_key, r.request_id), r.sample_index)
    keys[i] = np.asarray(jax.random.key_data(k))
    max_new[i] = min(r.max_new_tokens or ecfg.max_new_tokens, ecfg.max_new_tokens)
  u = ecfg.bucket_for(len(distinct))
  shared = u < batch
  rows = u if shared else batch
  tokens = np.zeros((rows, p), np.int32)
  lens = np.zeros((rows,), np.int32)
  for ids, j in distinct.items() if shared else ((r.prompt_ids, i) for i, r in
                                                 enumerate(reqs)):
    tokens[j, :len(ids)] = ids
    lens[j] = len(ids)
  return (jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(src) if shared else None,
          jnp.asarray(keys), jnp.asarray(max_new))


def prompt_problem(ids: Sequence[int], *, vocab_size: int, max_prompt_len: int) -> str | None:
  """What is wrong with a prompt for an engine (None: nothing). The one owner of the rule:
  the engine names the request, the generate CLI the prompt file's line."""
  if len(ids) == 0:
    return "empty prompt"
  if len(ids) > max_prompt_len:
    return (f"prompt has {len(ids)} tokens, more than max_prompt_len={max_prompt_len}; raise "
            "max_prompt_len or filter long prompts")
  bad = [t for t in ids if not 0 <= int(t) < vocab_size]
  if bad:
    return f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
  return None


class Engine:
  """One model replica decoding its share of requests; see the module docstring."""

  def __init__(self, params: Params, cfg: ModelConfig, engine_cfg: EngineConfig, *,
               worker_id: int = 0, mesh: Mesh | None = None, drafter_params: Params | None = None,
               selector: Any = None, gate: Any = None, history: Any = None):
    self.cfg, self.ecfg, self.worker_id = cfg, engine_cfg, worker_id
    self.mesh = mesh if mesh is not None else make_mesh((1, 1, 1), jax.devices()[:1])
    self._param_shardings = tree_shardings(jax.eval_shape(unstack_layers, params), self.mesh)
    self._replicated = NamedSharding(self.mesh, PartitionSpec())
    self.params = self.drafter_params = None
    self.set_params(params)
    if drafter_params is not None:
      self.set_drafter_params(drafter_params)
    elif engine_cfg.spec is not None:
      raise ValueError("EngineConfig.spec is set but the engine has no drafter_params")
    spec = engine_cfg.spec
    self.selector = selector or (FixedSelector(spec.strategy) if spec else None)
    self.gate = gate  # gate.py: the buckets speculation is measured to pay at (None: all)
    self.history = history  # the host's history index (module docstring), or None
    self._ran: set[int] = set()  # ids of the arm executables run so far (first runs: `_report`)
    arms = ([spec.strategy] + list(getattr(self.selector, "arms", None) or [])) if spec else []
    if history is None and any(Strategy.parse(a).history for a in arms):
      raise ValueError(f"history arms {[a for a in arms if Strategy.parse(a).history]} need a "
                       "history index: Engine(..., history=HistoryIndex(...))")
    self.kv = KVPages(cfg, self.mesh, self._replicated, num_pages=engine_cfg.pool_pages,
                      page_size=engine_cfg.page_size, row_pages=engine_cfg.row_pages)
    self.exes = ExecutableCache()
    self._compiles_reported = 0  # exes.records told to the gate (`_report_compiles`)
    self.compiles = CompilePlan(cfg, engine_cfg, self.exes, self, self._replicated)
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
    if isinstance(params["layers"], (tuple, list)):
      view = local_view(params, self._param_shardings)
      if view is not None and all(x.dtype == dt for x in jax.tree.leaves(view)):
        self.params = view
        return
    self.params = to_replica_layout(params, dt, self._param_shardings)

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
  def _call(self, name: str, variant, fn: Callable, args: tuple, donate=()):
    return self.exes.get(name, variant, fn, args, donate=donate)(*args)

  def _prefill(self, reqs: Sequence[Request], batch: int, base_key, warm: bool,
               kv: KVCache, dkv: KVCache | None, pages: PageAllocator):
    """Prefill of `reqs` into a new state of `batch` rows whose k/v go to the pages `pages`
    holds for them in the pools kv (and the drafter's, dkv: warm, with the drafter's prefill,
    a SpecState); both pools are donated and come back in the state."""
    tokens, lens, src, keys, max_new = prefill_arrays(reqs, batch, base_key, self.ecfg)
    table = self.kv.table(pages, [r.key for r in reqs] + [None] * (batch - len(reqs)))
    cache = kv.replace(table=table, lengths=jnp.zeros((batch,), jnp.int32))
    name, variant, fn, args, donate = self._prefill_call(warm, cache, dkv, tokens, lens, src,
                                                         keys, max_new)
    return self._call(name, variant, fn, args, donate=donate)

  def _prefill_call(self, warm, cache, dkv, tokens, lens, src, keys, max_new):
    """(name, variant, fn, args, donate) of a prefill (concrete or abstract args)."""
    from tlt_jax.rollout import speculative
    mod = speculative if warm else decode
    kw = dict(cfg=self.cfg)
    if warm:
      kw["max_steps"] = self.compiles.max_steps()
    head = (self.params, self.drafter_params, cache, dkv) if warm else (self.params, cache)
    donate = (2, 3) if warm else (1,)
    name = "prefill_spec" if warm else "prefill"
    if src is None:
      return (name, None, functools.partial(mod.prefill, **kw),
              head + (tokens, lens, keys, max_new), donate)
    return (name, "shared", functools.partial(mod.prefill_shared, **kw),
            head + (tokens, lens, src, keys, max_new), donate)

  def prefill_dummy(self, batch: int):
    """What a plain prefill of `batch` distinct one-token rows outputs, abstract (shapes and
    shardings as generate's; the compile plan's shapes): no pool is touched."""
    dummy = [Request([i % self.cfg.vocab_size], i) for i in range(batch)]
    tokens, lens, _, keys, max_new = prefill_arrays(dummy, batch, jax.random.key(0), self.ecfg)
    rows = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._replicated)
    cache = self.kv.abstract(False).replace(table=rows(batch, self.ecfg.row_pages),
                                            lengths=rows(batch))
    name, variant, fn, args, donate = self._prefill_call(False, cache, None, tokens, lens, None,
                                                         keys, max_new)
    return self.exes.abstract_out(name, variant, fn, args, donate=donate)

  def _reach(self, speculating: bool) -> int:
    """Slots past a row's length the next chunk can reach: plain decoding's, or the largest
    of the arms speculation can run."""
    ecfg = self.ecfg
    arms = ([ecfg.spec.strategy] + list(getattr(self.selector, "arms", None) or [])
            if speculating else [None])
    return max(chunk_reach(a, ecfg.chunk_size) for a in arms)

  def _page(self, state, sched: Scheduler, outputs: dict[Any, Output], pages: PageAllocator,
            reach: int):
    """Before a chunk: every live row gets the pages its next chunk can reach; the rows the
    page policy preempts for them (pages.py's `grow_rows`) leave the scheduler, the state and
    the history index. Then the state's page tables are set from the allocator (rows without
    a request: none)."""
    live = {sched.slots[s].key: s for s in sched.live}
    slots = {key: len(sched.slots[s].prompt_ids) + outputs[key].length + reach
             for key, s in live.items()}
    for victim in grow_rows(pages, slots):
      state = self._apply(sched.preempt(live[victim]), state, None, False, pages)
      outputs.pop(victim)
      if self.history is not None:  # decoded again from its prompt later
        self.history.end(victim, keep=False)
      self.preemptions += 1
    table = self.kv.table(pages, [r.key if r is not None else None for r in sched.slots])
    return self._call("set_tables", None, decode.set_tables, (state, table), donate=(0,))

  def _apply(self, op, state, base_key, warm: bool, pages: PageAllocator):
    """A scheduler layout operation on the device state (None before the first prefill);
    warm: the state carries the drafter's (a SpecState). Every op donates the state: its
    page pools pass through in place."""
    if isinstance(op, Prefill):
      return self._prefill(op.requests, op.bucket, base_key, warm, self.kv.take(False),
                           self.kv.take(True) if warm else None, pages)
    if isinstance(op, Resize):
      idx, valid = jnp.asarray(op.idx, jnp.int32), jnp.asarray(op.valid)
      return self._call("take_rows", None, decode.take_rows, (state, idx, valid), donate=(0,))
    if isinstance(op, Refill):
      kv, dkv = decode.pools(state)
      rows = self._prefill(op.requests, op.bucket, base_key, warm, kv, dkv, pages)
      # Padding rows of the prefill go to an out-of-range slot and are dropped.
      slots = np.full((op.bucket,), state.batch_size, np.int32)
      slots[:len(op.slots)] = op.slots
      return self._call("put_rows", None, decode.put_rows,
                        (decode.without_pools(state), rows, jnp.asarray(slots)), donate=(0, 1))
    raise TypeError(f"unknown layout operation {op!r}")

  def _switch_on(self, state, sched: Scheduler, outputs: dict[Any, Output], sp: SamplingParams):
    """Speculation starts: each row's prompt and response so far -> the SpecState, over the
    shortest compiled length that holds them. Returns (state, True), or (state, False) while
    this bucket's executables are still compiling (the chunk decodes plainly)."""
    if not self.compiles.ready(sp, state.batch_size):
      return state, False
    seqs = {row: outputs[req.key].sequence(req, self.ecfg.cache_len)
            for row, req in enumerate(sched.slots[:state.batch_size]) if req is not None}
    length = self.compiles.switch_length(state, max(map(len, seqs.values()), default=1))
    if length is None:
      return state, False
    tokens = np.zeros((state.batch_size, length), np.int32)
    for row, seq in seqs.items():
      tokens[row, :len(seq)] = seq
    tokens = jax.device_put(tokens, self._replicated)
    dkv = self.kv.take(True)
    exe = self.compiles.switch_on(state, length, dpool=dkv)
    return exe(self.params, self.drafter_params, state, dkv, tokens), True

  def _decode(self, state, sp: SamplingParams, arm: str | None, capture: bool, kv_len: int,
              sched: Scheduler):
    """One chunk, and its one host sync. arm=None: plain decoding (before speculation starts:
    a DecodeState, the executables of an engine without a drafter), returning hidden states
    if `capture`; else a strategy on the SpecState (whose executables return them if the
    engine captures at all: speculative chunks run only where the gate opens). kv_len: the
    attention window (CompilePlan.window; the state's caches hold at least that). Returns
    (state, host copies of (ChunkOutput, done [B], stopped [B], [accepted drafts,
    verifications]), whether the arm's executable ran for the first time)."""
    if arm is not None:
      strategy = Strategy.parse(arm)
      exe = self.compiles.spec(sp, arm, state, kv_len)
      first = self._first_run(exe)
      if strategy.history:  # a host loop of steps, the index drafting before each
        rows = {s: sched.slots[s].key for s in sched.live}
        state, host = history_chunk(exe, self.params, self.drafter_params, state, strategy,
                                    self.history, rows, self.ecfg.chunk_size, self._replicated)
        return state, host, first
      state, out, counts = exe(self.params, self.drafter_params, state)
    else:
      ecfg = self.ecfg
      fn = functools.partial(decode.decode_chunk, cfg=self.cfg, sp=sp,
                             stop_tokens=ecfg.stop_tokens, chunk=ecfg.chunk_size,
                             capture_hidden=capture, kv_len=kv_len)
      state, out = self._call("decode", (sp, capture, kv_len), fn, (self.params, state),
                              donate=(1,))
      counts, first = (0, 0), False
    base = state if isinstance(state, decode.DecodeState) else state.base
    return state, jax.device_get((out, base.done, base.stopped, counts)), first

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
    hooks, ecfg = hooks or EngineHooks(), self.ecfg
    selector = selector or self.selector
    spec = ecfg.spec if speculate else None
    # only the training bandit's chunks measure the gate (evaluation samples greedily)
    gate = self.gate if spec is not None and selector is self.selector else None
    if gate is not None:
      gate.begin_rollout(self.worker_id, self.compiles.choosable_pairs())
    # drafter data only while the drafter is to be trained: with a gate, once a probe has
    # shown that drafts can pay on this hardware (where they cannot, the hidden states'
    # transfer and host bookkeeping are pure overhead on every chunk)
    capture = ecfg.capture_hidden and (self.gate is None or self.gate.drafter_wanted())
    if spec is not None:
      self.compiles.rollouts += 1
      if spec.background_compile:
        self.compiles.submit(sp)
    # One batch at or under the threshold from the start (speculation would switch on at the
    # first check): speculate from the first chunk, the drafter prefilled with the prompts
    # (no switch-on forward after a plain prefill)
    at_once = (spec is not None and spec.patience == 1
               and len(requests) <= min(spec.bs_threshold, ecfg.max_batch)
               and self.compiles.ready(sp, ecfg.bucket_for(len(requests))))
    sched = Scheduler(requests, max_batch=ecfg.max_batch, buckets=ecfg.buckets,
                      compaction=ecfg.compaction, bs_threshold=spec.bs_threshold if spec else None,
                      patience=spec.patience if spec else 1, speculating=at_once)
    t_start, base_key = time.perf_counter(), jax.random.key(seed)
    outputs: dict[tuple[int, int], Output] = {}
    results: list[Result] = []
    pages = self.kv.allocator()
    state, started = None, at_once  # started: every chunk from here on speculates
    try:
      while not sched.done:
        state, started = self._chunk(state, started, sched, outputs, results, pages, sp,
                                     base_key, selector, gate, capture, hooks, t_start)
    finally:  # the pools go back to the engine (lost if a device call failed midway)
      self.kv.keep(state)
    return results

  def _chunk(self, state, started: bool, sched: Scheduler, outputs: dict[Any, Output],
             results: list[Result], pages: PageAllocator, sp: SamplingParams, base_key,
             selector, gate, capture: bool, hooks: EngineHooks, t_start: float):
    """One chunk of `generate`: plan -> layout ops -> pages -> switch-on -> arm -> decode ->
    collect -> report. Returns (state, started)."""
    ecfg = self.ecfg
    if hooks.before_chunk:
      hooks.before_chunk()
    reach = self._reach(started or sched.speculating)
    for op in sched.plan(admission(pages, reach)):
      # refills once speculation runs carry the drafter's prefill
      state = self._apply(op, state, base_key, started, pages)
      for r in getattr(op, "requests", ()):
        outputs[r.key] = Output(ecfg.hidden_keep)
        if self.history is not None:
          # siblings and later epochs of a prompt share its history: keyed by the prompt's text
          self.history.begin(tuple(int(t) for t in r.prompt_ids), r.key, r.prompt_ids)
    speculating = sched.check_speculation()
    state = self._page(state, sched, outputs, pages, self._reach(started or speculating))
    live = sched.live
    if speculating and not started:
      state, speculating = self._switch_on(state, sched, outputs, sp)
    started = started or speculating
    arm = None
    if speculating:
      # with a gate, among the arms it paid to compile here; a bucket on probation runs the
      # probed arms
      paid = gate.arms(self.worker_id, state.batch_size) if gate is not None else None
      arm = selector.select(len(live), arms=paid) if paid else selector.select(len(live))
      if gate is not None:
        arm = gate.probe_arm(state.batch_size, arm)
    for s in live if speculating else ():
      outputs[sched.slots[s].key].speculating()
    # the attention window the rows reach this chunk (their pages hold it: `_page`)
    kv_len = self.compiles.window(sp, arm, state, longest_row(sched, outputs)
                                  + chunk_reach(arm, ecfg.chunk_size))
    if arm is not None or gate is not None:
      # the chunk's time is the arm's own (the selector's reward, the gate's rates): what was
      # dispatched before it (a refill's prefill, the page tables) finishes first. Otherwise
      # at batch 1, where every chunk starts a new answer, each reward carried a prefill.
      state = jax.block_until_ready(state)
    compiles, t0 = self.exes.compiled_here(), time.perf_counter()
    state, host, first = self._decode(state, sp, arm, capture, kv_len, sched)  # the host sync
    dt = time.perf_counter() - t0
    # a history chunk extended the index step by step
    extend = self.history is not None and not (arm and Strategy.parse(arm).history)
    produced = self._collect(sched, live, outputs, host, capture, results, hooks, t_start,
                              pages, extend)
    self._report(ChunkMetrics(
        worker_id=self.worker_id, bucket=state.batch_size, live=len(live), tokens=produced,
        steps=int(host[0].steps), wall_time=dt, mode=arm or "plain", accepted=int(host[3][0]),
        verifications=int(host[3][1]), t=time.perf_counter() - t_start,
        compiled=self.exes.compiled_here() != compiles, first_run=first), selector,
        gate, hooks)
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

  def _collect(self, sched: Scheduler, live: list[int], outputs: dict[Any, Output], host,
               capture: bool, results: list[Result], hooks: EngineHooks, t_start: float,
               pages: PageAllocator, extend: bool) -> int:
    """A chunk's tokens into the live rows' outputs (and the history index's, if `extend`);
    finished rows leave the scheduler (and end in the index, kept) and become Results
    (appended, and handed to the hook at once). Returns the tokens produced."""
    out, done, stopped, _ = host
    produced = 0
    for s in live:
      req, v = sched.slots[s], out.valid[s]
      produced += int(v.sum())
      outputs[req.key].append(out.tokens[s][v], out.logprobs[s][v],
                              out.hidden[s][v] if capture and out.hidden is not None else None)
      if extend:
        self.history.extend(req.key, out.tokens[s][v])
      if done[s]:
        sched.finish(s)
        pages.release(req.key)
        if self.history is not None:
          self.history.end(req.key, keep=True)
        res = outputs.pop(req.key).result(req, stopped=bool(stopped[s]), worker_id=self.worker_id,
                                          t=time.perf_counter() - t_start)
        results.append(res)
        if hooks.on_result:
          hooks.on_result(res)
    return produced

  def _report(self, m: ChunkMetrics, selector, gate, hooks: EngineHooks) -> None:
    """A chunk's measurements to the gate and the selector, then to the log and the hook. A
    chunk that compiled its executable reports nothing to either: compile time is not the
    arm's speed (the arm stays untried and is chosen again); nor does an executable's first run
    to the selector (the gate discounts its own warm-up chunks)."""
    if gate is not None:
      self._report_compiles(gate)
      if not m.compiled:
        gate.record(m.bucket, m.arm, m.wall_time, m.steps, m.accepted, m.verifications)
    if m.arm is not None and not (m.compiled or m.first_run):
      # Reward (DESIGN.md 4) = accepted tokens x batch size / wall time of draft + verify
      # (ChunkMetrics.speed). "off" (plain decoding in the spec state: one token per
      # verification) is measured the same way.
      selector.update(m.arm, m.live, m.speed)
    self.chunk_log.append(m)
    if hooks.on_chunk:
      hooks.on_chunk(m)
