"""The coordinator: long-lived rollout workers, their states, weight sync and spot training.

Each `Worker` is one model replica (a rollout `Engine`, rollout/engine.py, on one device or
a tensor-parallel sub-mesh) with its own long-lived thread that runs commands: generate a share of a
rollout, train its drafter copy, take new weights from the `ParamStore`. The `Coordinator`
drives one rollout per RL step:

  1. every worker pulls the newest actor/drafter from the store, then GENERATES its share
     (whole prompt groups stay on one worker); finished responses go to the reward hook and,
     windowed, to the drafter buffer (no extra forward: the engine captured their hidden
     states);
  2. a worker whose share is done is IDLE; with spot training it turns to TRAINING at once:
     drafter steps on its own devices from the buffer (tlt_jax/coordinator/spot.py);
  3. when the last worker finishes (the barrier) every worker stops: an in-flight drafter step
     finishes or is dropped; the copies trained on different workers are merged (weighted by
     the tokens each trained on), published to the store and pushed to every worker before
     the next rollout. With `overlap_settle` (one process, one-device workers) the rollout
     hands its results back at the barrier: the in-flight steps (and a lone worker's
     training) run on beside the learner's phases (the learner never reads the drafter),
     and the caller's `settle()` waits for them, then merges and pushes on its own thread
     before the next weights go out; only that counts on the critical path. The merge and
     the push run where the learner's programs are dispatched, never beside them: two
     threads launching programs with collectives over the same devices can deadlock (XLA:CPU
     gang-schedules one multi-device launch at a time from a fixed pool; NCCL orders each
     device's stream as its launches arrive), so nothing beside the learner spans devices.

The learner never sees a worker: it publishes its params to the store, and `sync_actor`
pushes them. The timeline of states (tlt_jax/coordinator/timeline.py) gives the step's idle
time, the share of it spent training, and the drafter's time on the critical path.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import threading
import time
from typing import Any, Callable, Sequence

import jax

from tlt_jax.coordinator.param_store import ParamStore
from tlt_jax.coordinator.spot import SpotConfig, SpotReport, train_until
from tlt_jax.coordinator.timeline import Timeline, WorkerState
from tlt_jax.rollout.policies.cells import Policies, PolicyCells


class Worker:
  """A rollout replica and its drafter trainer, driven by commands on one long-lived thread.
  engine: a rollout `Engine` (or anything with `worker_id`, `generate`, `set_params`,
  `set_drafter_params`, `params`); trainer: a drafter.trainer.DrafterTrainer or None
  (drafter frozen)."""

  def __init__(self, engine: Any, trainer: Any = None):
    self.engine, self.trainer = engine, trainer
    self.id = engine.worker_id
    self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix=f"rollout-worker-{self.id}")
    # The store's versions this worker holds; -1: none yet (the first pull takes everything).
    self.actor_version = -1
    self.drafter_version = -1

  def submit(self, fn: Callable, *args, **kw) -> cf.Future:
    return self._thread.submit(fn, *args, **kw)

  def pull(self, store: ParamStore) -> bool:
    """Takes what is newer in the store onto this worker's devices; True if anything was."""
    changed = False
    if store.actor_version != self.actor_version:
      version, params = store.actor()
      if params is not None:  # None: released until the next sync
        self.actor_version = version
        self.engine.set_params(params)
        changed = True
    if store.drafter_version != self.drafter_version:
      self.drafter_version, state = store.drafter()
      if state is not None:
        self.engine.set_drafter_params(state.params)
        if self.trainer is not None:
          self.trainer.load(state)
      changed = True
    return changed

  def release_actor(self) -> None:
    """Frees this worker's actor copy; the next `pull` takes the store's again."""
    self.engine.release_params()
    self.actor_version = -1

  def close(self) -> None:
    self._thread.shutdown(wait=True)


@dataclasses.dataclass
class RolloutOutcome:
  results: list  # engine Results, sorted by (request_id, sample_index)
  chunks: list  # ChunkMetrics of every worker, in completion order
  wall: float  # seconds until the barrier (the last worker's share done)
  timeline: Timeline
  # -> the step's spot training metrics (None: not on) once the drafter is settled: merged
  # and on every worker (waits for it; the wait is the drafter's on the critical path)
  settle: Callable[[], dict[str, Any] | None]
  policies: Any = None  # the policies' states after the rollout (cells.Policies)

  @property
  def drafter(self) -> dict[str, Any] | None:
    return self.settle()


class Coordinator:
  """See the module docstring. `merge(states, weights) -> state` combines trained drafter
  copies onto the store's layout (tlt_jax/drafter/merge.py `make_merge`); `buffer` (a
  DrafterBuffer, the trainers' data) takes every finished response's captured hidden states;
  `on_response(worker, result)` is called on the worker's thread for every finished response
  after that (rewards)."""

  def __init__(self, workers: Sequence[Worker], store: ParamStore, *,
               spot: SpotConfig = SpotConfig(mode="off"),
               merge: Callable[[list, list], Any] | None = None,
               worker_ids: Sequence[int] | None = None, num_workers: int | None = None,
               to_rollout: Callable[[Any], Any] | None = None,
               gather: Callable[[Any], list] | None = None,
               global_barrier: Callable[..., Any] | None = None,
               verdicts: Any = None, overlap_settle: bool = False, buffer: Any = None):
    """worker_ids / num_workers: the global indices of these (this process's) workers among
    all replicas (default: 0..n-1 of n); a worker decodes the requests whose request_id %
    num_workers is its index. to_rollout: learner params -> the rollout layout the store
    keeps (default: as given). gather: obj -> [obj of every process] (multi-process metrics
    and drafter merge; default: this process only). With several processes `merge(states,
    weights)` is called in every process with all of this process's copies and their tokens
    (0: not trained) and returns the global merge, or None when nothing was trained; and
    `global_barrier(name, on_all=...)` (distributed.GlobalBarrier) makes idle workers train
    until every process's replicas are done. verdicts: the speculation gate's cache of
    hardware verdicts (policies/verdicts.py; None: none), which each rollout's gate cell reads
    and writes.
    overlap_settle: hand the results back at the barrier and settle the drafter (in-flight
    steps' end, merge, push) when the caller asks (module docstring); one process only
    (across processes the merge is a collective, which must keep its place in every
    process's order), and only with workers whose drafter steps are one-device programs
    (they run beside the learner's)."""
    if not workers:
      raise ValueError("Coordinator: no workers")
    self.workers, self.store, self.spot, self.merge = list(workers), store, spot, merge
    self.worker_ids = list(worker_ids) if worker_ids is not None else list(range(len(workers)))
    self.num_workers = num_workers or len(self.workers)
    self.to_rollout = to_rollout
    self.gather = gather or (lambda obj: [obj])
    self.global_barrier = global_barrier
    self.verdicts = verdicts
    self.buffer = buffer
    self._rollouts = 0  # advances in lockstep in every process: names the global barriers
    self._last_barrier = None
    if overlap_settle and global_barrier is not None:
      raise ValueError("overlap_settle: one process only (the merge is a collective)")
    self.overlap_settle = overlap_settle
    self._settling: Callable[[], Any] | None = None  # the last rollout's, until it settles
    self._lone_stop = threading.Event()  # stops a lone worker's training (`rollout`)
    if spot.mode != "off" and any(w.trainer is None for w in self.workers):
      raise ValueError(f"spot mode {spot.mode!r} needs a drafter trainer on every worker")

  @property
  def engines(self) -> list:
    return [w.engine for w in self.workers]

  # ---------------------------------------------------------------------------- rollout
  def rollout(self, requests: Sequence[Any], sp: Any, *, seed: int, step: int = 0,
              on_response: Callable[[Worker, Any], None] | None = None,
              on_chunk: Callable[[Any], None] | None = None,
              policies: Policies = Policies(), release_actor: bool = False) -> RolloutOutcome:
    """Decodes `requests` over the workers (module docstring); `step` (the RL step) labels
    the drafter data the responses leave in the buffer. `policies`: the bandit's and the
    gate's states the rollout starts from; the workers share them in cells for its duration
    (policies/cells.py) and the outcome carries the states they end in. A gate that wants no
    drafter data (every bucket declined for hardware) pauses spot training for the rollout.
    release_actor: every worker frees its actor copy once its share and its in-flight
    drafter step are done (the learner's phases get that memory back;
    memory.release_rollout_weights), before the results are handed back."""
    from tlt_jax.rollout.records import EngineHooks
    n = len(self.workers)
    every = split(requests, self.num_workers)  # another process's requests are its workers'
    shares = [every[g] for g in self.worker_ids]
    if self._settling is not None:  # the last rollout's drafter first (its caller settles it)
      self._settling()
    timeline = Timeline(n)
    barrier = threading.Event()  # this process's workers are done
    generated = [cf.Future() for _ in range(n)]  # each worker's results, at its share's end
    lock = threading.Lock()
    remaining = [n]
    spot = self.spot.mode == "spot"
    # paused: idle workers wait; every process still joins the merge (its copies: 0 tokens)
    train = spot and (policies.gate is None or policies.gate.drafter_wanted())
    cells = PolicyCells.of(policies, verdicts=self.verdicts)
    if train:  # (a deferred compile of the drafter step overlaps the generation)
      for w in self.workers:
        w.trainer.prepare()
    chunks: list[Any] = []
    self._rollouts += 1
    if self._last_barrier is not None:  # every process passed it (collectives since): drop it
      self._last_barrier.forget()
      self._last_barrier = None
    everywhere = None  # every process's workers are done (several processes, spot training)
    if self.global_barrier is not None and spot:
      everywhere = self.global_barrier(f"rollout-{self._rollouts}", on_all=timeline.mark_barrier)
      self._last_barrier = everywhere
    stop = barrier if everywhere is None else everywhere.event  # spot training until then
    # A lone worker (one device) has no idle window before the barrier: it is the barrier.
    # Its idle window is the learner's phases, so with the settling overlapped it trains
    # until the caller settles (after the update), beside the learner on the same devices.
    lone = (train and self.num_workers == 1 and self.overlap_settle and not release_actor)
    learner_done = self._lone_stop = threading.Event()
    if lone:
      stop = learner_done

    # drafter data: a response whose hidden states were all kept waits for its prompt's
    # (one forward over the worker's prompts once its share is done), the context its first
    # window is trained with (tlt_jax/drafter/buffer.py); others go to the buffer at once
    with_prompt = self.buffer is not None and self.buffer.cfg.context > 0
    waiting: list[list[Any]] = [[] for _ in range(n)]

    def to_buffer(res: Any, prompt_hidden=None) -> None:
      off = res.hidden_offset  # (the response's positions whose hidden states were kept)
      tail = None if res.spec_start is None else res.spec_start - off
      self.buffer.add(step, res.response_ids[off:], res.hidden, tail,
                      key=(res.request_id, res.sample_index),
                      prompt_ids=res.prompt_ids if prompt_hidden is not None else (),
                      prompt_hidden=prompt_hidden)

    def on_result(i: int, res: Any) -> None:
      if self.buffer is not None and res.hidden is not None:
        if with_prompt and res.hidden_offset == 0:
          waiting[i].append(res)
        else:
          to_buffer(res)
      if on_response is not None:
        on_response(self.workers[i], res)

    def work(i: int):
      w = self.workers[i]
      timeline.enter(i, WorkerState.GENERATING)
      try:
        hooks = EngineHooks(
            on_result=lambda res: on_result(i, res),
            on_chunk=lambda c: (chunks.append(c), on_chunk and on_chunk(c)),
            before_chunk=lambda: w.pull(self.store))
        w.pull(self.store)
        with jax.profiler.TraceAnnotation(f"worker {i}: generating"):  # (a trace's timeline)
          results = w.engine.generate(shares[i], sp, seed=seed, hooks=hooks, policies=cells)
        if waiting[i]:
          states = w.engine.prompt_hidden([r.prompt_ids for r in waiting[i]])
          for res, h in zip(waiting[i], states):
            to_buffer(res, h)
        generated[i].set_result(results)
      except BaseException as e:
        generated[i].set_exception(e)
        raise
      finally:
        timeline.enter(i, WorkerState.IDLE)
        with lock:
          remaining[0] -= 1
          if remaining[0] == 0:
            if everywhere is None:
              timeline.mark_barrier()
            else:
              everywhere.arrive()
            barrier.set()
      report = None
      if train:
        w.trainer.reseed([seed, self.worker_ids[i]])
        if not stop.is_set():
          report = train_until(w.trainer, stop, on_barrier=self.spot.on_barrier,
                               timeline=timeline, worker=i, poll_s=self.spot.poll_s)
      else:
        stop.wait()  # idle until the last worker is done (the straggler wait, measured)
      timeline.enter(i, WorkerState.DONE)
      if release_actor:  # on its own thread, nothing of the actor in flight any more
        w.release_actor()
      return report  # (its results are in `generated`: a settle yet to run holds none)

    futures = [w.submit(work, i) for i, w in enumerate(self.workers)]

    def finish() -> list:  # every worker's share and in-flight drafter step done
      reports = [f.result() for f in futures]  # re-raises a worker's error on this thread
      if everywhere is not None:
        everywhere.close()
      if release_actor:  # (before any push: a pull must not take the actor back)
        self.store.release_actor()
      return reports

    def settle(reports: list) -> dict[str, Any] | None:  # merged, published, on every worker
      drafter = self._merge_and_push(reports) if spot else None
      timeline.mark_released()
      timeline.close()
      return drafter

    # (the results reach the caller only through the outcome: what settles later holds the
    # reports, so the Results' hidden states go when the caller drops the outcome)
    if not self.overlap_settle:
      drafter = settle(finish())
      shares_done = [g.result() for g in generated]
      timeline.mark_returned()
      waiter = lambda: drafter
    else:  # the workers' in-flight steps run on beside the learner; the caller settles
      if release_actor:  # the learner needs the actor's memory: the workers finish first
        job = functools.partial(settle, finish())
        shares_done = [g.result() for g in generated]
      else:  # results at the barrier
        cf.wait(generated)  # (a worker's error is raised once every share is done)
        shares_done = [g.result() for g in generated]
        job = lambda: settle(finish())
      timeline.mark_returned()
      waiter = self._settling = _deferred(job, timeline, before=learner_done.set,
                                          after=self._settled)
    generated.clear()  # (a lone worker's `work`, training on, holds the list: not the Results)
    results = sorted((r for res in shares_done for r in res),
                     key=lambda r: (r.request_id, r.sample_index))
    return RolloutOutcome(results, chunks, timeline.barrier or 0.0, timeline, waiter,
                          cells.states())

  # --------------------------------------------------------------------------- drafter
  def _merge_and_push(self, reports: Sequence[SpotReport | None]) -> dict[str, Any]:
    """Merges the drafter copies that trained this step, publishes, pushes to all."""
    per_worker = [w.trainer.take_metrics() for w in self.workers]
    tokens = [sum(m["tokens"] for m in ms) for ms in per_worker]
    flat = [m for ms in per_worker for m in ms]
    mine = {"steps": len(flat), "tokens": int(sum(tokens)),
            "dropped": sum(r.dropped for r in reports if r is not None),
            "workers_trained": sum(t > 0 for t in tokens),
            "loss": sum(m["loss"] * m["tokens"] for m in flat),
            "acc": sum(m["acc"] * m["tokens"] for m in flat)}
    every = self.gather(mine)  # one dict per process
    out: dict[str, Any] = {k: sum(p[k] for p in every)
                           for k in ("steps", "tokens", "dropped", "workers_trained")}
    if out["steps"]:
      total = max(out["tokens"], 1.0)
      out["loss"] = sum(p["loss"] for p in every) / total
      out["acc"] = sum(p["acc"] for p in every) / total
    trained = [i for i, t in enumerate(tokens) if t > 0]
    if len(every) > 1:  # every process takes part, with every copy (untrained: 0 tokens)
      merged = self.merge([w.trainer.state for w in self.workers], tokens)
    elif not trained:
      return out
    else:
      states = [self.workers[i].trainer.state for i in trained]
      merged = self.merge(states, [tokens[i] for i in trained]) if self.merge else states[0]
    if merged is not None:
      self.store.publish_drafter(merged)
      self.push()
    return out

  def train_serial(self, steps: int, seed: int = 0) -> dict[str, Any]:
    """`steps` drafter steps on worker 0 from the buffer, after the policy update (the
    'serial' ablation: on the critical path), then publish and push."""
    w = self.workers[0]

    def run() -> SpotReport:
      w.pull(self.store)
      w.trainer.reseed([seed, 1 << 20])  # apart from every rollout worker's stream
      return train_until(w.trainer, threading.Event(), max_steps=steps, poll_s=self.spot.poll_s)

    rep = w.submit(run).result()
    return self._merge_and_push([rep])

  def push(self) -> None:
    """Every worker takes what is newer in the store (in parallel, on its own thread)."""
    for f in [w.submit(w.pull, self.store) for w in self.workers]:
      f.result()

  # ----------------------------------------------------------------------------- actor
  def sync_actor(self, params: Any) -> float:
    """Publishes new actor params and pushes them into every worker's layout (device to
    device); returns the seconds until every copy is in place."""
    import jax
    t0 = time.perf_counter()
    self.store.publish_actor(self.to_rollout(params) if self.to_rollout else params)
    self.push()
    for w in self.workers:
      jax.block_until_ready(w.engine.params)
    return time.perf_counter() - t0

  def release_actors(self) -> None:
    """Every worker frees its actor copy now, as a rollout with `release_actor` does at its
    end, for a rollout that did not (one of a step's several: grpo.filter_groups): on its own
    thread, after its share and its in-flight drafter step (a lone worker's training stops
    here, as it would not have started with release_actor). The drafter still settles when
    the caller asks (the merge's push takes no actor: the store's is released)."""
    self._lone_stop.set()
    for f in [w.submit(w.release_actor) for w in self.workers]:
      f.result()
    self.store.release_actor()  # (after the workers': a pull must not take it back)

  def _settled(self) -> None:
    self._settling = None

  def close(self) -> None:
    self._lone_stop.set()  # (an unsettled rollout's workers stop; nothing is merged)
    for w in self.workers:
      w.close()


def merge_spot_metrics(parts: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
  """The drafter metrics of a step's rollouts (`_merge_and_push`'s, each; None: spot training
  off) -> the step's: counts summed, the workers that trained the most of any rollout's, the
  loss and accuracy weighted by the tokens."""
  parts = [p for p in parts if p is not None]
  if len(parts) <= 1:
    return parts[0] if parts else None
  out: dict[str, Any] = {k: sum(p[k] for p in parts)
                         for k in ("steps", "tokens", "dropped")}
  out["workers_trained"] = max(p["workers_trained"] for p in parts)
  trained = [p for p in parts if p["steps"]]
  if trained:
    total = max(sum(p["tokens"] for p in trained), 1.0)
    for k in ("loss", "acc"):
      out[k] = sum(p[k] * p["tokens"] for p in trained) / total
  return out


def split(requests: Sequence[Any], num_workers: int) -> list[list[Any]]:
  """Every worker's share of a rollout's requests (global worker ids): request_id modulo the
  workers, so a GRPO group stays on one worker (its prompt prefilled once there)."""
  out: list[list[Any]] = [[] for _ in range(num_workers)]
  for r in requests:
    out[r.request_id % num_workers].append(r)
  return out


def _deferred(job: Callable[[], Any], timeline: Timeline, *,
              before: Callable[[], Any], after: Callable[[], Any]) -> Callable[[], Any]:
  """settle() of an overlapped rollout, on the caller's thread: calls `before` (a lone
  worker's training stops), runs `job` once (the workers' in-flight steps end, merge, push;
  its seconds go to the timeline's critical path), then `after`; returns its metrics, or
  raises its error, on every call."""
  done: list = []

  def settle():
    if not done:
      before()
      t = time.perf_counter()
      try:
        done.append((job(), None))
      except BaseException as e:
        done.append((None, e))
      finally:
        timeline.add_wait(time.perf_counter() - t)
        after()
    value, error = done[0]
    if error is not None:
      raise error
    return value
  return settle
