"""Host-side rollout engine: one model replica decoding its share of requests in chunks.

An `Engine` is a `Replica` (replica.py: one model replica's weights, KV pools, executables and
the device calls a chunk makes) with a `generate` that only sequences other owners, once per
chunk:

  plan (the pure host `Scheduler`, scheduler.py: which rows to prefill, refill or compact,
  whether this chunk speculates) -> apply its layout ops on the device state -> maybe switch
  speculation on -> pick the arm (the call's bandit, policies/mab.py; a bucket on probation
  runs the gate's probed arm, policies/gate.py) -> decode one chunk of jitted steps (the only
  host sync) -> collect the rows' outputs (records.py) -> report the chunk to the gate and the
  bandit.

The policies are the call's, not the engine's: `generate(..., policies=PolicyCells)` brings
the bandit's and the gate's states in cells its caller owns (policies/cells.py: the
coordinator's for one rollout, shared by its workers) and reads back after. The engine keeps
only what it compiles for: its bandit's config (the arms and their bucket grid).

A call that may speculate (a speculating engine without a gate, or one whose gate opens a
bucket or funds a probe when the call starts: `tracks`) is "tracked": the drafter consumes
its prompts after each prefill (`spec_state.track_prompt`) and each plain chunk's pairs after
it (`spec_state.track`: the hidden states the chunk produced anyway), so speculation switches
on at any chunk at no cost and off where the gate closes a bucket. The target's executables
are the same in every call of a speculating engine (its plain chunks and prefills keep their
hidden states on the device); a call that cannot speculate runs only those. Which
speculative (bucket, arm) executables exist, and when they compile (first use, `precompile`,
a background thread: as a call starts, before each chunk what the gate opened since, and as
a call ends what the next will compile as it starts, `next_call`), is the engine's
`CompilePlan` (compile_plan.py).

Reads and memory follow the rows' live lengths, not the cache's capacity
(max_prompt_len + max_new_tokens). KV memory is one paged pool per replica (`kv_pages` pages
of `page_size` slots, allocated at the first generate and kept until `release_params`: the
engine's `KVPages`, pages.py): a request holds the pages its row has reached plus one chunk's
reach, is admitted only while pages are free, and when a live row's next chunk finds none the
youngest rows are preempted and resumed later: their prompt prefilled, their tokens so far fed
back (pages.py's policy, `Replica._resume`). Each chunk attends over
a window of the rows' slots (`kv_len`, models/kv_cache.py) picked from the longest live
row the host knows of plus what the chunk can add (`chunk_reach`), on the `length_grid`
(prompt_bucket x 2^k). Executables are keyed by window, compiled lazily like batch buckets.

History arms (strategy.py: "hist_<K>", "histtree_<K>_<topk>_<N>") draft from a host index of
earlier text (`history=`: duck-typed, begin/extend/end/draft, rollout/sources/history.py)
instead of the drafter. A call keeps the index current on every chunk, whatever the arm: a row's
prompt when it starts (`begin`), its tokens as they are emitted (`extend`), and `end` when it
finishes (kept: a sibling or a later epoch drafts from it) or is preempted (dropped, and
begun again with its text so far when it is resumed); with a gate, only a call that starts
while speculation's data is wanted (`drafter_wanted`: where drafts cannot pay, feeding it is
host work on every chunk for nothing), and a call that did not feed it begins its live rows
(prompt and tokens so far) the first time a history arm runs. A history arm needs a lookup per
verification, so its chunk is a host loop of single jitted steps (history_chunk.py): draft
every live row, verify, extend.

Hooks (`EngineHooks`, on the engine's thread): each chunk's metrics, each finished response
(rewards start at once; the drafter buffer takes its hidden states), a call before every
chunk (the coordinator pulls newer weights there). Engines run concurrently, each in a
coordinator `Worker`.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.sharding import Mesh

from tlt_jax import watchdog
from tlt_jax.models import ModelConfig, Params
from tlt_jax.rollout import decode, speculative
from tlt_jax.rollout.call import Call, longest_row, rows_apart
from tlt_jax.rollout.plan_call import PlanCall
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.pages import admission, grow_rows
from tlt_jax.rollout.policies import payoff
from tlt_jax.rollout.policies.cells import PolicyCells, Selector
from tlt_jax.rollout.policies.mab import bandit_config
from tlt_jax.rollout.policies.strategy import Strategy
from tlt_jax.rollout.prefill import prompt_problem
from tlt_jax.rollout.records import ChunkMetrics, EngineHooks, Output, Request, Result
from tlt_jax.rollout.replica import Replica
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.scheduler import Scheduler


def engine_arms(spec, bandit: Any = None) -> tuple[Any, frozenset[Strategy]]:
  """(the bandit config an engine compiles for, every arm it may run): the bandits of its
  calls choose among the config's arms on its bucket grid (default: the spec's fixed arm);
  the spec's own arm runs too. (None, {}) without speculation."""
  if spec is None:
    return bandit, frozenset()
  bandit = bandit or bandit_config("fixed", strategy=spec.strategy)
  return bandit, frozenset([spec.strategy, *bandit.arms])


def tracks(spec, gate: Any) -> bool:
  """Whether a call may speculate, so keeps the drafter's cache current from its prefills
  (module docstring): a speculating engine without a gate, or with one that opens a bucket or
  funds a probe as the call starts (`GateState.may_speculate`). A tracked call compiles what
  the gate opens during it (another worker's probe paying) and speculates there in the same
  call; an untracked one, from the worker's next call."""
  return spec is not None and (gate is None or gate.may_speculate())


def chunk_reach(arm: Strategy | None, chunk: int) -> int:
  """Cache slots past the longest row's length that a chunk of plain decoding (arm None) or
  of a speculative arm can read."""
  return (decode.chunk_reach(chunk) if arm is None
          else speculative.chunk_reach(arm, chunk))


class Engine(Replica):
  """One model replica decoding its share of requests; see the module docstring."""

  def __init__(self, params: Params, cfg: ModelConfig, engine_cfg: EngineConfig, *,
               worker_id: int = 0, mesh: Mesh | None = None, drafter_params: Params | None = None,
               bandit: Any = None, history: Any = None):
    super().__init__(params, cfg, engine_cfg, mesh=mesh, drafter_params=drafter_params)
    self.worker_id = worker_id
    spec = engine_cfg.spec
    self.bandit, self.arms = engine_arms(spec, bandit)
    self.history = history  # the host's history index (module docstring), or None
    if history is None and any(a.history for a in self.arms):
      raise ValueError(f"history arms {sorted(a for a in self.arms if a.history)} need a "
                       "history index: Engine(..., history=HistoryIndex(...))")
    self._compiles_reported = 0  # exes.records told to the gate (`_report_compiles`)
    self.chunk_log: list[ChunkMetrics] = []
    self.preemptions = 0  # rows preempted for pages, over the engine's life
    self.preempted_tokens = 0  # the tokens they had decoded (kept: resumed, not redone)

  def _plan(self, gate: Any = None, selector: Any = None) -> PlanCall:
    """The compile plan's view of this engine now (its bandit: the arms compiled; `gate`:
    the call's, None: every bucket open; `selector`: the call's bandit, what it measured)."""
    return PlanCall.view(self.worker_id, self.params, self.drafter_params, self.bandit, gate,
                         self.kv, selector)

  def choosable_pairs(self) -> dict[int, list[Strategy]]:
    """Engine bucket -> the arms the selector can choose there (compile_plan.py)."""
    return self.compiles.choosable_pairs(self._plan())

  def precompile(self, sp: SamplingParams, *, all_pairs: bool = False,
                 policies: PolicyCells | None = None) -> int:
    """Compiles every choosable (bucket, arm) pair now (CompilePlan.precompile; with the
    policies' gate, those it opens); returns the number of new speculative executables."""
    gate = policies.gate if policies is not None else None
    return self.compiles.precompile(self._plan(gate), sp, all_pairs=all_pairs)

  def _reach(self, speculating: bool) -> int:
    """Slots past a row's length the next chunk can reach: plain decoding's, or the largest
    of the arms speculation can run."""
    ecfg = self.ecfg
    arms = self.arms if speculating else [None]
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
      # its Output stays: resumed later from its prompt and these tokens (Replica._resume)
      self.preempted_tokens += c.outputs[victim].length
      if c.history is not None:  # begun again with its text when it is resumed
        c.history.end(victim, keep=False)
      self.preemptions += 1
    table = self.kv.table(c.pages, [r.key if r is not None else None for r in sched.slots])
    return self._call("set_tables", None, decode.set_tables, (state, table), donate=(0,))

  def _feed_history(self, c: Call):
    """The index a history arm drafts from, fed from now on in a call that did not feed it:
    its live rows begin with their prompts and the tokens they have so far. (An engine
    without an index has no history arm; the simulator's draws their acceptance instead.)"""
    if c.history is None and self.history is not None:
      c.history = self.history
      for s in c.sched.live:
        req = c.sched.slots[s]
        c.history.begin(tuple(int(t) for t in req.prompt_ids), req.key, req.prompt_ids)
        for tokens in c.outputs[req.key].tokens:
          c.history.extend(req.key, tokens)
    return c.history

  # ---------------------------------------------------------------------------------- generate
  def validate(self, requests: Sequence[Request]) -> None:
    for r in requests:
      problem = prompt_problem(r.prompt_ids, vocab_size=self.cfg.vocab_size,
                               max_prompt_len=self.ecfg.max_prompt_len)
      if problem:
        raise ValueError(f"request {r.request_id}: {problem}")

  def generate(self, requests: Sequence[Request], sp: SamplingParams, *, seed: int = 0,
               hooks: EngineHooks | None = None, policies: PolicyCells | None = None,
               speculate: bool = True) -> list[Result]:
    """Decodes all requests; returns results in completion order. `policies`: the cells of
    the bandit and the gate this call reads and updates (policies/cells.py: the caller owns
    them and reads their states after; None: a fresh bandit on this engine's arms, no gate).
    Evaluation passes its own bandit and a gate it does not measure (`measure=False`), so
    its chunks never move the training policies. speculate=False decodes plainly, without
    the drafter."""
    self.validate(requests)
    ecfg = self.ecfg
    spec = ecfg.spec if speculate else None
    policies = policies or PolicyCells()
    selector = policies.selector
    if spec is not None and selector is None:
      selector = Selector(self.bandit)
    elif spec is not None and not set(selector.arms) <= self.arms:
      raise ValueError(f"the call's bandit runs {sorted(set(selector.arms) - self.arms)}, "
                       f"which this engine does not (its arms: {sorted(self.arms)})")
    plan = self._plan(policies.gate, selector)
    gate = policies.gate if spec is not None and policies.measure else None
    if gate is not None:
      gate.begin_rollout(self.worker_id, self.compiles.choosable_pairs(plan))
    track = tracks(spec, policies.gate)
    top = self.compiles.call_starts(plan, sp, len(requests), track) if spec else None
    # drafter data and history only while speculation can pay: with a gate, once a probe has
    # shown that drafts can pay on this hardware (where they cannot, the hidden states'
    # transfer and the history's host bookkeeping are pure overhead on every chunk)
    wanted = policies.gate is None or policies.gate.drafter_wanted()
    c = Call(
        sp=sp, base_key=jax.random.key(seed), selector=selector, gate=gate,
        track=track, top=top,
        capture=ecfg.capture_hidden and wanted,
        hooks=hooks or EngineHooks(), t_start=self.clock(), plan=plan,
        sched=Scheduler(requests, max_batch=ecfg.max_batch, buckets=ecfg.buckets,
                        compaction=ecfg.compaction,
                        bs_threshold=ecfg.spec_top if spec else None,
                        patience=spec.patience if spec else 1),
        pages=self.kv.allocator(), history=self.history if wanted else None)
    state, started = None, False  # started: every chunk from here on speculates
    try:
      while not c.sched.done:
        state, started = self._chunk(state, started, c)
      if gate is not None and top is not None:  # (while the learner's phases run)
        self.compiles.next_call(self._plan(gate.next_rollout(), selector), sp, top, c)
    finally:  # the pools go back to the engine (lost if a device call failed midway)
      self.kv.keep(state)
    return c.results

  def _chunk(self, state, started: bool, c: Call):
    """One chunk of `generate`: plan -> layout ops -> pages -> switch-on -> arm -> decode ->
    collect -> report. Returns (state, started)."""
    ecfg, sched, gate = self.ecfg, c.sched, c.gate
    if c.hooks.before_chunk:
      c.hooks.before_chunk()
    if gate is not None and c.top is not None:
      # the buckets a verdict opened since (a probe that paid on another worker): their arms
      # compile in this call, not from the worker's next (a no-op when nothing is new), up to
      # the batch's bucket once every request is admitted (it only shrinks from there)
      top = c.top if state is None or sched.pending else min(state.batch_size, c.top)
      self.compiles.submit(c.plan, c.sp, top, paying=True)
    live = 0 if sched.pending else len(sched.live)  # (rows waiting: no compaction)
    # (only once switch-off is compiled: a leave queueing it went before every arm's compile
    # not started, the 32B recipe's tail arms a compile later at a per-draft 0.3)
    leaving = (started and gate is not None and state is not None
               and self.compiles.switch_off_ready(c.plan, state)
               and self.compiles.leaves(c.plan, c.sp, state.batch_size, live))
    if started and gate is not None and state is not None and (
        leaving or not gate.allows(self.worker_id, state.batch_size)):
      # the gate closed this bucket since the batch switched on (a probe here declined, or
      # probation moved on), or its rows are better off decoding plainly at a smaller bucket
      # (`leaves`): it decodes plainly, compacting, and switches on again where it may
      state, started = self._switch_off(state, c), False
    sched.compacts_to = (None if state is None else self.compiles.compaction(
        c.plan, c.sp, state.batch_size, started=started, tracked=c.track,
        wants=sched.speculating, live=live))
    reach = self._reach(started or sched.speculating)
    for op in rows_apart(sched.plan(admission(c.pages, reach, c.text_len)), c,
                         ecfg.bucket_for):
      # a tracked call's prefills carry the drafter's; a preempted request's its tokens so far
      state = self._apply(op, state, c, c.track)
      for r in getattr(op, "requests", ()):
        c.prefilled(r)
        if not c.done(r):  # (a resumed one keeps its Output)
          c.outputs[r.key] = Output(ecfg.hidden_keep)
        if c.history is not None:
          # siblings and later epochs of a prompt share its history: keyed by the prompt's text
          c.history.begin(tuple(int(t) for t in r.prompt_ids), r.key, r.prompt_ids)
          for tokens in c.outputs[r.key].tokens:
            c.history.extend(r.key, tokens)
    speculating = sched.check_speculation()
    state = self._page(state, c, self._reach(started or speculating))
    live = sched.live
    if speculating and not started:
      # a tracked call's batch (its drafter's cache current) once its bucket's executables
      # are compiled and, on probation, its first rows have finished (`defers`)
      speculating = c.track and self.compiles.ready(c.plan, c.sp, state.batch_size) and not (
          gate is not None and gate.defers(state.batch_size, len(live)))
    if (started or speculating) and gate is not None and gate.closes(state.batch_size):
      self.compiles.switch_off_ahead(c.plan, state)  # (its bucket may close meanwhile)
    # the attention window the rows reach this chunk (their pages hold it: `_page`)
    longest = longest_row(sched, c.outputs)
    held = sum(len(r.prompt_ids) + c.outputs[r.key].length for r in sched.slots if r is not None)
    reach_of = lambda a: longest + chunk_reach(a, ecfg.chunk_size)  # noqa: E731
    arm, spent = None, []
    if speculating:
      # with a gate, among the arms it paid to compile here; a bucket on probation runs the
      # probed arms
      paid = gate.arms(self.worker_id, state.batch_size) if gate is not None else None
      if paid is None:
        arm = c.selector.select(len(live))
      else:  # (none named: a gate that allows the bucket without funding arms there) the
        # arm the policies want (the bandit's, a probe's) if it runs without a compile:
        # compiled over the whole cache, or at a window that fits the rows; else it compiles
        # at the rows' window (in the background) and one that runs is chosen meanwhile.
        # A probed arm measured losing gives way (gate.gives_way): with nothing else to run,
        # the chunk decodes plainly while the probe's other arms compile
        paid = paid or sorted(self.arms)
        arm = gate.probe_arm(state.batch_size, c.selector.select(len(live), arms=paid))
        have = self.compiles.compiled_arms(c.sp, state.batch_size, paid)
        have += [a for a in paid if a not in have and self.compiles.fits(
            c.plan, c.sp, a, state, reach_of(a))]
        spent = [a for a in have if gate.gives_way(state.batch_size, a)]
        have = [a for a in have if a not in spent]
        if arm not in have:
          if arm not in spent:
            self.compiles.want(c.plan, c.sp, arm, state, reach_of(arm),
                               urgent=not have or gate.probes(state.batch_size))
          if have:
            arm = gate.probe_arm(state.batch_size, c.selector.select(len(live), arms=have),
                                 among=have)
          elif spent:
            arm = None
        paid = [a for a in (have or paid) if a not in spent]
    kv_len = self.compiles.window(c.plan, c.sp, arm, state, reach_of(arm))
    if gate is not None and (arm is None and speculating or arm is not None and not (
        self.compiles.fits(c.plan, c.sp, arm, state, reach_of(arm)))):
      # the arm's compiled window is so much wider than its rows' that it would read more
      # than its drafts save (the gate's rule; `window` queued the rows' own), or every arm
      # that runs here gave way: another arm that fits, else the chunk decodes plainly (a
      # speculating batch switches off first)
      fit = [a for a in (paid or sorted(self.arms)) if a not in spent
             and self.compiles.fits(c.plan, c.sp, a, state, reach_of(a))]
      if fit or not started or self.compiles.switch_off_ready(c.plan, state):
        if fit:
          arm = gate.probe_arm(state.batch_size, c.selector.select(len(live), arms=fit),
                               among=fit)
        else:
          if started:
            state = self._switch_off(state, c)
          arm, speculating, started = None, False, False
        kv_len = self.compiles.window(c.plan, c.sp, arm, state, reach_of(arm))
      else:  # (it keeps its arm this chunk, a losing one if that is all; the next may
        self.compiles.switch_off_ahead(c.plan, state)  # switch off)
        if arm is None:
          arm = spent[0]
          kv_len = self.compiles.window(c.plan, c.sp, arm, state, reach_of(arm))
    need = reach_of(arm)
    started = started or speculating
    if c.track and arm is None:  # the drafter's tracking here and at the next bucket down
      self.compiles.track_ahead(c.plan, state.batch_size)
    elif arm is None:
      c.plain_at.add(state.batch_size)
    for s in live if speculating else ():
      c.outputs[sched.slots[s].key].speculating()
    if arm is not None or gate is not None:
      # the chunk's time is the arm's own (the selector's reward, the gate's rates): what was
      # dispatched before it (a refill's prefill, the page tables) finishes first. Otherwise
      # at batch 1, where every chunk starts a new answer, each reward carried a prefill.
      state = self._sync(state)
    if arm is not None and arm.history:
      self._feed_history(c)  # (a history arm drafts from the index: fed from now on)
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
        compiled=self.exes.compiled_here() != compiles, first_run=first,
        read=self._read(c, state.batch_size, kv_len if not ecfg.paged_attention else None,
                        held),
        wide=kv_len > ecfg.window_for(need)), c)
    return state, started

  def _read(self, c: Call, batch: int, kv_len: int | None, held: int) -> float:
    """Bytes a step of a chunk reads, what the gate fits its time to (probe.plain_step): the
    weights and the KV attended over (paged, kv_len None: the live rows' `held` slots; the
    windows: every row's window). Only with a gate. (docs/scale.md: counting the bucket's
    rows' windows made the fit noise in a batch holding finished rows.)"""
    if c.gate is None:
      return 0.0
    if kv_len is None:
      return self.compiles.step_bytes(c.plan, 1, held)
    return self.compiles.step_bytes(c.plan, batch, kv_len)

  def _report_compiles(self, gate) -> None:
    """This engine's compiles since the last report (background ones too) to the gate, which
    prices what speculation would compile by them (payoff.py): plain decode chunks, an arm's
    speculative chunk, a bucket's one-off speculative compiles (the drafter's tracking,
    switch-off)."""
    records = self.exes.records[self._compiles_reported:]
    self._compiles_reported += len(records)
    for r in records:
      kind = payoff.KIND.get(r.name)
      if kind is not None:
        gate.compiled(kind, r.batch, r.key.variant[0] if kind == payoff.SPEC else None,
                      r.compile_s)

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
        gate.record(m.bucket, m.arm, m.wall_time, m.steps, m.accepted, m.verifications,
                    live=m.live, read=m.read, wide=m.wide)
    if m.arm is not None and not (m.compiled or m.first_run) and c.selector.learns(m.arm, m.live):
      # Reward = tokens per verification x steps / wall time of draft + verify, per live row
      # (ChunkMetrics.row_speed). "off" (plain decoding in the spec state: one token per
      # verification) is measured the same way. (Not a probe's arm outside the bandit's.)
      c.selector.update(m.arm, m.live, m.row_speed)
    self.chunk_log.append(m)
    watchdog.beat()  # progress (a run that stops making any ends: watchdog.py)
    if hooks.on_chunk:
      hooks.on_chunk(m)
