"""The speculation gate (tlt_jax/rollout/policies/gate.py): decisions from known per-row rates, and
the engine compiling and speculating only where the gate opens, losslessly."""

import dataclasses

import numpy as np
import pytest

from tlt_jax.rollout.config import EngineConfig, SpecConfig
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.policies.cells import PolicyCells, SpecGate
from tlt_jax.rollout.policies import placement
from tlt_jax.rollout.policies.gate import GateConfig, GateState
from tlt_jax.rollout.policies import probe
from tlt_jax.rollout.policies.probe import Chunk, Step
from tlt_jax.rollout.policies.strategy import Strategy
from tlt_jax.rollout.records import EngineHooks, Request
from tlt_jax.rollout.sampling import SamplingParams
from spec_helpers import SMALL, TINY


ARMS = ["4_1_5", "3_1_4", "off"]


def _feed(gate, bucket, arm, rate, n, live=None, accept_len=2.0):
  """n chunks of 16 steps decoding `rate` tokens/s per row (a speculative chunk: `accept_len`
  tokens per verification, so its steps take accept_len x longer at the same rate) with
  `live` rows (None: the bucket's), after a first chunk 50x slower where (bucket, arm) has
  not run yet: a warm-up the gate must not count."""
  live = live or bucket
  a = 1.0 if arm is None else accept_len
  ver = 0 if arm is None else 16 * live
  acc = round((a - 1.0) * ver)
  if arm not in gate.state.at[bucket].warm:
    gate.record(bucket, arm, 50 * 16 * a / rate, 16, acc, ver, live=live)
  for _ in range(n):
    gate.record(bucket, arm, 16 * a / rate, 16, acc, ver, live=live)


def _gate(buckets=(1, 2, 4, 8), worker=0, **kw):
  g = SpecGate(GateConfig(lead="4_1_5", **kw))
  g.begin_rollout(worker, {b: ARMS for b in buckets})
  return g


def test_opens_bucket_by_bucket_while_it_pays_then_declines_the_rest():
  g = _gate(worker=7, min_chunks=4, margin=0.1, reprobe_every=0)  # the first caller probes
  g.begin_rollout(8, {b: ARMS for b in (1, 2, 4, 8)})
  assert g.arms(7, 1) == [] and not g.allows(7, 1)  # plain decoding not measured yet there
  assert not g.drafter_wanted()  # nothing shows yet that drafts can pay on this hardware
  _feed(g, 1, None, 100.0, 2)  # half measured: the prober compiles the lead arm
  assert g.arms(7, 1) == ["4_1_5"] and g.arms(8, 1) == [] and g.arms(7, 2) == []
  assert not g.allows(7, 1)
  _feed(g, 1, None, 100.0, 2)
  assert g.allows(7, 1) and not g.allows(8, 1) and not g.allows(7, 2)
  _feed(g, 1, "4_1_5", 150.0, 3)
  assert g.state.status[1] == "probing"  # 3 speculative chunks < min_chunks
  _feed(g, 1, "4_1_5", 150.0, 1)
  assert g.state.status == {1: "pays", 2: "probing", 4: "closed", 8: "closed"}
  assert g.drafter_wanted()
  assert g.arms(8, 1) == ARMS and g.arms(7, 2) == []  # a paying bucket: every arm
  # bucket 2: the lead is slower than plain, but its ceiling (every draft accepted) is not:
  # the drafts fall short, so the other drafting arm is probed too, and is 5% faster: under
  # the 10% margin, declined for acceptance with 4 and 8
  _feed(g, 2, None, 200.0, 4, live=2)
  assert g.arms(7, 2) == ["4_1_5"]
  _feed(g, 2, "4_1_5", 120.0, 4, live=2, accept_len=2.0)
  assert g.state.status[2] == "probing" and g.arms(7, 2) == ["4_1_5", "3_1_4"]
  _feed(g, 2, "3_1_4", 210.0, 4, live=2, accept_len=2.0)
  assert g.state.status == {1: "pays", 2: "declined", 4: "declined", 8: "declined"}
  assert g.state.reason == {2: "acceptance", 4: "acceptance", 8: "acceptance"}
  d = g.state.decisions[-1]
  assert d["bucket"] == 2 and d["best_arm"] == "3_1_4" and d["ratio"] == pytest.approx(1.05)
  assert d["ceiling"] == pytest.approx(1.05 * 4 / 2.0, rel=1e-3)
  assert g.arms(7, 2) == [] and g.drafter_wanted()


def test_a_bucket_the_gate_says_it_never_closes_stays_open_through_every_transition():
  """`closes(bucket)` False is what lets the engine skip compiling switch-off ahead there:
  over random runs of measured chunks (plain and speculative, faster and slower, at random
  buckets, on two workers, rollouts beginning between them: probes that pay and decline,
  probation that moves, reprobes), a bucket once reported as never closing stays allowed on
  every worker at every later point; a gate that does not gate closes nothing."""
  rng = np.random.default_rng(0)
  buckets = (1, 2, 4, 8, 16)
  exercised = 0
  for seed in range(6):
    g = _gate(buckets=buckets, min_chunks=2, margin=0.1, reprobe_every=1)
    g.begin_rollout(1, {b: ARMS for b in buckets})
    never: set[int] = set()
    for i in range(120):
      if i % 7 == 0:
        g.begin_rollout(int(rng.integers(2)), {b: ARMS for b in buckets})
      b = int(rng.choice(buckets))
      arm = [None, "4_1_5", "3_1_4"][int(rng.integers(3))]
      _feed(g, b, arm, float(rng.uniform(50, 200)), 1, accept_len=float(rng.uniform(1, 3)))
      for q in never:
        assert g.allows(0, q) and g.allows(1, q), (seed, i, q, g.state.status)
      never |= {q for q in buckets if not g.closes(q)}
    exercised += bool(never)
  assert exercised >= 3  # in most runs some bucket came to pay: the property was exercised
  g = SpecGate(GateConfig(gating=False))
  g.begin_rollout(0, {b: ARMS for b in buckets})
  assert not any(g.closes(b) for b in buckets) and all(g.allows(0, b) for b in buckets)


def test_a_call_may_speculate_only_where_a_probe_is_funded_or_a_bucket_pays():
  """`may_speculate` (whether a call keeps the drafter's cache current, engine.py's tracked
  call): not while nothing is funded (a horizon too short to repay any compile: the CPU
  default's case), yes once a probe is funded (on every worker: it may pay mid-call) and
  while a bucket pays; not once every bucket is declined."""
  g = _gate(min_chunks=2, margin=0.1, reprobe_every=0, horizon=1, payback=0.01)
  assert g.state.status[1] == "probing" and not g.state.probe_arms(1)
  assert not g.may_speculate()
  g = _gate(min_chunks=2, margin=0.1, reprobe_every=0)  # open-ended: every compile repays
  assert g.state.probe_arms(1) == ["4_1_5"] and g.may_speculate()
  _feed(g, 1, None, 100.0, 2)
  _feed(g, 1, "4_1_5", 150.0, 2)
  assert g.state.status[1] == "pays" and g.may_speculate()
  for b in (2, 4, 8):
    g.state = dataclasses.replace(g.state, at={**g.state.at, b: dataclasses.replace(
        g.state.at[b], status="declined", reason="hardware", funded=frozenset())})
  g.state = g.state.put(1, dataclasses.replace(g.state.at[1], status="declined",
                                               funded=frozenset()))
  assert not g.may_speculate()
  assert dataclasses.replace(g.state, cfg=GateConfig(gating=False)).may_speculate()


def test_chunks_at_a_wider_window_than_their_rows_need_may_open_a_bucket_not_close_it():
  """A probe's chunk that ran at a wider attention window than its rows need (a compiled
  wide one while theirs compiles) reads more than plain decoding at the rows' windows: it
  may show that an arm pays (it would pay more at the rows' windows), not that none does (the
  32B recipe's 120-row probe read 3.9x plain's bytes per step at the whole cache's window and
  was declined at 0.89x). A decline waits for chunks at the rows' own windows."""
  g = _gate(min_chunks=2, margin=0.1, reprobe_every=0)
  _feed(g, 1, None, 100.0, 2)
  g.record(1, "4_1_5", 1.0, 16, 16, 16, live=1)  # warm-up
  for _ in range(4):  # slow: at the whole cache's window
    g.record(1, "4_1_5", 16 * 2.0 / 30.0, 16, 16, 16, live=1, wide=True)
  assert g.state.status[1] == "probing"  # (counted as wide chunks: no decline on them)
  for _ in range(2):  # at the rows' windows: paying
    g.record(1, "4_1_5", 16 * 2.0 / 150.0, 16, 16, 16, live=1)
  assert g.state.status[1] == "pays"
  d = g.state.decisions[-1]
  assert d["ratio"] == pytest.approx(1.5)
  g = _gate(min_chunks=2, margin=0.1, reprobe_every=0)
  _feed(g, 1, None, 100.0, 2)
  g.record(1, "4_1_5", 1.0, 16, 16, 16, live=1)
  for _ in range(2):  # wide, yet paying: it pays
    g.record(1, "4_1_5", 16 * 2.0 / 130.0, 16, 16, 16, live=1, wide=True)
  assert g.state.status[1] == "pays"
  g = _gate(min_chunks=2, margin=0.1, reprobe_every=0)
  _feed(g, 1, None, 100.0, 2)
  g.record(1, "4_1_5", 1.0, 16, 16, 16, live=1)
  for wide in (True, False, False):  # losing at the rows' windows too: declined
    g.record(1, "4_1_5", 16 * 2.0 / 30.0, 16, 16, 16, live=1, wide=wide)
  assert g.state.status[1] == "declined"


def test_once_a_bucket_pays_probation_goes_where_the_time_is_above_it():
  """Bucket 1 pays; probation moves to the larger bucket whose probe could earn the most (the
  seconds a rollout spends there x the best case's saving), here 8, where the rollout's time
  is, not to the next bucket up (2): plain steps whose time the bytes they read explain
  (a GPU's decoding) bound the best case at depth + 1 everywhere. With no time measured
  above it, the next one up."""
  def plain(g, bucket, chunks):
    for _ in range(chunks + 1):  # (+ the warm-up)
      read = 1e9 + bucket * 1e6
      g.record(bucket, None, 16 * read / 1e11, 16, live=bucket, read=read)

  for busy, expect in (({2: 1, 4: 1, 8: 40}, 8), ({}, 2)):
    g = _gate(min_chunks=2, margin=0.1, reprobe_every=0)
    plain(g, 1, 2)
    for b, n in busy.items():
      plain(g, b, n)
    g.record(1, "4_1_5", 1.0, 16, 16, 16, live=1)  # warm-up
    for _ in range(2):  # 2 tokens per verification at 1.5x plain's step time: pays
      g.record(1, "4_1_5", 16 * 1.5 * 1.001e9 / 1e11, 16, 16, 16, live=1)
    assert g.state.status[1] == "pays", g.state.decisions
    assert g.state.status[expect] == "probing"
    assert [b for b, st in g.state.status.items() if st == "probing"] == [expect]


def test_declines_for_hardware_with_the_lead_alone_and_pauses_the_drafter():
  """A k-token forward costing ~k single ones: even all drafts accepted would not pay."""
  g = _gate(min_chunks=2, margin=0.05, reprobe_every=2, hardware_reprobe_every=5)
  _feed(g, 1, None, 100.0, 2)
  _feed(g, 1, "4_1_5", 58.0, 2, accept_len=3.5)  # ceiling 0.58 x 5 / 3.5 = 0.83
  assert g.state.status == {1: "declined", 2: "declined", 4: "declined", 8: "declined"}
  assert set(g.state.reason.values()) == {"hardware"} and not g.drafter_wanted()
  assert ("1", "3_1_4") not in {tuple(k.split(":")) for k in g.summary()["spec_rate"]}
  for _ in range(4):
    g.begin_rollout(0, {b: ARMS for b in (1, 2, 4, 8)})
  assert g.state.status[1] == "declined"  # not after reprobe_every: the machine does not train
  g.begin_rollout(0, {b: ARMS for b in (1, 2, 4, 8)})
  assert g.state.status[1] == "probing" and not g.drafter_wanted()  # still not shown to pay


def test_an_untrained_drafter_is_declined_for_acceptance_keeps_training_and_is_reprobed():
  g = _gate(buckets=(1, 2), min_chunks=2, margin=0.0, reprobe_every=3)
  _feed(g, 1, None, 100.0, 2)
  _feed(g, 1, "4_1_5", 50.0, 2, accept_len=1.1)  # cheap steps, rejected drafts
  assert g.state.status[1] == "probing" and g.arms(0, 1) == ["4_1_5", "3_1_4"]
  _feed(g, 1, "3_1_4", 60.0, 2, accept_len=1.1)
  assert g.state.status == {1: "declined", 2: "declined"} and g.state.reason[1] == "acceptance"
  assert g.drafter_wanted()  # training can fix this
  g.begin_rollout(1, {1: ARMS, 2: ARMS})  # another worker's rollouts do not advance the clock
  g.begin_rollout(0, {1: ARMS, 2: ARMS})
  g.begin_rollout(0, {1: ARMS, 2: ARMS})
  assert g.state.status[1] == "declined"
  g.begin_rollout(0, {1: ARMS, 2: ARMS})  # 3 rollouts of the prober since the decline
  assert g.state.status == {1: "probing", 2: "declined"}
  assert g.arms(0, 1) == ["4_1_5"]  # measured
  assert not g.allows(1, 1)
  _feed(g, 1, "4_1_5", 130.0, 2, accept_len=3.0)  # the drafter got better: pays now
  assert g.state.status == {1: "pays", 2: "probing"}


def test_probes_the_lead_whatever_the_bandit_picks_then_every_drafting_arm_in_turn():
  g = _gate(buckets=(1, 2), min_chunks=4, margin=0.0)
  assert g.probe_arm(1, "off") == "4_1_5"  # the bandit's "off" is overridden
  assert g.probe_arm(2, "off") == "off"  # bucket 2 is not on probation
  _feed(g, 1, None, 100.0, 4)
  _feed(g, 1, "4_1_5", 90.0, 4, accept_len=2.0)  # under plain, ceiling 2.25: widen
  assert g.probe_arm(1, "off") == "3_1_4"
  _feed(g, 1, "3_1_4", 100.0, 3)
  assert g.probe_arm(1, "off") == "3_1_4" and g.state.status[1] == "probing"
  _feed(g, 1, "3_1_4", 100.0, 1)
  assert g.state.status[1] == "pays" and g.probe_arm(1, "off") == "off"
  h = SpecGate(GateConfig(lead="6_1_7"))  # a lead not choosable there: the first drafting arm
  h.begin_rollout(0, {1: ARMS})
  assert h.probe_arm(1, "off") == "4_1_5"


def test_probation_goes_where_the_time_is():
  """Short responses end before the batch shrinks to bucket 1: the time is at bucket 8, and
  probation moves there alone (a speculating batch compacts only to buckets whose arms are
  compiled: nothing is probed on the way down). Declined there, it moves to where the time
  went; a bucket that pays there does not re-probe 8 before 8's re-probe is due."""
  g = _gate(min_chunks=2, margin=0.05, follow_traffic=3, hardware_reprobe_every=4)
  for r in range(5):
    g.begin_rollout(0, {b: ARMS for b in (1, 2, 4, 8)})
    # the first rollout probes the smallest (nothing measured); once 8's time is in, and
    # nothing speculative measured at 1, probation moves
    assert g.state.status[8] == ("closed" if r < 1 else "probing"), r
    _feed(g, 8, None, 100.0, 1, live=8)
  assert g.state.status == {1: "closed", 2: "closed", 4: "closed", 8: "probing"}
  assert g.state.decisions[-1]["verdict"] == "moved"
  assert g.arms(0, 8) == g.arms(0, 4) == ["4_1_5"] and g.arms(1, 4) == []  # (compacts to 4)
  _feed(g, 8, "4_1_5", 90.0, 2, live=8, accept_len=4.5)  # ceiling 1.0: hardware
  assert g.state.status == {1: "closed", 2: "closed", 4: "closed", 8: "declined"}
  _feed(g, 4, None, 100.0, 2, live=4)  # the time moves to bucket 4: so does probation
  g.begin_rollout(0, {b: ARMS for b in (1, 2, 4, 8)})
  assert g.state.status == {1: "closed", 2: "closed", 4: "probing", 8: "declined"}
  _feed(g, 4, "4_1_5", 150.0, 2, live=4, accept_len=3.0)  # 4 pays: so do 1 and 2
  # 8, declined a rollout before, is probed again when its re-probe is due, not at once
  assert g.state.status == {1: "pays", 2: "pays", 4: "pays", 8: "declined"}
  for _ in range(2):  # (declined at the rollout before 4's probe: due 4 rollouts after)
    g.begin_rollout(0, {b: ARMS for b in (1, 2, 4, 8)})
  assert g.state.status[8] == "declined" and not g.state.reprobe_due(8)
  g.begin_rollout(0, {b: ARMS for b in (1, 2, 4, 8)})
  assert g.state.status == {1: "pays", 2: "pays", 4: "pays", 8: "probing"}  # 8 re-opened
  # a chunk's time is its live rows' bucket's: a speculating batch of 3 rows left at 8
  h = _gate(min_chunks=2)
  _feed(h, 8, None, 100.0, 3, live=3)
  assert h.state.ledger.busy == {4: pytest.approx(3 * 16 / 100.0)}


def _timed(g, times, rate_of, compile_s=0.0):
  """Plain chunks at each bucket: `times[b]` seconds of them per rollout (after a warm-up
  chunk), each step taking 1 / rate_of(b) seconds; and a plain compile measured."""
  for b, t in times.items():
    rate = rate_of(b)
    n = max(1, round(t * rate / 16))
    _feed(g, b, None, rate, n, live=b)
  if compile_s:
    for b in times:
      g.compiled("plain", b, None, compile_s)


def test_what_a_row_adds_to_a_step_is_fitted_as_a_float64_least_squares_would():
  """probe.row_seconds against numpy's float64 least squares on the same steps: a step of r
  rows reading B bytes (weights and every row's window; the windows differ from chunk to
  chunk) taking a0 + a1 B + b r seconds. Bytes-bound (a GPU's 7B: b = 0) the bound on an arm
  is its depth + 1; compute-bound (b carries the time) near 1."""
  rng = np.random.default_rng(0)
  rows = np.repeat([1, 2, 4, 8, 16, 32], 4).astype(float)
  read = 15e9 + rows * rng.integers(256, 8192, rows.size) * 57e3
  for a0, a1, b in ((2e-4, 1 / 3.0e12, 0.0), (1e-4, 0.0, 2e-3), (3e-4, 1 / 2e12, 1e-5)):
    t = a0 + a1 * read + b * rows
    steps = {}
    for r, x, y in zip(rows, t, read):
      steps.setdefault(int(r), []).append(Step(float(x), float(y)))
    x = np.stack([np.ones_like(rows), read / 1e9, rows], 1)  # (GB: well conditioned)
    ref, *_ = np.linalg.lstsq(x, t, rcond=None)
    assert ref[2] == pytest.approx(b, abs=1e-9)  # (the reference recovers the truth)
    assert probe.row_seconds(steps) == pytest.approx(ref[2], rel=1e-5, abs=1e-9)
    here = probe.step_seconds(steps, 8)
    bound = probe.plain_bound(steps, 8, Strategy("4_1_5"))  # 5 tokens a row verified
    assert bound == pytest.approx(5 * here / (here + b * 8 * 4), rel=1e-4)
    assert (bound > 4.99) == (b == 0)
  assert probe.row_seconds({8: (Step(0.01),)}) is None  # one bucket: nothing to fit
  assert probe.plain_bound({}, 8, Strategy("off")) == 1.0
  # a step of k x the rows costing k x as much (compute-bound), whatever its bytes: ~1
  steps = {r: (Step(1e-3 * r, 1e6 * r),) for r in (1, 2, 4, 8)}
  assert probe.plain_bound(steps, 2, Strategy("4_1_5")) == pytest.approx(1.0, rel=1e-6)


BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def test_the_first_probe_goes_where_time_x_saving_is_largest():
  """Synthetic time shares of a long-tailed rollout: most time in the bulk (64), some in the
  tail (8), little at 1. Where a step's cost does not grow with its rows (decoding bound by
  streaming weights) drafts could save most where the time is: the probe goes to 64, then
  up from a paying bucket. Where it grows with the rows (compute-bound) nothing could pay:
  no bucket is worth a probe and, in a run of finite length, nothing is funded."""
  times = {1: 0.5, 2: 0.5, 4: 0.5, 8: 4.0, 16: 1.0, 32: 1.0, 64: 30.0}
  g = _gate(buckets=BUCKETS, horizon=100)
  assert g.state.status[1] == "probing"  # nothing measured yet: the smallest
  _timed(g, times, lambda b: 100.0, compile_s=10.0)  # every step 10 ms, whatever the rows
  g.begin_rollout(0, {b: ARMS for b in BUCKETS})
  worth = {b: placement.earns(g.state, b) for b in BUCKETS}
  assert max(worth, key=worth.get) == 64 and worth[8] > worth[2] > 0
  assert g.state.status == {**{b: "closed" for b in BUCKETS}, 64: "probing"}
  # the prober compiles at 64 and under it (its batch compacts through them), no one else
  assert g.arms(0, 64) == g.arms(0, 8) == ["4_1_5"] and g.arms(1, 64) == g.arms(1, 8) == []
  assert g.state.probe_arms(64) == ["4_1_5"]  # funded: 30 s x 99 rollouts x 0.5 x 0.8
  # compute-bound: a step of b rows costs b x 10 ms; a 5-token verification at b costs
  # what 5b rows do, so no arm's best case beats plain decoding anywhere
  h = _gate(buckets=BUCKETS, horizon=100)
  _timed(h, times, lambda b: 100.0 / b, compile_s=10.0)
  for _ in range(3):
    h.begin_rollout(0, {b: ARMS for b in BUCKETS})
  assert all(placement.earns(h.state, b) == pytest.approx(0.0, abs=1e-9) for b in BUCKETS)
  assert h.state.status == {**{b: "closed" for b in BUCKETS}, 1: "probing"}
  assert h.state.summary()["status"]["1"] == "unfunded"
  assert not any(r.funded for r in h.state.at.values())


def test_a_probe_is_worth_what_every_smaller_bucket_would_earn_with_it():
  """A bucket that pays makes every smaller one pay, so a probe's worth is its own best case
  and every smaller bucket's not paying (`placement.worth`): the bulk (64) goes first though
  the tail's 4 rows hold more of the rollout's time alone (the 32B recipe's tail and bulk
  within 4%, which noise in the measured chunks could swap); nothing where the bucket's own
  best case stays under the bar."""
  times = {1: 0.5, 2: 0.5, 4: 12.0, 8: 1.0, 16: 1.0, 32: 1.0, 64: 11.0}
  g = _gate(buckets=BUCKETS, horizon=100)
  _timed(g, times, lambda b: 100.0, compile_s=10.0)  # every step 10 ms, whatever the rows
  g.begin_rollout(0, {b: ARMS for b in BUCKETS})
  earns = {b: placement.earns(g.state, b) for b in BUCKETS}
  assert max(earns, key=earns.get) == 4  # by its own time alone, the tail
  for b in BUCKETS:
    assert placement.worth(g.state, b) == pytest.approx(sum(earns[q] for q in BUCKETS
                                                            if q <= b))
  assert g.state.status == {**{b: "closed" for b in BUCKETS}, 64: "probing"}
  h = _gate(buckets=BUCKETS, horizon=100)  # compute-bound: no bucket's best case clears it
  _timed(h, times, lambda b: 100.0 / b, compile_s=10.0)
  assert all(placement.worth(h.state, b) == 0.0 for b in BUCKETS)


def test_state_survives_a_resume():
  g = _gate(buckets=(1, 2), min_chunks=1, margin=0.0)
  _feed(g, 1, None, 100.0, 1)
  _feed(g, 1, "4_1_5", 150.0, 2)
  g.begin_rollout(0, {1: ARMS, 2: ARMS})
  _feed(g, 2, None, 100.0, 1, live=2)
  _feed(g, 2, "4_1_5", 50.0, 1, live=2, accept_len=4.0)  # ceiling 0.625: hardware
  h = SpecGate(GateState.restore(GateConfig(min_chunks=1, margin=0.0, lead="4_1_5"),
                                 g.state.state_dict()))
  assert h.state.status == g.state.status == {1: "pays", 2: "declined"}
  assert h.state.reason == {2: "hardware"}
  h.begin_rollout(5, {1: ARMS, 2: ARMS})
  assert h.arms(5, 1) == ARMS and h.arms(5, 2) == []  # the first caller after a resume probes
  assert h.drafter_wanted()


def test_hardware_verdicts_outlive_the_run_where_nothing_they_depend_on_changed(tmp_path):
  """A hardware decline is written to the verdict cache; the next run with the same
  fingerprint starts declined (no probe: nothing compiles, the drafter is not wanted), one
  with another fingerprint probes; acceptance verdicts are not kept (they depend on the
  drafter); a re-probe that pays removes the verdict; a damaged file is a cache miss."""
  from tlt_jax.rollout.policies.verdicts import VerdictCache
  path = tmp_path / "gate" / "verdicts.json"
  fp = {"device_kind": "cpu", "model": "hidden=128"}
  buckets = {b: ARMS for b in (1, 2, 4)}

  def gate(fingerprint=fp, **kw):
    g = SpecGate(GateConfig(lead="4_1_5", min_chunks=2, margin=0.05, **kw),
                 verdicts=VerdictCache(str(path), fingerprint))
    g.begin_rollout(0, buckets)
    return g

  g = gate()
  assert g.state.status[1] == "probing" and not path.exists()
  _feed(g, 1, None, 100.0, 2)
  _feed(g, 1, "4_1_5", 58.0, 2, accept_len=3.5)  # ceiling 0.83: hardware
  assert g.state.reason[1] == "hardware" and path.exists()

  again = gate()
  assert again.state.status == {1: "declined", 2: "declined", 4: "declined"}
  assert set(again.state.reason.values()) == {"hardware"} and again.state.decisions[0]["cached"]
  assert again.arms(0, 1) == [] and not again.allows(0, 1) and not again.drafter_wanted()
  assert gate({**fp, "model": "hidden=1024"}).state.status[1] == "probing"  # another shape

  # a re-probe (hardware_reprobe_every rollouts later) that pays forgets the verdict
  h = gate(hardware_reprobe_every=2)
  h.begin_rollout(0, buckets)
  h.begin_rollout(0, buckets)
  assert h.state.status[1] == "probing"
  _feed(h, 1, None, 100.0, 2)
  _feed(h, 1, "4_1_5", 150.0, 2, accept_len=3.5)
  assert h.state.status[1] == "pays" and gate().state.status[1] == "probing"

  # acceptance verdicts stay with their run
  a = gate()
  _feed(a, 1, None, 100.0, 2)
  _feed(a, 1, "4_1_5", 50.0, 2, accept_len=1.1)  # ceiling 2.3: the drafts fall short
  _feed(a, 1, "3_1_4", 60.0, 2, accept_len=1.1)
  assert a.state.reason[1] == "acceptance" and gate().state.status[1] == "probing"

  path.write_text("{not json")
  assert gate().state.status[1] == "probing"  # a damaged cache: measured again, nothing raised


def test_config_validation():
  for kw in ({"min_chunks": 0}, {"margin": -0.1}, {"reprobe_every": -1},
             {"hardware_reprobe_every": -2}, {"follow_traffic": -1},
             {"min_chunks": 8, "window": 4}):
    with pytest.raises(ValueError, match=next(iter(kw))):
      GateConfig(**kw)
  with pytest.raises(ValueError, match="4_x"):
    GateConfig(lead="4_x")


def _run(state, *chunks):
  for c in chunks:
    state = state.record(c)
  return state


def test_pure_transitions_from_recorded_chunks_to_the_verdicts():
  """GateState driven directly, every rate derived by hand: a plain chunk of 16 steps in 0.16 s
  is 100 tokens/s per row; a speculative one of 16 steps in 0.2 s with 32 drafts accepted in
  16 verifications is 3 tokens per verification x 80 steps/s = 240. Each (bucket, arm)'s first
  chunk is a warm-up (10 s here: counted, every ratio below would be far off), and window=2
  drops a slow plain chunk before the two fast ones. Earlier states never change."""
  cfg = GateConfig(min_chunks=2, margin=0.1, window=2, lead="4_1_5", reprobe_every=3,
                   hardware_reprobe_every=2, follow_traffic=0)
  s0 = GateState(cfg)
  s1 = s0.begin_rollout(0, {b: ARMS for b in (1, 2, 4)})
  assert s0.buckets == () and s0.prober is None and s0.rollouts == 0
  assert s1.status == {1: "probing", 2: "closed", 4: "closed"} and s1.prober == 0
  assert s1.record(Chunk(1, None, 0.0, 16)) is s1  # nothing measured
  s3 = s1.record(Chunk(3, None, 1.0, 16))  # a bucket without arms: its plain steps only,
  assert s3.at == s1.at and s3.steps_at == {3: ()}  # from its second chunk on
  assert s3.record(Chunk(3, None, 1.6, 16, read=8.0)).steps_at == {3: (Step(0.1, 8.0),)}

  plain = [Chunk(1, None, 10.0, 16), Chunk(1, None, 1.6, 16)] + [Chunk(1, None, 0.16, 16)] * 2
  s = _run(s1, *plain)
  assert s.allows(0, 1) and not s.allows(1, 1) and s.arms(0, 1) == ["4_1_5"]
  lead = [Chunk(1, "4_1_5", 10.0, 16, 32, 16)] + [Chunk(1, "4_1_5", 0.2, 16, 32, 16)] * 2
  paid = _run(s, *lead)  # ratio 240 / 100 = 2.4 >= 1.1; ceiling 2.4 x (4 + 1) / 3 = 4
  assert paid.decisions == ({"bucket": 1, "verdict": "pays", "reason": None, "best_arm": "4_1_5",
                             "ratio": 2.4, "ceiling": 4.0, "accept_len": 3.0,
                             "plain_chunks": 2, "rollout": 1},)
  assert paid.status == {1: "pays", 2: "probing", 4: "closed"} and paid.drafter_wanted()
  assert s.status[1] == "probing" and s.decisions == () and not s.hardware_ok

  # bucket 2: the lead delivers 2 tokens x 40 steps/s = 80 (ratio 0.8, ceiling 0.8 x 5 / 2 =
  # 2 >= 1.1: the drafts fall short, not the hardware), so 3_1_4 is probed too: 2 x 50 = 100,
  # ratio 1.0 < 1.1 (ceiling 1.0 x 4 / 2 = 2): declined for acceptance with bucket 4
  s = _run(paid, Chunk(2, None, 10.0, 16), *[Chunk(2, None, 0.16, 16)] * 2,
           Chunk(2, "4_1_5", 10.0, 16, 16, 16), *[Chunk(2, "4_1_5", 0.4, 16, 16, 16)] * 2)
  assert s.status[2] == "probing" and s.decisions == paid.decisions
  assert s.arms(0, 2) == ["4_1_5", "3_1_4"] and s.probe_arm(2, "off") == "3_1_4"
  s = _run(s, Chunk(2, "3_1_4", 10.0, 16, 16, 16), *[Chunk(2, "3_1_4", 0.32, 16, 16, 16)] * 2)
  assert s.decisions[-1] == {"bucket": 2, "verdict": "declined", "reason": "acceptance",
                             "best_arm": "3_1_4", "ratio": 1.0, "ceiling": 2.0,
                             "accept_len": 2.0, "plain_chunks": 2, "rollout": 1}
  assert s.status == {1: "pays", 2: "declined", 4: "declined"}
  assert s.reason == {2: "acceptance", 4: "acceptance"}
  assert s.drafter_wanted() and s.hardware_verdicts() == {}

  # re-probed reprobe_every=3 prober rollouts after the decline (another worker's don't
  # count), the lead alone again, with plain decoding's measurement kept: 3 x 16 steps/s = 48,
  # ratio 0.48, ceiling 0.48 x 5 / 3 = 0.8 < 1.1: declined for hardware (4 keeps its verdict)
  for worker, status in ((1, "declined"), (0, "declined"), (0, "declined"), (0, "probing")):
    s = s.begin_rollout(worker, {b: ARMS for b in (1, 2, 4)})
    assert s.status[2] == status
  assert s.rollouts == 4 and s.probe_arm(2, "off") == "4_1_5"
  s = _run(s, *[Chunk(2, "4_1_5", 1.0, 16, 32, 16)] * 2)
  assert s.decisions[-1] == {"bucket": 2, "verdict": "declined", "reason": "hardware",
                             "best_arm": "4_1_5", "ratio": 0.48, "ceiling": 0.8,
                             "accept_len": 3.0, "plain_chunks": 2, "rollout": 4}
  assert s.reason == {2: "hardware", 4: "acceptance"}
  assert s.hardware_verdicts() == {2: {"best_arm": "4_1_5", "ratio": 0.48, "ceiling": 0.8,
                                       "accept_len": 3.0}}
  s = s.begin_rollout(0, {})
  assert s.status[2] == "declined"
  assert s.begin_rollout(0, {}).status[2] == "probing"  # hardware_reprobe_every=2


def test_a_probe_waits_for_min_chunks_of_plain_decoding_as_of_each_arm():
  """The gate decides once the bucket has `min_chunks` counted plain chunks AND as many of
  each probed arm (module docstring): three fast counted chunks of the lead against two of
  plain decoding (min_chunks=3) decide nothing; the third plain chunk decides."""
  cfg = GateConfig(min_chunks=3, margin=0.1, lead="4_1_5", follow_traffic=0)
  s = GateState(cfg).begin_rollout(0, {1: ARMS, 2: ARMS})
  s = _run(s, Chunk(1, None, 10.0, 16), Chunk(1, "4_1_5", 10.0, 16, 32, 16),  # warm-ups
           *[Chunk(1, None, 0.16, 16)] * 2, *[Chunk(1, "4_1_5", 0.2, 16, 32, 16)] * 3)
  assert s.status[1] == "probing" and s.decisions == ()
  s = _run(s, Chunk(1, None, 0.16, 16))
  assert s.status[1] == "pays" and s.decisions[-1]["plain_chunks"] == 3


def test_a_ceiling_between_one_and_the_bar_is_a_hardware_verdict():
  """The reason is "hardware" whenever the best case (every draft accepted) stays under
  1 + margin, not only under 1: plain 100 tokens/s per row; the lead at 2 tokens per
  verification over 0.64 s chunks of 16 steps is 50 (ratio 0.5), its ceiling 0.5 x 5 / 2 =
  1.25 < 1.3. No other drafting arm is probed (no drafter could pay)."""
  cfg = GateConfig(min_chunks=2, margin=0.3, lead="4_1_5", follow_traffic=0)
  s = GateState(cfg).begin_rollout(0, {1: ARMS, 2: ARMS})
  s = _run(s, Chunk(1, None, 10.0, 16), *[Chunk(1, None, 0.16, 16)] * 2,
           Chunk(1, "4_1_5", 10.0, 16, 16, 16), *[Chunk(1, "4_1_5", 0.64, 16, 16, 16)] * 2)
  d = s.decisions[-1]
  assert (d["verdict"], d["reason"], d["best_arm"]) == ("declined", "hardware", "4_1_5")
  assert d["ratio"] == pytest.approx(0.5) and d["ceiling"] == pytest.approx(1.25)
  assert s.reason == {1: "hardware", 2: "hardware"} and not s.hardware_ok
  assert "3_1_4" not in s.at[1].spec and not s.at[1].wide


def test_cached_hardware_verdicts_decline_from_the_smallest_cached_bucket():
  """Two cached hardware verdicts (buckets 2 and 4): the run starts with 2 and everything
  above it declined for hardware, and probes bucket 1."""
  s = GateState(GateConfig(lead="4_1_5")).begin_rollout(
      0, {b: ARMS for b in (1, 2, 4, 8)},
      cached={4: {"ceiling": 0.7}, 2: {"ceiling": 0.9}, 16: {"ceiling": 0.5}})
  assert s.status == {1: "probing", 2: "declined", 4: "declined", 8: "declined"}
  assert set(s.reason.values()) == {"hardware"}
  assert s.decisions[0]["bucket"] == 2 and s.decisions[0]["cached"]


def test_rates_weigh_chunks_by_their_steps_and_ceilings_by_depth_plus_one():
  """probe.rate: tokens per row per step x steps per second over every chunk (chunks of
  16 and 8 steps); probe.measured: an arm's (ratio, ratio x (depth + 1) / tokens per
  verification), by hand."""
  plain = (Chunk(1, None, 0.16, 16), Chunk(1, None, 0.08, 8))  # 24 steps in 0.24 s
  assert probe.rate(plain) == pytest.approx(100.0)
  lead = (Chunk(1, "4_1_5", 0.2, 16, 32, 16), Chunk(1, "4_1_5", 0.1, 8, 16, 8))
  assert probe.accept_len(lead) == pytest.approx(3.0)  # (48 + 24) / 24
  assert probe.rate(lead) == pytest.approx(3.0 * 24 / 0.3)  # 240
  r = probe.Bucket(plain=plain, spec={Strategy("4_1_5"): lead})
  ratio, ceiling = probe.measured(r)["4_1_5"]
  assert ratio == pytest.approx(2.4) and ceiling == pytest.approx(2.4 * 5 / 3.0)
  assert probe.measured(probe.Bucket(spec={Strategy("4_1_5"): lead})) == {}  # no plain rate


def test_plain_step_times_are_the_median_of_the_latest_kept():
  """probe.stepped keeps a bucket's latest STEPS_KEPT plain steps (its first chunk a
  warm-up); step_seconds is their median (one slow step, a GC pause, does not move it)."""
  steps_at = {}
  chunks = ([Chunk(2, None, 50.0, 16)] + [Chunk(2, None, 1.6, 16)] * 10
            + [Chunk(2, None, 0.16, 16)] * probe.STEPS_KEPT)  # 0.1 s a step, then 0.01 s
  for c in chunks:
    steps_at = probe.stepped(steps_at, c)
  assert len(steps_at[2]) == probe.STEPS_KEPT
  assert probe.step_seconds(steps_at, 2) == pytest.approx(0.01)
  assert probe.stepped(steps_at, Chunk(2, "4_1_5", 9.0, 16, 16, 16)) == steps_at
  outlier = {4: (Step(0.01), Step(0.01), Step(0.01), Step(1.0))}
  assert probe.step_seconds(outlier, 4) == pytest.approx(0.01)


def test_what_a_row_adds_to_a_step_is_never_negative():
  """row_seconds fits with every coefficient >= 0: steps that get cheaper with more rows
  (2 ms at 1 row, 1 ms at 2; an exact fit would need -1 ms a row) are best explained by a
  fixed cost alone, so a row adds 0 and the bound on a 5-token arm is its depth + 1."""
  steps = {1: (Step(2e-3),), 2: (Step(1e-3),)}
  assert probe.row_seconds(steps) == 0.0
  assert probe.plain_bound(steps, 2, Strategy("4_1_5")) == pytest.approx(5.0)


def _plain_traffic(g):
  """A rollout of plain chunks at buckets 1 (2 chunks) and 8 (1, half the time at 1: a probe
  at 8, which would open 1 too, worth 1.5x one at 1)."""
  g.begin_rollout(0, {1: ARMS, 8: ARMS})
  _feed(g, 1, None, 100.0, 2)
  _feed(g, 8, None, 100.0, 1, live=8)


def test_probation_stays_where_chunks_keep_coming_unless_elsewhere_earns_twice():
  """placement.follow_time's staleness: a probe at bucket 1 that sees chunks every rollout
  is not stale by age; before any speculative chunk of it is measured it moves only to a
  bucket that could earn twice what it could (both best cases 5x here: the worth is the
  time, 0.16 s a rollout at 8 and the 0.32 s at 1 a probe at 8 would open too, against
  0.32 s at 1, 1.5x: it stays), and once its lead is
  measured, it stays however long it has been probing. Moved, it keeps nothing funded."""
  g = _gate(buckets=(1, 8), min_chunks=50, follow_traffic=2)
  for _ in range(5):
    _plain_traffic(g)
    assert g.state.status == {1: "probing", 8: "closed"}
  for _ in range(4):
    g.begin_rollout(0, {1: ARMS, 8: ARMS})
    _feed(g, 1, "4_1_5", 150.0, 1)
    _feed(g, 8, None, 100.0, 6, live=8)
    assert g.state.status == {1: "probing", 8: "closed"}
  h = _gate(buckets=(1, 8), min_chunks=50, follow_traffic=0)
  for _ in range(3):
    h.begin_rollout(0, {1: ARMS, 8: ARMS})
    _feed(h, 1, None, 100.0, 1)
    _feed(h, 8, None, 100.0, 3, live=8)  # 3x the time at 1 (worth 4x): moves
  assert h.state.status == {1: "closed", 8: "probing"} and h.state.at[1].funded == frozenset()


def test_a_bucket_earns_nothing_where_its_best_case_stays_under_the_bar():
  """placement.earns: 0 where the ceiling (here measured: ratio 0.82 at 4 tokens per
  verification, 0.82 x 5 / 4 = 1.025) would not clear 1 + margin (1.05); with margin 0 the
  seconds a rollout spends there x (1 - 1 / 1.025)."""
  a = Strategy("4_1_5")
  for margin, want in ((0.05, 0.0), (0.0, 1.0 * (1 - 1 / 1.025))):
    s = GateState(GateConfig(lead="4_1_5", margin=margin)).begin_rollout(0, {1: ARMS, 2: ARMS})
    s = s.put(2, dataclasses.replace(s.at[2], plain=(Chunk(2, None, 0.16, 16),) * 2,
                                     spec={a: (Chunk(2, a, 64 / 82, 16, 48, 16),) * 2}))
    s = dataclasses.replace(s, ledger=s.ledger.decoded(2, 1.0))
    assert placement.earns(s, 2) == pytest.approx(want, abs=1e-12)


def test_the_prober_speculates_under_a_probe_once_its_plain_decoding_is_half_measured():
  """Closed buckets under the one on probation run its arms on the prober (its batch
  compacts through them) once plain decoding at the probed bucket is half measured
  (min_chunks 4: 2 counted chunks), not before, and never on another worker."""
  g = _gate(buckets=(1, 2, 4, 8), min_chunks=4)
  s = g.state.put(1, dataclasses.replace(g.state.at[1], status="closed", funded=frozenset()))
  g.state = s.start_probe(8)._fund()
  _feed(g, 8, None, 100.0, 1, live=8)
  assert g.arms(0, 4) == [] and not g.allows(0, 4)
  _feed(g, 8, None, 100.0, 1, live=8)
  assert g.arms(0, 4) == ["4_1_5"] and g.allows(0, 4) and g.allows(0, 1)
  assert not g.allows(1, 4) and g.arms(1, 4) == []


def test_the_prober_holds_its_batch_at_the_probed_bucket_until_the_probe_is_judged():
  """The prober's batch at a bucket on probation stays there (`holds`: it does not compact
  away as its rows finish) once the probe may run there, until it has min_chunks counted
  chunks of its arm: not before plain decoding there is measured, not on another worker or
  at another bucket, not once judged, never without gating."""
  g = _gate(buckets=(1, 2, 4, 8), min_chunks=2)
  s = g.state.put(1, dataclasses.replace(g.state.at[1], status="closed", funded=frozenset()))
  g.state = s.start_probe(8)._fund()
  assert not g.holds(0, 8)  # plain decoding there not measured yet: nothing to wait for
  _feed(g, 8, None, 100.0, 2, live=8)
  assert g.holds(0, 8) and not g.holds(1, 8) and not g.holds(0, 4)
  _feed(g, 8, "4_1_5", 300.0, 1)  # the warm-up and one counted chunk
  assert g.holds(0, 8) and g.state.status[8] == "probing"
  _feed(g, 8, "4_1_5", 300.0, 1)
  assert g.state.status[8] == "pays" and not g.holds(0, 8)
  open_gate = GateState(GateConfig(gating=False)).begin_rollout(0, {8: ARMS})
  assert not placement.holds(open_gate, 0, 8)


def test_one_probation_at_a_time_reprobes_wait_for_it():
  """A cached hardware verdict at 4 is due for a re-probe after hardware_reprobe_every=2
  prober rollouts, but bucket 1 is on probation: it waits (one probation at a time)."""
  s = GateState(GateConfig(lead="4_1_5", hardware_reprobe_every=2, follow_traffic=0))
  s = s.begin_rollout(0, {b: ARMS for b in (1, 2, 4)}, cached={4: {"ceiling": 0.8}})
  for _ in range(4):
    s = s.begin_rollout(0, {b: ARMS for b in (1, 2, 4)})
    assert s.status == {1: "probing", 2: "closed", 4: "declined"}


# ------------------------------------------------------------------------ through the engine
CFG = TINY


def _requests(n):
  rng = np.random.RandomState(0)
  return [Request(list(rng.randint(1, 61, rng.randint(2, 12))), i) for i in range(n)]


def _plain_greedy(params, n):
  """`_requests(n)`, greedy sampling, and their plain decoding's responses by request id."""
  reqs, sp = _requests(n), SamplingParams(temperature=0.0)
  return reqs, sp, {r.request_id: r.response_ids
                    for r in Engine(params, CFG, EngineConfig(**SMALL)).generate(reqs, sp)}


# a speculating engine compiling in the background, its arm 3_1_4
BACKGROUND = SpecConfig(strategy="3_1_4", bs_threshold=4, patience=1, use_kernel=False,
                        background_compile=True)


def test_workers_compile_and_speculate_only_where_the_gate_opens(tiny):
  """Two workers share a gate. While a bucket is probed only the prober compiles speculative
  executables, that bucket's only (and, as its call ends, the next rollout's probe's; its
  speculating batch does not compact into buckets not compiled for); a bucket declined stops
  speculation on both; a bucket that pays is compiled
  by the other worker at its next rollout and speculated at. Greedy outputs stay plain
  decoding's throughout."""
  params, dparams = tiny
  reqs, sp, plain = _plain_greedy(params, 9)
  spec = BACKGROUND
  gate = SpecGate(GateConfig(min_chunks=1, margin=1e6, reprobe_every=0))  # never pays
  a, b = (Engine(params, CFG, EngineConfig(**SMALL, spec=spec), drafter_params=dparams,
                 worker_id=i) for i in (0, 1))

  def run(w):  # (the two workers' rollouts take turns: one cell of the gate, shared)
    out = {r.request_id: r.response_ids
           for r in w.generate(reqs, sp, policies=PolicyCells(gate=gate))}
    w.compiles.wait(timeout=600)
    for k, v in plain.items():
      np.testing.assert_array_equal(out[k], v)

  def spec_buckets(w):
    return {r.batch for r in w.compile_log if r.name == "spec"}

  probed = set()  # every bucket on probation so far (where the time is: gate.py)
  for _ in range(12):  # until every bucket is declined
    probed |= {q for q, st in gate.state.status.items() if st == "probing"}
    run(a)
    probed |= {d["bucket"] for d in gate.state.decisions}  # (moved to, or decided there)
    # (and the next rollout's: the prober compiles its probe's arm as its call ends)
    probed |= {q for q, st in gate.next_rollout().state.status.items() if st == "probing"}
    run(b)
    assert gate.state.prober == 0 and spec_buckets(b) == set()
    assert spec_buckets(a) <= probed
    assert {c.bucket for c in a.chunk_log if c.mode != "plain"} <= probed
    if set(gate.state.status.values()) == {"declined"}:
      break
  assert gate.state.status == {1: "declined", 2: "declined", 4: "declined"}
  n_a, n_b = len(a.chunk_log), len(b.chunk_log)
  run(a)
  run(b)
  assert all(c.mode == "plain" for c in a.chunk_log[n_a:] + b.chunk_log[n_b:])
  assert spec_buckets(b) == set()

  paid = dataclasses.replace(gate.state.at[1], status="pays")
  gate.state = dataclasses.replace(gate.state, at={**gate.state.at, 1: paid})
  # (as if measured: the other worker compiles bucket 1 now)
  run(b)
  assert spec_buckets(b) == {1}
  n_b = len(b.chunk_log)
  run(b)
  assert any(c.mode == "3_1_4" and c.bucket == 1 for c in b.chunk_log[n_b:])
  assert all(c.mode == "plain" for c in b.chunk_log[n_b:] if c.bucket > 1)


def _every_bucket(state, status, arms=()):
  """`state` with every bucket's status set (as if measured), `arms` funded there."""
  return dataclasses.replace(state, at={
      b: dataclasses.replace(r, status=status, funded=frozenset(map(Strategy, arms)))
      for b, r in state.at.items()})


def test_what_the_next_call_compiles_as_it_starts_compiles_between_calls(tiny):
  """As a call ends, what the next one would compile as it starts, given the gate as the
  next rollout will begin (`SpecGate.next_rollout`), is queued on the compile thread: the
  arms of the buckets it opens and, this call untracked and the next tracked, the drafter's
  prefill after each of this call's prefills' shapes (`track_prompt`) and its tracking at
  the buckets it decoded plainly at. The next call then compiles none of it again
  (executables compiled from abstract shapes run on its arrays), no chunk of it compiles,
  it speculates, and its greedy outputs are plain decoding's. Where the next rollout opens
  nothing, nothing is queued."""
  params, dparams = tiny
  reqs, sp, plain = _plain_greedy(params, 4)
  spec = BACKGROUND

  class Untracked(SpecGate):  # (this call may not speculate; the next rollout's gate: `then`)
    then = "declined"

    def may_speculate(self):
      return False

    def next_rollout(self):
      return SpecGate(_every_bucket(self.state, self.then,
                                    ["3_1_4"] if self.then == "pays" else []))

  def ahead(w):
    return {r.key for r in w.compile_log if r.name in ("track", "track_prompt", "spec")}
  for then in ("declined", "pays"):
    gate = Untracked(GateConfig(min_chunks=10_000, window=10_000, reprobe_every=0))
    gate.then = then
    w = Engine(params, CFG, EngineConfig(**SMALL, spec=spec), drafter_params=dparams)
    w.generate(reqs, sp, policies=PolicyCells(gate=gate))
    w.compiles.wait(timeout=600)
    assert all(c.mode == "plain" for c in w.chunk_log)
    before = ahead(w)
    if then == "declined":
      assert before == set()
      continue
    assert {k.name for k in before} == {"track", "track_prompt", "spec"}
    assert {c.bucket for c in w.chunk_log} <= {r.batch for r in w.compile_log
                                                if r.name == "track"}
    assert {r.batch for r in w.compile_log if r.name == "spec"} == set(SMALL["buckets"])
    n = len(w.chunk_log)
    out = {r.request_id: r.response_ids for r in w.generate(
        reqs, sp, policies=PolicyCells(gate=SpecGate(_every_bucket(gate.state, "pays",
                                                                    ["3_1_4"]))))}
    chunks = w.chunk_log[n:]
    assert ahead(w) == before  # nothing of it compiled again, in the foreground or not
    assert any(c.mode == "3_1_4" for c in chunks) and not any(c.compiled for c in chunks)
    for k, v in plain.items():
      np.testing.assert_array_equal(out[k], v)


def test_a_bucket_the_gate_opens_mid_call_compiles_and_speculates_in_that_call(tiny):
  """A worker's call starts tracked with nothing open to it (another worker probes), and
  mid-call the gate opens every bucket (that worker's probe paid): the arms compile on this
  worker's thread during the call (`CompilePlan.submit` before each chunk), and its batch
  speculates before the call ends, not from its next call; greedy outputs stay plain
  decoding's. A call on a gate that never opens compiles and speculates nothing."""
  params, dparams = tiny
  reqs, sp, plain = _plain_greedy(params, 9)

  class Tracked(SpecGate):  # (a probe funded elsewhere: the call keeps the drafter's cache)
    def may_speculate(self):
      return True

  for opens in (False, True):
    gate = Tracked(GateConfig(min_chunks=10_000, window=10_000, reprobe_every=0))
    gate.begin_rollout(1, {b: ["3_1_4", "off"] for b in SMALL["buckets"]})  # (the prober)
    w = Engine(params, CFG, EngineConfig(**SMALL, spec=BACKGROUND), drafter_params=dparams)
    seen = []

    def before_chunk():
      seen.append(len(w.chunk_log))
      if opens and len(seen) == 2:  # (the other worker's verdict)
        gate.state = _every_bucket(gate.state, "pays", ["3_1_4"])
      if opens and len(seen) == 3:  # (its arms compiled by now: the thread is waited for)
        w.compiles.wait(timeout=600)

    out = {r.request_id: r.response_ids for r in w.generate(
        reqs, sp, policies=PolicyCells(gate=gate), hooks=EngineHooks(before_chunk=before_chunk))}
    w.compiles.wait(timeout=600)
    for k, v in plain.items():
      np.testing.assert_array_equal(out[k], v)
    spec = {r.batch for r in w.compile_log if r.name == "spec"}
    modes = {c.mode for c in w.chunk_log[2:]}
    if not opens:
      assert spec == set() and modes == {"plain"}
      continue
    assert spec and spec <= set(SMALL["buckets"])
    assert "3_1_4" in modes, [(c.bucket, c.live, c.mode) for c in w.chunk_log]


def test_a_chunks_bytes_are_the_weights_and_its_live_rows_kv(tiny):
  """The gate fits plain decoding's step time to the bytes a chunk reads (`Engine._read`):
  under paged attention the weights and the KV slots of its live rows, not its bucket's
  rows' windows (a finished row kept in the batch reads no page). From one plain chunk to
  the next at a bucket, the same rows live and none finishing, the bytes grow by the rows'
  new tokens: live x steps slots; a batch holding finished rows included."""
  params, dparams = tiny
  # 4 rows ending 5, 33, 41 and 48 tokens in: 3 rows live at bucket 4 for 7 chunks
  reqs = [dataclasses.replace(r, max_new_tokens=n) for r, n in zip(_requests(4), (5, 33, 41, 48))]
  gate = SpecGate(GateConfig(min_chunks=10_000, window=10_000, reprobe_every=0))
  w = Engine(params, CFG, EngineConfig(**{**SMALL, "max_new_tokens": 48}, spec=SpecConfig(
      strategy="3_1_4", use_kernel=False)), drafter_params=dparams)
  w.generate(reqs, SamplingParams(temperature=0.0), policies=PolicyCells(gate=gate))
  plan = w._plan(gate)
  weights = w.compiles.step_bytes(plan, 0, 0)
  slot = w.compiles.step_bytes(plan, 1, 1) - weights
  log = w.chunk_log
  pairs = [(a, b) for a, b in zip(log, log[1:])
           if a.mode == b.mode == "plain" and a.bucket == b.bucket and a.live == b.live
           and a.tokens == a.live * a.steps]
  assert pairs and any(a.live < a.bucket for a, _ in pairs)
  for a, b in pairs:
    assert b.read - a.read == pytest.approx(a.live * a.steps * slot), (a, b)
  assert all(weights < m.read < weights + m.bucket * 64 * slot for m in log)


def test_drafter_data_is_captured_only_while_the_gate_wants_the_drafter(tiny):
  """Hidden states (the drafter's training data) leave the device only once a probe has shown
  drafts can pay here; then they are exactly what a worker without a gate captures."""
  params, dparams = tiny
  reqs, sp = _requests(5), SamplingParams(temperature=0.0)
  spec = SpecConfig(strategy="3_1_4", bs_threshold=1, patience=1, use_kernel=False)
  ecfg = EngineConfig(**SMALL, spec=spec, capture_hidden=True)
  ref = {r.request_id: r.hidden for r in Engine(
      params, CFG, ecfg, drafter_params=dparams).generate(reqs, sp, speculate=False)}
  # a probe that never decides (its verdict is timing's): whether drafts pay is set by hand
  gate = SpecGate(GateConfig(min_chunks=10_000, window=10_000, reprobe_every=0))
  w = Engine(params, CFG, ecfg, drafter_params=dparams)
  cells = PolicyCells(gate=gate)
  assert all(r.hidden is None for r in w.generate(reqs, sp, policies=cells))  # nothing shows
  # drafts pay yet
  gate.state = dataclasses.replace(gate.state, hardware_ok=True)  # as if a probe measured
  # a ceiling over the bar
  got = w.generate(reqs, sp, policies=cells)
  assert gate.drafter_wanted() and all(r.hidden is not None for r in got)
  for r in got:  # the whole of it, every position
    assert r.hidden.shape == ref[r.request_id].shape
    np.testing.assert_allclose(r.hidden, ref[r.request_id], atol=1e-5)


def test_a_call_whose_bandit_runs_arms_the_engine_does_not_compile_is_refused(tiny):
  """An engine compiles for its bandit's arms (built once); a call's policies bring the bandit
  state to choose with. One with an arm the engine does not know is one clear error before
  anything runs; one within them (evaluation's own bandit, fewer arms) decodes."""
  from tlt_jax.rollout.policies.cells import make_selector
  from tlt_jax.rollout.policies.mab import bandit_config
  params, dparams = tiny
  spec = SpecConfig(strategy="3_1_4", bs_threshold=4, patience=1, use_kernel=False)
  w = Engine(params, CFG, EngineConfig(**SMALL, spec=spec), drafter_params=dparams,
             bandit=bandit_config("beg", {1: ["3_1_4", "off"]}))
  reqs, sp = _requests(2), SamplingParams(temperature=0.0)
  with pytest.raises(ValueError, match=r"runs \['2_1_3'\], which this engine does not"):
    w.generate(reqs, sp, policies=PolicyCells(make_selector("beg", {1: ["2_1_3", "off"]})))
  assert w.chunk_log == [] and w.compile_log == []
  sel = make_selector("fixed", strategy="off")
  assert len(w.generate(reqs, sp, policies=PolicyCells(sel))) == 2


def test_a_probe_restored_from_a_checkpoint_starts_its_probation_afresh():
  """A resume restarts a probing bucket's probation at the restored rollout, funded again on
  the first rollout after it (restore's docstring): follow_time finds it neither unfunded nor
  stale by age there, so with no chunk at it for 2 rollouts (follow_traffic=3) a closed bucket
  that earns more, not twice as much, does not take the probation; a third quiet rollout
  makes it stale."""
  g = _gate(buckets=(1, 8), min_chunks=50, follow_traffic=3)
  for _ in range(6):
    _plain_traffic(g)
  assert g.state.status == {1: "probing", 8: "closed"}
  h = SpecGate(GateState.restore(g.state.cfg, g.state.state_dict()))
  for _ in range(2):
    h.begin_rollout(0, {1: ARMS, 8: ARMS})
    _feed(h, 8, None, 100.0, 3, live=8)
    assert h.state.status == {1: "probing", 8: "closed"}
    assert h.state.probe_arms(1) == ["4_1_5"]
  h.begin_rollout(0, {1: ARMS, 8: ARMS})
  assert h.state.status == {1: "closed", 8: "probing"}


def test_a_probed_arm_measured_losing_gives_way_while_the_widened_probe_waits():
  """The lead loses at the bucket on probation (0.6x of plain decoding) with a ceiling that
  says the drafts, not the hardware, fall short: the probe widens to 3_1_4, and the lead,
  measured (min_chunks counted chunks), gives way to plain decoding there (`gives_way`):
  not before it is measured, not the arm still to measure, not an arm at least as fast as
  plain decoding, not at a bucket not on probation. The prober's batch is held at the
  bucket only for a probed arm still to measure that is compiled (`holds`' `ready`), and the
  buckets under the probe no longer offer the lead (`below_probe`)."""
  g = _gate(min_chunks=4, follow_traffic=0)
  s = g.state.put(1, dataclasses.replace(g.state.at[1], status="closed", funded=frozenset()))
  g.state = s.start_probe(8)._fund()
  _feed(g, 8, None, 100.0, 4, live=8)
  assert g.holds(0, 8) and g.holds(0, 8, ready=[]) and g.arms(0, 4) == ["4_1_5"]
  _feed(g, 8, "4_1_5", 60.0, 3, accept_len=2.0)
  assert not g.gives_way(8, "4_1_5")  # 3 counted chunks of 4: not measured yet
  _feed(g, 8, "4_1_5", 60.0, 1, accept_len=2.0)
  assert g.state.status[8] == "probing" and g.state.at[8].wide
  assert g.gives_way(8, "4_1_5") and not g.gives_way(8, "3_1_4") and not g.gives_way(8, None)
  assert not g.gives_way(4, "4_1_5")
  assert g.holds(0, 8) and g.holds(0, 8, ready=["4_1_5", "3_1_4"])
  assert not g.holds(0, 8, ready=["4_1_5"])  # what is left to measure is not compiled
  assert g.arms(0, 4) == ["3_1_4"]  # (under the probe: the lead no longer)
  _feed(g, 8, "3_1_4", 101.0, 4, accept_len=2.0)  # as fast as plain: under the margin
  assert g.state.status[8] == "declined" and not g.gives_way(8, "4_1_5")
  # an arm measured at plain decoding's rate or faster does not give way
  g2 = _gate(min_chunks=2, follow_traffic=0)
  s = g2.state.put(1, dataclasses.replace(g2.state.at[1], status="closed", funded=frozenset()))
  g2.state = s.start_probe(8)._fund()
  _feed(g2, 8, None, 100.0, 2, live=8)
  _feed(g2, 8, "4_1_5", 102.0, 2, accept_len=2.0)  # under the 5% margin: widened
  assert g2.state.at[8].wide and not g2.gives_way(8, "4_1_5")


def _paying_at_8(**kw):
  """A gate whose probe at 8 paid with 4_1_5 at 1.2x of plain decoding (rates 120 vs 100 a
  row: with `_feed`'s chunks an arm's speed-up is its rate over plain's), opening 1-8."""
  g = _gate(min_chunks=4, follow_traffic=0, **kw)
  s = g.state.put(1, dataclasses.replace(g.state.at[1], status="closed", funded=frozenset()))
  g.state = s.start_probe(8)._fund()
  _feed(g, 8, None, 100.0, 4, live=8)
  _feed(g, 8, "4_1_5", 120.0, 4, live=8)
  assert g.state.status == {1: "pays", 2: "pays", 4: "pays", 8: "pays"}
  return g


def test_a_batch_speculating_at_a_paying_bucket_leaves_where_plain_decoding_beats_it():
  """`leaves(bucket, to)`: a batch speculating at 8 (paying: 4_1_5 at 1.2x with 8 rows), its
  rows fitting `to`, leaves where every arm measured at 8 with at most `to` rows (min_chunks
  chunks) delivers fewer tokens a row per second than plain decoding at `to` by the margin:
  4_1_5 at 130 with 2 rows against 150 at bucket 2 (130 x 1.05 < 150), not against 110 at
  4; not while another arm so measured would stay (3_1_4 at 145: 152 > 150); not before any
  arm is measured with so few rows, not where plain decoding at `to` is not measured (1),
  not to a bucket as large, not without gating."""
  g = _paying_at_8(window=8)  # (the gate keeps 8 chunks per arm and bucket)
  _feed(g, 4, None, 110.0, 4, live=4)
  _feed(g, 2, None, 150.0, 4, live=2)
  assert not g.leaves(8, 2)  # (no chunk at 8 with 2 rows or fewer yet)
  _feed(g, 8, "4_1_5", 130.0, 4, live=2)
  assert g.leaves(8, 2) and not g.leaves(8, 4)  # (4 rows: 130 against 110)
  assert not g.leaves(8, 1) and not g.leaves(8, 8) and not g.leaves(4, 2)
  _feed(g, 8, "3_1_4", 145.0, 4, live=2)
  assert not g.leaves(8, 2)
  _feed(g, 8, "3_1_4", 120.0, 4, live=2)  # (its 8 chunks: 131 a row)
  assert g.leaves(8, 2)
  forced = SpecGate(dataclasses.replace(g.state, cfg=dataclasses.replace(g.state.cfg,
                                                                         gating=False)))
  assert not forced.leaves(8, 2)


def test_an_arm_is_compared_with_plain_decoding_at_the_bytes_its_steps_read():
  """probe.speedup: an arm's chunks against plain decoding's step time where they read
  (`plain_step`: t = a + b x bytes fitted to the bucket's plain chunks), not the plain
  chunks' mean rate. Plain decoding measured mostly late in a rollout (windows long: up to 30
  GB a step at 2 ms + 0.35 ms/GB) and an arm whose drafts are never accepted measured just
  after a prefill (15-16 GB), each of its steps 1.1x plain's there: it loses (1 / 1.1), where
  the rates said it won by 1.24x (the 7B recipe's prober, `2_1_3` at 1.14x with nothing
  accepted). No extrapolation: beyond the plain reads, their edge's time. Reads not known, or
  all alike: the rates' ratio, as before."""
  t = lambda gb: 2e-3 + 0.35e-3 * gb  # noqa: E731 (seconds per plain step at `gb` read)
  plain = [Chunk(8, None, 16 * t(gb), 16, read=gb * 1e9)
           for gb in (14, 20, 22.5, 25, 27.5, 30)]
  arm = Strategy("2_1_3")
  spec = [Chunk(8, arm, 16 * 1.1 * t(gb), 16, accepted=0, verifications=128, read=gb * 1e9)
          for gb in (15, 15.5, 16)]
  step = probe.plain_step(plain)
  assert step(15e9) == pytest.approx(t(15))
  assert step(10e9) == pytest.approx(t(14)) and step(40e9) == pytest.approx(t(30))
  assert probe.speedup(plain, spec) == pytest.approx(1 / 1.1)
  assert probe.rate(spec) / probe.rate(plain) == pytest.approx(1.24, abs=0.01)
  # two drafts accepted per verification: 3 tokens a step
  won = [c._replace(accepted=256) for c in spec]
  assert probe.speedup(plain, won) == pytest.approx(3 / 1.1)
  blind = [c._replace(read=0.0) for c in plain]
  assert probe.speedup(blind, spec) == pytest.approx(probe.rate(spec) / probe.rate(blind))
  r = probe.Bucket(status=probe.PROBING, plain=tuple(plain), spec={arm: tuple(spec)})
  assert probe.measured(r)[arm][0] == pytest.approx(1 / 1.1)
