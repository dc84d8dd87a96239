"""The coordinator's state machine (idle -> training -> stopped at the rollout barrier, finish
vs drop, merge, push) driven by fake workers without JAX, with timings asserted against the
fakes' own schedule; then real rollout workers on two devices: the same results as one
worker, and the merged drafter on every worker."""

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from tlt_jax.coordinator import (Coordinator, ParamStore, SpotConfig, Timeline, Worker,
                                 WorkerState, train_until)


# ------------------------------------------------------------------------------------ fakes
@dataclasses.dataclass
class FakeRequest:
  request_id: int
  seconds: float  # how long the fake engine "decodes" it
  sample_index: int = 0


@dataclasses.dataclass
class FakeResult:
  request_id: int
  sample_index: int


@dataclasses.dataclass
class FakeState:
  params: float  # the fake drafter's one weight (ParamStore-compatible: `.params`)
  steps: int = 0


class FakeEngine:
  def __init__(self, worker_id, fail=False):
    self.worker_id, self.fail = worker_id, fail
    self.params = None
    self.drafter_params = None

  def generate(self, share, sp, *, seed, hooks, policies=None):
    self.policies = policies  # (the cells of the rollout's policies it was handed)
    out = []
    for r in share:
      if hooks.before_chunk:
        hooks.before_chunk()
      time.sleep(r.seconds)
      if self.fail:
        raise RuntimeError(f"worker {self.worker_id} broke")
      res = FakeResult(r.request_id, r.sample_index)
      out.append(res)
      if hooks.on_result:
        hooks.on_result(res)
    return out

  def set_params(self, params):
    self.params = params

  def release_params(self):
    self.params = None

  def set_drafter_params(self, params):
    self.drafter_params = params


class FakeTrainer:
  """A drafter step takes `step_s` (or the next of a list of them; the last repeats) and adds
  `lr` to the weight; `tokens` per step."""

  def __init__(self, step_s=0.02, tokens=100, lr=1.0, has_data=True):
    self.steps_s = list(step_s) if isinstance(step_s, (list, tuple)) else [step_s]
    self.tokens, self.lr = tokens, lr
    self.has_data = has_data
    self.state = None
    self.metrics = []
    self.discarded = 0

  def prepare(self):
    self.prepared = True

  def reseed(self, seed):
    self.seed = seed

  def next_batch(self):
    return object() if self.has_data else None

  def dispatch(self, batch):
    step_s = self.steps_s.pop(0) if len(self.steps_s) > 1 else self.steps_s[0]
    return (time.perf_counter() + step_s,
            FakeState(self.state.params + self.lr, self.state.steps + 1))

  def ready(self, inflight):
    return time.perf_counter() >= inflight[0]

  def commit(self, inflight):
    self.state = inflight[1]
    self.metrics.append({"loss": 1.0, "acc": 0.5, "tokens": float(self.tokens)})

  def discard(self, inflight):
    self.discarded += 1

  def take_metrics(self):
    out, self.metrics = self.metrics, []
    return out

  def load(self, state):
    self.state = state


def average(states, weights):
  total = sum(weights)
  return FakeState(sum(s.params * w for s, w in zip(states, weights)) / total,
                   max(s.steps for s in states))


def make(n, *, spot="spot", on_barrier="finish", trainers=None, fail=(), overlap=False):
  trainers = trainers or [FakeTrainer() for _ in range(n)]
  workers = [Worker(FakeEngine(i, fail=i in fail), trainers[i]) for i in range(n)]
  store = ParamStore(actor="actor-v0", drafter=FakeState(0.0))
  c = Coordinator(workers, store, spot=SpotConfig(mode=spot, on_barrier=on_barrier,
                                                  poll_s=0.001), merge=average,
                  overlap_settle=overlap)
  c.push()
  return c, store, trainers


def shares(*seconds):
  """One request per worker (request_id i goes to worker i of len(seconds))."""
  return [FakeRequest(i, s) for i, s in enumerate(seconds)]


# ------------------------------------------------------------------------------------ tests
def test_idle_worker_trains_until_the_barrier_and_the_last_one_never_idles():
  c, store, trainers = make(2)
  out = c.rollout(shares(0.05, 0.5), sp=None, seed=0)
  s = out.timeline.summary()
  per = {p["worker"]: p for p in s["per_worker"]}
  # the barrier: the slower worker's share (a loaded machine's sleeps overshoot, never fall short)
  assert 0.49 <= out.wall < 0.9, out.wall
  assert 0.35 < per[0]["idle_s"] <= out.wall, (per[0], out.wall)
  assert per[0]["training_s"] > 0.9 * per[0]["idle_s"]
  assert per[1]["idle_s"] < 0.02 and per[1]["training_s"] == 0
  assert s["idle_share_trained"] > 0.9
  states = [iv.state for iv in out.timeline.intervals if iv.worker == 0]
  assert states[:3] == [WorkerState.GENERATING, WorkerState.IDLE, WorkerState.TRAINING]
  # ~0.45 s of 20 ms steps on worker 0 (never more than its training time holds), none on
  # worker 1; the merge is worker 0's copy
  assert 10 <= out.drafter["steps"] <= per[0]["training_s"] / 0.02 + 1, (out.drafter, per[0])
  assert out.drafter["workers_trained"] == 1
  version, merged = store.drafter()
  assert version == 1 and merged.params == out.drafter["steps"] * 1.0  # +1 per step
  assert [w.engine.drafter_params for w in c.workers] == [merged.params] * 2
  assert [t.state.params for t in trainers] == [merged.params] * 2  # pushed to both


@pytest.mark.parametrize("on_barrier", ["finish", "drop"])
def test_in_flight_step_at_the_barrier_is_finished_or_dropped(on_barrier):
  """A 0.1 s drafter step then a 1 s one on worker 0, the barrier at ~0.4 s (a quarter second
  from either end of the 2nd step, so a loaded machine's thread delays do not move the barrier
  out of it). finish: the rollout waits for the 2nd (released ~1.15 s, 2 steps); drop: it is
  thrown away (released right after the barrier, 1 step, weight of 1 step)."""
  trainers = [FakeTrainer(step_s=[0.1, 1.0]), FakeTrainer(step_s=[0.1, 1.0])]
  c, store, _ = make(2, on_barrier=on_barrier, trainers=trainers)
  out = c.rollout(shares(0.05, 0.4), sp=None, seed=0)
  crit = out.timeline.summary()["critical_path_s"]
  _, merged = store.drafter()
  if on_barrier == "finish":
    assert out.drafter["steps"] == 2 and merged.params == 2.0
    # the release waited for the step in flight at the barrier, and for nothing more
    barrier = out.timeline.barrier
    in_flight = [iv.end for iv in out.timeline.intervals
                 if iv.state is WorkerState.TRAINING and iv.start < barrier < iv.end]
    assert in_flight and max(in_flight) - barrier - 0.01 <= crit < 1.1, (crit, in_flight,
                                                                          barrier)
  else:
    assert out.drafter["steps"] == 1 and out.drafter["dropped"] == 1 and merged.params == 1.0
    assert crit < 0.3 and trainers[0].discarded == 1  # (not the ~0.75 s the step had left)


def test_an_overlapped_settle_hands_results_back_at_the_barrier_and_counts_only_its_wait():
  """overlap_settle: the rollout returns at the barrier while worker 0's drafter step (1 s,
  started at ~0.15 s after a 0.1 s one) is still in flight; the step finishes and the merge
  lands beside the caller's work (here 1.2 s of sleep, the learner's phases), so settle()
  waits for nothing
  and the critical path is ~0; the merged drafter is the one the synchronous settle gives. A
  caller that settles at once waits for the step, and that wait is its critical path."""
  for learner_s in (1.2, 0.0):
    trainers = [FakeTrainer(step_s=[0.1, 1.0]), FakeTrainer(step_s=[0.1, 1.0])]
    c, store, _ = make(2, trainers=trainers, overlap=True)
    t0 = time.perf_counter()
    out = c.rollout(shares(0.05, 0.4), sp=None, seed=0)
    returned = time.perf_counter() - t0
    barrier = out.timeline.barrier
    # did not wait for the step (~0.75 s of it left at the barrier)
    assert returned < barrier + 0.4, (returned, barrier)
    time.sleep(learner_s)
    drafter = out.settle()
    crit = out.timeline.summary()["critical_path_s"]
    _, merged = store.drafter()
    assert drafter["steps"] == 2 and merged.params == 2.0  # as the synchronous settle
    assert all(w.drafter_version == store.drafter_version for w in c.workers)
    if learner_s:
      assert crit < 0.2, crit
    else:  # the step in flight at the barrier, waited for by the caller
      in_flight = [iv.end for iv in out.timeline.intervals
                   if iv.state is WorkerState.TRAINING and iv.start < barrier < iv.end]
      # bounded by the step's own end, not a fixed time: on a loaded machine it ends later
      # (once 1.14 s after the barrier)
      wait = max(in_flight) - barrier if in_flight else None
      assert wait is not None and wait - 0.05 <= crit < wait + 0.1, (crit, in_flight, barrier)
    assert out.settle() is drafter and out.timeline.summary()["critical_path_s"] == crit
    c.close()
  with pytest.raises(ValueError, match="one process"):
    Coordinator([Worker(FakeEngine(0), FakeTrainer())], ParamStore(actor=None),
                spot=SpotConfig(), merge=average, global_barrier=lambda *a, **k: None,
                overlap_settle=True)


def test_a_lone_worker_trains_beside_the_learner_until_it_settles():
  """One worker (one device) is the barrier, so it never idles during the rollout: with the
  settling overlapped it trains while the caller runs the learner's phases (0.3 s of sleep
  here) and stops when the caller settles; without overlap there is no idle window and it
  never trains. A next rollout before any settle stops it too (nothing hangs)."""
  c, store, trainers = make(1, overlap=True)
  t0 = time.perf_counter()
  out = c.rollout(shares(0.05), sp=None, seed=0)
  assert time.perf_counter() - t0 < out.timeline.barrier + 0.2  # handed back at the barrier
  time.sleep(0.3)
  drafter = out.settle()
  elapsed = time.perf_counter() - t0
  # ~0.3 s of 20 ms steps: bounded by the time it had (a slow machine runs fewer, never more),
  # and it clearly kept going (not one step, then idle)
  assert 3 <= drafter["steps"] <= elapsed / 0.02 + 1, (drafter, elapsed)
  assert store.drafter()[1].params == drafter["steps"] * 1.0
  out = c.rollout(shares(0.05), sp=None, seed=1)  # never settled: the next rollout stops it
  c.rollout(shares(0.05), sp=None, seed=2).settle()
  c.close()
  c, store, _ = make(1, overlap=False)
  assert c.rollout(shares(0.05), sp=None, seed=0).drafter["steps"] == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_release_frees_the_actor_after_the_in_flight_step_and_the_drafter_push_keeps_it_out(
    overlap):
  """release_actor (memory.release_rollout_weights): each worker drops its actor copy once
  its share and its in-flight drafter step are done, before the results come back (with an
  overlapped settle too: the learner needs that memory); the merged drafter's push after it
  does not take the actor back; the next weight sync does."""
  trainers = [FakeTrainer(step_s=0.3), FakeTrainer(step_s=0.3)]
  c, store, _ = make(2, trainers=trainers, overlap=overlap)
  out = c.rollout(shares(0.05, 0.4), sp=None, seed=0, release_actor=True)
  assert [w.engine.params for w in c.workers] == [None, None]
  assert store.actor()[1] is None
  assert out.timeline.returned >= max(iv.end for iv in out.timeline.intervals
                                      if iv.state is WorkerState.TRAINING) - 0.01
  assert out.settle()["steps"] == 2 and store.drafter()[1].params == 2.0
  assert [w.engine.params for w in c.workers] == [None, None]  # the push took the drafter only
  assert all(w.drafter_version == store.drafter_version for w in c.workers)
  c.sync_actor("actor-v1")
  assert [w.engine.params for w in c.workers] == ["actor-v1", "actor-v1"]
  c.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_release_actors_frees_every_actor_after_a_rollout_that_kept_it(overlap):
  """release_actors (train.py, after the last of several rollouts that kept the actor): every
  worker's copy and the store's freed, the drafter's settle after it does not take the actor
  back; the next weight sync does."""
  c, store, _ = make(2, trainers=[FakeTrainer(step_s=0.1), FakeTrainer(step_s=0.1)],
                     overlap=overlap)
  out = c.rollout(shares(0.05, 0.2), sp=None, seed=0, release_actor=False)
  assert all(w.engine.params is not None for w in c.workers)
  assert store.actor()[1] is not None
  c.release_actors()
  assert [w.engine.params for w in c.workers] == [None, None]
  assert store.actor()[1] is None
  assert out.settle()["steps"] >= 1
  assert [w.engine.params for w in c.workers] == [None, None] and store.actor()[1] is None
  c.sync_actor("actor-v1")
  assert [w.engine.params for w in c.workers] == ["actor-v1", "actor-v1"]
  c.close()


def test_release_actors_stops_a_lone_workers_training():
  """One worker, overlapped settle, a rollout that kept the actor: the lone worker trains on
  past the rollout; release_actors stops that training and frees the actor (it does not wait
  for the settle, which comes after it)."""
  import threading
  c, store, _ = make(1, trainers=[FakeTrainer(step_s=0.02)], overlap=True)
  out = c.rollout(shares(0.05), sp=None, seed=0, release_actor=False)
  done = threading.Thread(target=c.release_actors, daemon=True)
  done.start()
  done.join(timeout=10.0)
  alive = done.is_alive()
  c._lone_stop.set()  # (the mutant's: unblock the worker so the test ends)
  assert not alive, "release_actors waited on a lone worker that trains until the settle"
  assert c.workers[0].engine.params is None and store.actor()[1] is None
  assert out.settle()["steps"] >= 1
  c.close()


@pytest.mark.parametrize("overlap,release", [(False, False), (True, False), (True, True)])
def test_a_rollouts_results_go_with_its_outcome_not_with_its_settle(overlap, release):
  """train.py drops a rollout's outcome once it has its responses (the Results' hidden states
  go), but keeps every rollout's settle() until the step's end (grpo.filter_groups: several):
  a settle, run or not, must not hold the Results."""
  import gc
  import weakref
  c, _, _ = make(2, overlap=overlap)
  out = c.rollout(shares(0.01, 0.05), sp=None, seed=0, release_actor=release)
  refs = [weakref.ref(r) for r in out.results]
  settle = out.settle
  del out
  gc.collect()
  assert [r() for r in refs] == [None, None]
  assert settle()["steps"] >= 1  # (it still merges what the idle worker trained)
  c.close()


def test_copies_trained_on_several_workers_are_merged_by_tokens_and_reach_every_worker():
  trainers = [FakeTrainer(step_s=0.02, tokens=100, lr=1.0),
              FakeTrainer(step_s=0.02, tokens=300, lr=3.0), FakeTrainer()]
  c, store, _ = make(3, trainers=trainers)
  out = c.rollout(shares(0.05, 0.2, 0.5), sp=None, seed=0)
  per_worker_steps = [sum(1 for iv in out.timeline.intervals
                          if iv.worker == i and iv.state is WorkerState.TRAINING)
                      for i in range(3)]
  assert per_worker_steps[:2] == [1, 1] and per_worker_steps[2] == 0
  assert out.drafter["workers_trained"] == 2
  _, merged = store.drafter()
  # worker 0: n0 steps of +1 (100 tokens each); worker 1: n1 steps of +3 (300 tokens each)
  n = out.drafter["steps"]
  tok = out.drafter["tokens"]
  n1 = (tok - 100 * n) // 200
  n0 = n - n1
  assert n0 > n1 > 0
  want = (n0 * 1.0 * 100 * n0 + n1 * 3.0 * 300 * n1) / (100 * n0 + 300 * n1)
  assert merged.params == pytest.approx(want)
  for w in c.workers:  # the worker that never trained gets the merged drafter too
    assert w.engine.drafter_params == pytest.approx(want)
    assert w.trainer.state.params == pytest.approx(want)


def test_a_worker_without_data_waits_idle_and_spot_off_never_trains():
  starved = [FakeTrainer(has_data=False), FakeTrainer()]
  c, store, _ = make(2, trainers=starved)
  out = c.rollout(shares(0.05, 0.3), sp=None, seed=0)
  s = out.timeline.summary()
  assert s["training_s"] == 0 and s["idle_s"] > 0.2 and s["idle_share_trained"] == 0
  assert out.drafter["steps"] == 0 and store.drafter_version == 0  # nothing published

  c, store, _ = make(2, spot="off")
  out = c.rollout(shares(0.05, 0.3), sp=None, seed=0)
  s = out.timeline.summary()
  assert out.drafter is None and s["training_s"] == 0
  # idle until the barrier (0.3 - 0.05 s at least; a loaded machine's barrier comes later),
  # untrained
  assert s["idle_s"] >= 0.15

  # spot training paused (the speculation gate wants no drafter: nothing shows drafts pay
  # yet), then resumed (an ungated gate wants it from the start)
  from tlt_jax.rollout.policies.cells import Policies
  from tlt_jax.rollout.policies.gate import GateConfig, GateState
  paused, wanting = GateState(GateConfig()), GateState(GateConfig(gating=False))
  assert not paused.drafter_wanted() and wanting.drafter_wanted()
  c, store, trainers = make(2)
  out = c.rollout(shares(0.05, 0.3), sp=None, seed=0, policies=Policies(gate=paused))
  s = out.timeline.summary()
  assert out.drafter["steps"] == 0 and s["training_s"] == 0 and store.drafter_version == 0
  assert s["idle_s"] >= 0.15  # (0.57 s once, in a full suite run on a loaded machine)
  assert not any(hasattr(t, "prepared") for t in trainers)  # (nothing to compile for)
  # the workers shared one cell of the gate, and the outcome carries its state back
  cells = {id(w.engine.policies) for w in c.workers}
  assert len(cells) == 1 and c.workers[0].engine.policies.gate.state is paused
  assert out.policies.gate is paused
  out = c.rollout(shares(0.05, 0.3), sp=None, seed=1, policies=Policies(gate=wanting))
  assert out.drafter["steps"] > 0 and store.drafter_version == 1
  assert all(t.prepared for t in trainers)
  assert out.policies.gate is wanting


def test_serial_mode_trains_after_the_rollout_on_worker_0_and_pushes():
  c, store, trainers = make(2, spot="serial")
  out = c.rollout(shares(0.05, 0.2), sp=None, seed=0)
  assert out.drafter is None and all(t.state.params == 0.0 for t in trainers)
  m = c.train_serial(5)
  assert m["steps"] == 5 and store.drafter()[1].params == 5.0
  assert [w.engine.drafter_params for w in c.workers] == [5.0, 5.0]


def test_new_weights_reach_workers_and_a_worker_error_surfaces():
  c, store, _ = make(2, spot="off")
  c.sync_actor = c.sync_actor  # (the JAX wait inside is a no-op for strings)
  store.publish_actor("actor-v1")
  c.push()
  assert [w.engine.params for w in c.workers] == ["actor-v1"] * 2
  c, _, _ = make(2, fail=(1,))
  with pytest.raises(RuntimeError, match="worker 1 broke"):
    c.rollout(shares(0.05, 0.1), sp=None, seed=0)  # the other worker stops at the barrier


def test_results_are_sorted_and_responses_reported_on_the_workers():
  c, _, _ = make(3, spot="off")
  seen = []
  lock = threading.Lock()

  def on_response(worker, res):
    with lock:
      seen.append((worker.id, res.request_id))

  reqs = [FakeRequest(i, 0.01) for i in (5, 0, 4, 1, 3, 2)]
  out = c.rollout(reqs, sp=None, seed=0, on_response=on_response)
  assert [r.request_id for r in out.results] == list(range(6))
  assert sorted(seen) == sorted((i % 3, i) for i in range(6))  # whole prompts per worker


def test_train_until_stops_at_max_steps_and_without_data():
  t = FakeTrainer()
  t.load(FakeState(0.0))
  rep = train_until(t, threading.Event(), max_steps=3, poll_s=0.001)
  assert rep.steps == 3 and t.state.params == 3.0
  t.has_data = False
  assert train_until(t, threading.Event(), max_steps=3, poll_s=0.001).steps == 0


def test_param_store_versions_each_kind_of_weights_on_its_own():
  """Workers pull what is newer by comparing versions: each of actor and drafter counts its
  own publications, whatever the other does."""
  store = ParamStore(actor="a0", drafter="d0")
  assert store.actor() == (0, "a0") and store.drafter() == (0, "d0")
  assert store.publish_actor("a1") == 1 and store.publish_actor("a2") == 2
  assert store.publish_drafter("d1") == 1
  assert store.actor() == (2, "a2") and store.drafter() == (1, "d1")
  store.release_actor()
  assert store.actor() == (2, None) and store.drafter() == (1, "d1")
  assert store.publish_actor("a3") == 3 and store.actor() == (3, "a3")


class BatchTrainer(FakeTrainer):
  """next_batch: `empty` Nones (no data yet), then batches 0, 1, 2, ...; records the batch of
  every step it dispatches and sets `barrier` once `stop_after` steps are committed."""

  def __init__(self, barrier, empty=0, stop_after=4):
    super().__init__(step_s=0.001)
    self.barrier, self.empty, self.stop_after = barrier, empty, stop_after
    self.calls, self.trained = 0, []
    self.load(FakeState(0.0))

  def next_batch(self):
    self.calls += 1
    return None if self.calls <= self.empty else self.calls - self.empty - 1

  def dispatch(self, batch):
    self.trained.append(batch)
    return super().dispatch(batch)

  def commit(self, inflight):
    super().commit(inflight)
    if len(self.metrics) >= self.stop_after:
      self.barrier.set()


def test_train_until_trains_each_step_on_the_next_batch_and_sums_its_waits_for_data():
  barrier = threading.Event()
  t = BatchTrainer(barrier, empty=5)
  rep = train_until(t, barrier, poll_s=0.01)
  assert rep.steps == 4 and t.trained == [0, 1, 2, 3]  # each batch once, in drawn order
  assert t.calls == 5 + 5  # the 5 empty draws, 4 batches trained and 1 packed ahead
  # every wait for data counts (5 polls of 10 ms), not only the last one
  assert 0.045 <= rep.waited_for_data_s < 2.0


def test_timeline_summary_against_hand_computed_intervals():
  clock = [0.0]
  tl = Timeline(2, clock=lambda: clock[0])

  def at(t, w, state):
    clock[0] = t
    tl.enter(w, state)

  at(0.0, 0, WorkerState.GENERATING)
  at(0.0, 1, WorkerState.GENERATING)
  at(2.0, 0, WorkerState.IDLE)
  at(2.5, 0, WorkerState.TRAINING)
  at(10.0, 1, WorkerState.IDLE)
  clock[0] = 10.0
  tl.mark_barrier()
  at(10.0, 1, WorkerState.DONE)
  at(10.4, 0, WorkerState.DONE)  # an in-flight step finished after the barrier
  clock[0] = 10.5
  tl.mark_released()
  s = tl.summary()
  assert s["generating_s"] == pytest.approx(12.0)
  assert s["idle_s"] == pytest.approx(8.0)  # worker 0 from 2.0 to the barrier at 10.0
  assert s["training_s"] == pytest.approx(7.5)  # 2.5 .. 10.0; the part after is not idle
  assert s["idle_share_trained"] == pytest.approx(7.5 / 8.0)
  assert s["critical_path_s"] == pytest.approx(0.5)


def test_a_steps_rollouts_concatenate_on_the_first_clock():
  """Two rollouts of a step (grpo.filter_groups), the second begun 12 s after the first on the
  same clock: seconds summed per worker, intervals and the last barrier shifted by 12, the
  critical paths summed; their drafter metrics summed and weighted by the tokens."""
  from tlt_jax.coordinator.coordinator import merge_spot_metrics
  from tlt_jax.coordinator.timeline import concat_rollouts
  clock = [0.0]

  def rollout(gen0, gen1, released):
    tl = Timeline(2, clock=lambda: clock[0])
    start = clock[0]
    for w in (0, 1):
      tl.enter(w, WorkerState.GENERATING)
    for w, end in sorted(((0, gen0), (1, gen1)), key=lambda x: x[1]):
      clock[0] = start + end
      tl.enter(w, WorkerState.IDLE)
    tl.mark_barrier()
    clock[0] = start + released
    tl.mark_released()
    tl.close()
    return tl

  a = rollout(3.0, 10.0, 10.5)
  a.add_wait(0.5)
  clock[0] = 12.0
  b = rollout(4.0, 1.0, 4.25)
  b.add_wait(0.25)
  s, js = concat_rollouts([a, b])
  assert js["waited"] == pytest.approx(0.5 + 0.25)  # (each rollout's wait for its settle)
  assert s["generating_s"] == pytest.approx(13 + 5)
  assert s["idle_s"] == pytest.approx(7 + 3)
  assert s["training_s"] == 0.0 and s["idle_share_trained"] == 0.0  # (0 of 10 idle s trained)
  assert s["critical_path_s"] == pytest.approx(0.5 + 0.25 + 0.5 + 0.25)  # (+ the waits)
  assert s["barrier_s"] == pytest.approx(16.0) and js["barrier"] == pytest.approx(16.0)
  assert js["rollouts"] == [0.0, 12.0] and js["released"] == pytest.approx(16.25)
  assert [p["idle_s"] for p in s["per_worker"]] == pytest.approx([7.0, 3.0])
  assert sorted(tuple(iv) for iv in js["intervals"] if iv[1] == "generating") == [
      (0, "generating", 0.0, 3.0), (0, "generating", 12.0, 16.0),
      (1, "generating", 0.0, 10.0), (1, "generating", 12.0, 13.0)]  # (exact: binary sums)
  assert concat_rollouts([a]) == (a.summary(), a.to_json())
  m = merge_spot_metrics([{"steps": 2, "tokens": 100, "dropped": 1, "workers_trained": 1,
                           "loss": 2.0, "acc": 0.5},
                          {"steps": 0, "tokens": 0, "dropped": 0, "workers_trained": 0},
                          {"steps": 3, "tokens": 300, "dropped": 0, "workers_trained": 2,
                           "loss": 1.0, "acc": 0.9}])
  assert m == {"steps": 5, "tokens": 400, "dropped": 1, "workers_trained": 2,
               "loss": pytest.approx(1.25), "acc": pytest.approx(0.8)}
  assert merge_spot_metrics([None, None]) is None


# ------------------------------------------------------------------- real rollout workers
@pytest.fixture(scope="module")
def default_model():
  from tlt_jax.config import asset_path
  from tlt_jax.drafter.model import load_drafter
  from tlt_jax.models.hf_io import load_hf_model
  from tlt_jax.models.tokenizer import load_tokenizer, stop_token_ids
  mdir = asset_path("default", "model")
  cfg, params = load_hf_model(mdir)
  tok = load_tokenizer(mdir)
  return cfg, params, load_drafter(asset_path("default", "drafter"), cfg), tok, \
      stop_token_ids(mdir, tok)


def _prompts(tok, n):
  from tlt_jax.config import asset_path
  from tlt_jax.data.prompts import load_prompt_rows
  rows, _ = load_prompt_rows(asset_path("default", "data", "test.jsonl"))
  return [tok.encode(r.prompt) for r in rows[:n]]


def test_two_workers_on_two_devices_decode_what_one_does_and_share_one_drafter(default_model):
  """Real engines on devices 0 and 1 under the coordinator, spot training on: greedy results
  equal one worker's (speculation is exact whichever rows share a batch), both devices were
  used, and after the barrier both workers decode with the same merged drafter, the one the
  store holds."""
  import jax
  from jax.sharding import Mesh

  from tlt_jax.drafter import train_step as dts
  from tlt_jax.drafter.buffer import BufferConfig, DrafterBuffer
  from tlt_jax.drafter.merge import average_states
  from tlt_jax.drafter.trainer import DrafterTrainer
  from tlt_jax.optim import make_optimizer
  from tlt_jax.rollout.config import EngineConfig, SpecConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import Request
  from tlt_jax.rollout.sampling import SamplingParams
  cfg, params, dparams, tok, stop = default_model
  ecfg = EngineConfig(max_batch=8, buckets=(1, 2, 4, 8), chunk_size=8, max_prompt_len=80,
                      max_new_tokens=64, capture_hidden=True, hidden_keep=64, stop_tokens=stop,
                      spec=SpecConfig(strategy="3_1_4", bs_threshold=4, patience=1,
                                      use_kernel=False))
  reqs = [Request(p, i, s) for i, p in enumerate(_prompts(tok, 6)) for s in range(2)]
  sp = SamplingParams(temperature=0.0)
  single = Engine(params, cfg, ecfg, drafter_params=dparams).generate(reqs, sp, seed=3)

  tx = make_optimizer(3e-4)
  buffer = DrafterBuffer(BufferConfig(buffer_tokens=4096, window=32, windows_per_response=2))
  step_fn = dts.make_train_step(cfg, tx)
  meshes = [Mesh(np.asarray(jax.devices()[i:i + 1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
            for i in (0, 1)]
  store_sh = dts.state_shardings(dparams, tx, meshes[0])
  workers = []
  for i, m in enumerate(meshes):
    engine = Engine(params, cfg, ecfg, worker_id=i, mesh=m, drafter_params=dparams)
    trainer = DrafterTrainer(step_fn=step_fn, shardings=dts.state_shardings(dparams, tx, m),
                             buffer=buffer, rows=2, row_len=64,
                             target_params=lambda e=engine: e.params, seed=i)
    workers.append(Worker(engine, trainer))
  store = ParamStore(params, dts.init_state(dparams, tx, store_sh))
  c = Coordinator(workers, store, spot=SpotConfig(mode="spot"),
                  merge=lambda s, w: average_states([jax.device_put(x, store_sh) for x in s],
                                                    w))
  c.push()

  def on_response(worker, res):
    buffer.add(0, res.response_ids[res.hidden_offset:], res.hidden)

  out = c.rollout(reqs, sp, seed=3, on_response=on_response)
  c.close()
  want = {(r.request_id, r.sample_index): r for r in single}
  assert len(out.results) == len(want)
  for r in out.results:
    np.testing.assert_array_equal(r.response_ids, want[(r.request_id, r.sample_index)]
                                  .response_ids)
  assert {r.worker_id for r in out.results} == {0, 1}
  assert out.drafter["steps"] > 0  # the worker that finished first trained
  merged = store.drafter()[1].params
  for w in workers:
    dev = {d.id for x in jax.tree.leaves(w.engine.drafter_params) for d in x.devices()}
    assert dev == {w.id}
    for a, b in zip(jax.tree.leaves(w.engine.drafter_params), jax.tree.leaves(merged)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(dparams)))


def test_the_drafter_step_compiles_when_spot_training_is_first_wanted():
  """compile_on_first_use: nothing compiles until the first prepare (a run whose spot
  training never starts, e.g. the gate found drafts cannot pay, never compiles it), then
  once, on the given executor."""
  import concurrent.futures as cf

  from tlt_jax.drafter.buffer import BufferConfig, DrafterBuffer
  from tlt_jax.drafter.trainer import DrafterTrainer
  trainer = DrafterTrainer(step_fn=None, shardings=None, rows=2, row_len=64,
                           buffer=DrafterBuffer(BufferConfig(buffer_tokens=4096, window=32,
                                                             windows_per_response=2)),
                           target_params=lambda: None)
  calls = []
  trainer.compile = lambda hidden: calls.append(("compile", hidden)) or 0.0

  class Executor:
    def submit(self, fn, *args):
      calls.append("submit")
      f = cf.Future()
      f.set_result(fn(*args))
      return f

  trainer.compile_on_first_use(128, Executor())
  assert calls == []
  trainer.prepare()  # the coordinator's, at the start of a rollout that will train
  assert calls == ["submit", ("compile", 128)]
  assert trainer.next_batch() is None  # (an empty buffer: nothing to train on yet)
  trainer.prepare()
  assert calls == ["submit", ("compile", 128)]  # once


def test_the_workers_drafter_steps_compile_once_and_load_onto_each_workers_devices(
    default_model, monkeypatch, fresh_jax_cache):
  """Each worker's spot trainer compiles the drafter's train step for its own devices
  (run.py: one low-priority thread compiles them one after another): the step is one
  program, compiled for the first worker and loaded onto the second's devices (one XLA
  compile; rollout/executables.compile_shared), and the loaded step computes on its device
  what JAX's own jitted step computes from the same state and batch."""
  from jax.sharding import Mesh

  from tlt_jax.drafter import train_step as dts
  from tlt_jax.drafter.buffer import BufferConfig, DrafterBuffer
  from tlt_jax.drafter.trainer import DrafterTrainer
  from tlt_jax.optim import make_optimizer
  cfg, params, dparams, _, _ = default_model
  tx = make_optimizer(3e-4)
  compiled, real = [], jax.stages.Lowered.compile
  monkeypatch.setattr(jax.stages.Lowered, "compile",
                      lambda self, *a, **k: compiled.append(1) or real(self, *a, **k))
  rng = np.random.default_rng(0)
  rows, row_len = 2, 64
  batch = {"tokens": rng.integers(0, cfg.vocab_size, (rows, row_len)).astype(np.int32),
           "positions": np.tile(np.arange(row_len, dtype=np.int32), (rows, 1)),
           "segment_ids": np.ones((rows, row_len), np.int32),
           "loss_mask": np.ones((rows, row_len), np.float32),
           "hidden": rng.normal(size=(rows, row_len, cfg.hidden_size)).astype(np.float32)}
  trainers, want = [], []
  for i in (0, 1):
    mesh = Mesh(np.asarray(jax.devices()[i:i + 1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    sh = dts.state_shardings(dparams, tx, mesh)
    step_fn = dts.make_train_step(cfg, tx, state_shardings=sh, donate=False)
    target = jax.device_put(params, jax.devices()[i])
    t = DrafterTrainer(step_fn=step_fn, shardings=sh, rows=rows, row_len=row_len,
                       buffer=DrafterBuffer(BufferConfig(buffer_tokens=4096, window=32,
                                                         windows_per_response=2)),
                       target_params=lambda target=target: target)
    t.load(dts.init_state(dparams, tx, sh))
    before = len(compiled)
    t.compile(cfg.hidden_size)
    assert len(compiled) - before == (1 if i == 0 else 0) and t.ported == (i == 1)
    trainers.append(t)
    want.append(step_fn(t.state, target, jax.device_put(batch, jax.devices()[i])))
  for i, t in enumerate(trainers):
    state, metrics = t.dispatch(batch)
    assert {d.id for x in jax.tree.leaves(state) for d in x.devices()} == {jax.devices()[i].id}
    for a, b in zip(jax.tree.leaves((state, metrics)), jax.tree.leaves(want[i])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_rollout_tail_share_is_the_time_after_90_percent_of_the_responses():
  """metrics' rollout_tail: the share of the rollout (its last finish) spent after 90% of the
  responses finished, and the last 10%'s share of the tokens (hand-computed)."""
  import numpy as np

  from tlt_jax.rollout.records import Result
  from tlt_jax.step_metrics import tail_share
  res = lambda t, n: Result(0, 0, np.zeros(1, np.int32), np.zeros(n, np.int32),
                            np.zeros(n, np.float32), None, "stop", finish_time=t)
  # 20 responses: 18 done by 2.0 s with 10 tokens each, the last two at 5.0 and 8.0 s
  rs = [res(0.1 * i, 10) for i in range(1, 19)] + [res(5.0, 200), res(8.0, 300)]
  got = tail_share(rs[::-1])
  assert got["time_share"] == pytest.approx((8.0 - 1.8) / 8.0)
  assert got["token_share"] == pytest.approx(500 / 680)
  assert tail_share([]) == {"time_share": 0.0, "token_share": 0.0}
  # 15 responses: 90% of them (13.5) have finished once the 14th has, at 1.4 s
  rs = [res(0.1 * i, 10) for i in range(1, 15)] + [res(4.0, 50)]
  assert tail_share(rs)["time_share"] == pytest.approx((4.0 - 1.4) / 4.0)
  assert tail_share(rs)["token_share"] == pytest.approx(50 / 190)


def test_rollout_tail_of_several_rollouts_is_the_steps():
  """A step's rollouts (grpo.filter_groups): the time share weighted by their seconds, the
  token share the step's tail tokens over the step's tokens (each rollout's tail its own)."""
  from types import SimpleNamespace as NS

  from tlt_jax.step_metrics import _tail_of_rollouts
  res = lambda k, t, n: NS(rollout=k, finish_time=t, num_tokens=n)
  # rollout 0: 10 responses of 100 tokens (the last one's 100 its tail), 10 s; rollout 1: 10
  # responses of 10 tokens, the last one 410 (its tail), 2 s
  rs = ([res(0, float(i), 100) for i in range(1, 11)]
        + [res(1, 0.1 * i, 10) for i in range(1, 10)] + [res(1, 2.0, 410)])
  got = _tail_of_rollouts(rs, [10.0, 2.0])
  assert got["token_share"] == pytest.approx((100 + 410) / (1000 + 500))
  assert got["time_share"] == pytest.approx((10 * (1 / 10) + 2 * (1.1 / 2.0)) / 12)


def test_step_metrics_reward_figures_are_per_group_and_per_source():
  """metrics' reward figures on a hand-made [prompts, n] reward matrix: a group is a prompt's
  n samples (a row), solved if any sample is right, zero-advantage if all its rewards are
  equal; accuracy by source averages the samples of that source's prompts only."""
  from types import SimpleNamespace as NS

  from tlt_jax.rl.reward_pool import RewardStats
  from tlt_jax.rollout.records import Result
  from tlt_jax.step_metrics import step_metrics
  r = np.asarray([[1.0, 0.0, 0.0],    # solved, mixed
                  [0.0, 0.0, 0.0],    # unsolved, all equal
                  [1.0, 1.0, 1.0],    # solved, all equal
                  [0.5, 0.0, 0.0]])   # partial credit is not solved; mixed
  prompts = [NS(row=NS(source=s)) for s in ("a", "b", "a", None)]
  res = lambda n, why: Result(0, 0, np.zeros(1, np.int32), np.zeros(n, np.int32),
                              np.zeros(n, np.float32), None, why, finish_time=float(n))
  responses = [res(n, "length" if n in (4, 9) else "stop") for n in range(1, 13)]
  run = NS(coordinator=NS(engines=[], spot=NS(mode="off")))
  m = step_metrics(run, prompts, responses, r, [], [2.0], {"loss": 0.5}, RewardStats(), {},
                   None, epoch=1)
  assert m["reward"] == pytest.approx(r.sum() / 12)
  assert m["accuracy"] == pytest.approx(4 / 12)
  assert m["solved_groups"] == pytest.approx(2 / 4)
  assert m["zero_adv_groups"] == pytest.approx(2 / 4)
  assert m["accuracy_by_source"] == pytest.approx({"a": 4 / 6, "b": 0.0})
  assert m["truncated"] == pytest.approx(2 / 12)
  assert m["tokens"] == 78 and m["rollout_tokens_per_s"] == pytest.approx(39.0)
  # speculation: chunks of the "off" arm verify without drafts, so they count in the share of
  # speculative tokens but not in the tokens per verification of the drafting chunks
  from tlt_jax.rollout.policies.strategy import Strategy
  from tlt_jax.rollout.records import ChunkMetrics
  chunk = lambda mode, tokens, acc, ver: ChunkMetrics(0, 8, 4, tokens, 5, 1.0, mode=mode,
                                                      accepted=acc, verifications=ver)
  chunks = [chunk("plain", 8, 0, 0), chunk(Strategy("off"), 20, 0, 20),
            chunk(Strategy("4_1_5"), 30, 15, 10)]
  m = step_metrics(run, prompts, responses, r, chunks, [2.0], {}, RewardStats(), {}, None,
                   epoch=1)
  assert m["spec"]["chunks"] == 2
  assert m["spec"]["tokens_per_verify"] == pytest.approx((15 + 10) / 10)
  assert m["spec"]["share_of_tokens"] == pytest.approx((20 + 30) / 78)


def test_average_states_is_the_token_weighted_mean_of_params_and_moments():
  """The merge of real drafter states (params, Adam's moments, step counts) against a
  float64 numpy weighted mean: a copy with weight 0 changes nothing, the step is the largest."""
  import jax
  import jax.numpy as jnp
  from tlt_jax.drafter.merge import average_states
  from tlt_jax.drafter.train_step import DrafterState
  rng = np.random.default_rng(0)
  shapes = {"w": (3, 4), "b": (4,)}
  states = []
  for step in (5, 9, 7):
    tree = lambda: {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    states.append(DrafterState(step=jnp.asarray(step, jnp.int32), params=tree(),
                               opt_state=(tree(), tree())))
  weights = [300.0, 100.0, 0.0]
  got = average_states(states, weights)
  want_w = np.asarray(weights[:2], np.float64) / 400.0
  for g, *xs in zip(jax.tree.leaves(got), *[jax.tree.leaves(s) for s in states]):
    if np.issubdtype(np.asarray(g).dtype, np.integer):
      assert int(g) == 9  # the largest step among the copies that trained
      continue
    ref = sum(wi * np.asarray(x, np.float64) for wi, x in zip(want_w, xs[:2]))
    np.testing.assert_allclose(np.asarray(g, np.float64), ref, rtol=1e-6, atol=1e-7)
  assert average_states(states, [0.0, 5.0, 0.0]) is states[1]  # one copy trained
  with pytest.raises(ValueError, match="sum to 0"):
    average_states(states, [0.0, 0.0, 0.0])


def test_process_timelines_merge_into_the_jobs():
  """merge_processes: process 1's workers follow process 0's, seconds add up over all of
  them (the idle share of the whole job), the barrier and the critical path are the
  latest / longest; a hand-worked two-process step."""
  from tlt_jax.coordinator.timeline import merge_processes
  parts = []
  for events, barrier in (([(0, 0.0, "g"), (0, 1.0, "i"), (0, 1.5, "t")], 3.0),  # process 0
                          ([(0, 0.0, "g"), (1, 0.0, "g"), (1, 2.0, "i")], 4.0)):  # process 1
    now = [0.0]
    tl = Timeline(2 if any(w == 1 for w, _, _ in events) else 1, clock=lambda: now[0])
    for w, t, s in events:
      now[0] = t
      tl.enter(w, {"g": WorkerState.GENERATING, "i": WorkerState.IDLE,
                   "t": WorkerState.TRAINING}[s])
    now[0] = barrier
    tl.mark_barrier()
    tl.close()
    parts.append((tl.summary(), tl.to_json()))
  summary, js = merge_processes(parts)
  assert [p["worker"] for p in summary["per_worker"]] == [0, 1, 2]
  assert sorted({iv[0] for iv in js["intervals"]}) == [0, 1, 2]
  # generating: 1 (p0 w0) + 4 (p1 w0, to the barrier) + 2 (p1 w1); idle: 2 + 0 + 2, of which
  # p0's 1.5 s training
  assert summary["generating_s"] == pytest.approx(7.0)
  assert summary["idle_s"] == pytest.approx(4.0) and summary["training_s"] == pytest.approx(1.5)
  assert summary["idle_share_trained"] == pytest.approx(1.5 / 4.0)
  assert js["barrier"] == 4.0 and summary["barrier_s"] == 4.0
