"""The payoff rule (tlt_jax/rollout/policies/payoff.py) and the gate's use of it (gate.py), on hand-
computed cases: nothing speculative is compiled unless its best case repays the compile."""

import dataclasses

import pytest

from tlt_jax.rollout.policies import payoff
from tlt_jax.rollout.policies.cells import SpecGate
from tlt_jax.rollout.policies.gate import GateConfig, GateState
from tlt_jax.rollout.policies.verdicts import VerdictCache
from tlt_jax.rollout.policies.payoff import OPEN, PLAIN, SPEC, Ledger
from tlt_jax.rollout.policies.probe import Chunk, Step
from tlt_jax.rollout.policies.strategy import Strategy

ARMS = ["4_1_5", "3_1_4", "off"]


def test_the_rule_by_hand():
  """10 generate calls decoded 0.5 s at bucket 1 (T_1 = 0.05 s per rollout); its plain chunk
  compiled in 1.4 s. Nothing speculative measured yet: an arm costs 3 x 1.4 = 4.2 s (the
  prior), the bucket's one-off compiles 1.5 x 1.4 = 2.1 s. A 40-rollout run 10 rollouts in
  (30 left), payback 0.5, an arm whose ceiling is 5 (gain 0.8): at best 0.05 x 30 x 0.5 x 0.8
  = 0.6 s, short of 6.3 s; at 1.0 s per rollout 12 s, enough."""
  led = Ledger().compiled(PLAIN, 1, None, 1.4)
  for _ in range(10):
    led = led.called()
  led = led.decoded(1, 0.2).decoded(1, 0.3)
  assert led.per_rollout(1) == pytest.approx(0.05)
  assert led.arm_cost(1, "4_1_5", 3.0) == pytest.approx(4.2)
  assert led.open_cost(1) == pytest.approx(2.1)
  assert payoff.best_saving(led.per_rollout(1), 30, 0.5, 0.8) == pytest.approx(0.6)
  rule = dict(horizon=40, rollouts=10, payback=0.5, gain=0.8)
  assert not payoff.repays(0.05, cost=6.3, **rule)
  assert payoff.repays(1.0, cost=6.3, **rule)
  assert payoff.repays(0.05, cost=6.3, **{**rule, "horizon": 0})  # open-ended: always
  assert not payoff.repays(1.0, cost=None, **rule)  # nothing priced yet: not compiled
  assert payoff.repays(0.0, cost=0.0, **rule)  # compiled already: run it when it could gain
  assert not payoff.repays(1.0, cost=0.0, **{**rule, "gain": 0.0})
  assert not payoff.repays(1e9, cost=1.0, **{**rule, "rollouts": 40})  # the run is over

  # a measured compile prices every bucket: 4_1_5 took 6.0 s at bucket 2, whose plain chunk
  # took 1.5 s (factor 4): at bucket 1 it would take 1.4 x 4 = 5.6 s; another arm with no
  # measurement of its own takes every arm's mean factor; bucket 2 has opened
  led = led.compiled(PLAIN, 2, None, 1.5).compiled(SPEC, 2, "4_1_5", 6.0)
  assert led.arm_cost(1, "4_1_5", 3.0) == pytest.approx(5.6)
  assert led.arm_cost(1, "3_1_4", 3.0) == pytest.approx(5.6)
  assert led.arm_cost(2, "4_1_5", 3.0) == 6.0 and led.opened(2) and not led.opened(1)
  led = led.compiled(OPEN, 2, None, 1.0).compiled(OPEN, 2, None, 2.0)  # summed: 3.0 = 2 x 1.5
  assert led.open_cost(1) == pytest.approx(2.8)
  # a bucket no plain chunk compiled at is priced by the nearest one's
  assert led.plain_compile(4) == 1.5 and Ledger().arm_cost(1, "4_1_5", 3.0) is None


def test_costs_outlive_the_run_but_not_what_it_compiled():
  """A second run loads its executables from JAX's persistent cache in milliseconds: the
  costs an earlier run measured stand (the larger wins), but nothing counts as compiled."""
  cold = Ledger().compiled(PLAIN, 1, None, 1.4).compiled(SPEC, 1, "4_1_5", 4.6)
  warm = Ledger().compiled(PLAIN, 1, None, 0.02).remembered(cold.costs())
  assert warm.plain_compile(1) == 1.4 and warm.arm_cost(1, "4_1_5", 3.0) == 4.6
  assert not warm.opened(1) and warm.made == frozenset()
  assert Ledger.restore(cold.state_dict()).costs() == cold.costs()
  assert Ledger().remembered({"plain": {"x": 1}}) == Ledger()  # a damaged entry: ignored


def _rollout(g, workers=(0, 1), buckets=(1, 2, 4)):
  for w in workers:
    g.begin_rollout(w, {b: ARMS for b in buckets})


def _cpu_run(g, s_per_chunk, chunks_per_rollout, rollouts):
  """The default run on this CPU, as measured (a cold 40-step run: 14 counted plain chunks
  of 16 steps at bucket 1 in 22 rollouts of two workers, ~1000 tokens/s per row, i.e. 16 ms
  a chunk; the plain decode chunk compiled in 1.4 s at buckets 1-4). Yields after each
  rollout."""
  for r in range(rollouts):
    _rollout(g)
    if r == 0:
      for b in (1, 2, 4):
        g.compiled(PLAIN, b, None, 1.4)
    for b in (1, 2, 4):
      for _ in range(chunks_per_rollout):
        g.record(b, None, s_per_chunk, 16)
    yield r


def test_a_40_step_run_on_this_cpu_never_compiles_an_arm_it_cannot_repay():
  """At ~1 chunk of 16 ms per rollout per bucket (T_b = 8 ms per worker-rollout), the lead's
  best case over the run (every draft accepted: 5x) is < 0.016 x 40 x 0.5 x 0.8 = 0.26 s per
  bucket, against ~6 s of compiles: no bucket is ever funded, nothing compiles, no worker
  speculates, and the metrics say why. The same run at 100x the time per rollout (a GPU's
  long tail) funds the probe as soon as it is half measured."""
  g = SpecGate(GateConfig(lead="4_1_5", min_chunks=4, horizon=40, payback=0.5))
  for _ in _cpu_run(g, 0.016, 1, 40):
    for b in (1, 2, 4):
      assert g.arms(0, b) == [] and g.arms(1, b) == [] and not g.allows(0, b)
  s = g.summary()
  # one probation, at the bucket whose probe would open the most (4: 1 and 2 with it), never
  # funded
  assert s["status"] == {"1": "closed", "2": "closed", "4": "unfunded"}
  p = s["payoff"]["4"]
  assert p["arm"] == "4_1_5" and p["ceiling"] == 5.0 and p["best_saving"] == 0.0  # no rollouts left
  assert p["compile"] == pytest.approx(1.4 * (3.0 + 1.5))
  assert not g.drafter_wanted()

  g = SpecGate(GateConfig(lead="4_1_5", min_chunks=4, horizon=40, payback=0.5))
  funded_at = None
  for r in _cpu_run(g, 1.6, 1, 6):
    if g.arms(0, 1):
      funded_at = funded_at or r
  # 2 counted plain chunks (half of min_chunks) by rollout 3 (each bucket's first is a
  # warm-up); T_1 = 1.6 s x 2 chunks / 6 calls: 0.53 s x 37 x 0.5 x 0.8 = 7.9 s >= 6.3 s
  assert funded_at == 2 and g.arms(0, 1) == ["4_1_5"] and g.arms(1, 1) == []


def test_probing_stops_where_no_other_arm_could_repay_its_compile():
  """The lead falls short on acceptance (its ceiling clears the bar): an open-ended gate
  probes every other drafting arm, a gate with a horizon only those whose best case repays
  their compile; here none, so the bucket is declined for acceptance at once."""
  def gate(horizon):
    g = SpecGate(GateConfig(lead="4_1_5", min_chunks=2, margin=0.05, horizon=horizon))
    g.begin_rollout(0, {1: ARMS})
    g.compiled(PLAIN, 1, None, 1.0)
    g.compiled(SPEC, 1, "4_1_5", 3.0)  # the lead compiled already (its probe is paid for)
    for _ in range(3):
      g.record(1, None, 0.16, 16)  # 100 tokens/s per row (the first: a warm-up)
    for _ in range(3):  # 2 tokens per verification at 80 tokens/s: ratio 0.8, ceiling 2.0
      g.record(1, "4_1_5", 0.4, 16, 16, 16)
    return g

  assert gate(0).arms(0, 1) == ["4_1_5", "3_1_4"]
  # horizon 3: T_1 = 1.12 s / 1 call (the counted chunks); 3_1_4's best case (its ceiling
  # bounded by the lead's measured 2.0): 1.12 x 2 x 0.5 x 0.5 = 0.56 s < its compile, priced
  # by the lead's factor: 3 x 1.0 s
  g = gate(3)
  assert g.state.status[1] == "declined" and g.state.reason[1] == "acceptance"
  assert g.state.decisions[-1]["best_arm"] == "4_1_5"


def test_a_paying_bucket_compiles_only_the_arms_that_could_beat_its_best():
  """Bucket 1 pays with the lead at 2.4x. On every worker the lead's compile repays; "off"
  (plain decoding, ceiling 1) cannot beat 2.4x, so it is not compiled, until the arms'
  measured speed falls under plain decoding's (a stale drafter): then it is."""
  g = SpecGate(GateConfig(lead="4_1_5", min_chunks=2, margin=0.1, horizon=1000))
  g.begin_rollout(0, {1: ARMS})
  g.compiled(PLAIN, 1, None, 0.1)
  for _ in range(3):
    g.record(1, None, 0.16, 16)
  for _ in range(3):  # 3 tokens per verification, 80 steps/s: 240 tokens/s, ratio 2.4
    g.record(1, "4_1_5", 0.2, 16, 32, 16)
  assert g.state.status[1] == "pays"
  assert g.arms(1, 1) == ["4_1_5", "3_1_4"] and g.allows(1, 1)
  # the lead now delivers 1.5 tokens at 40 steps/s; with the 2 fast chunks still in its
  # window: 1.8 tokens per verification x 160 steps / 3.6 s = 80 tokens/s, 0.8x plain
  for _ in range(8):
    g.record(1, "4_1_5", 0.4, 16, 8, 16)
  g.begin_rollout(0, {1: ARMS})  # (asked again on the clock)
  assert g.arms(1, 1) == ARMS


def test_a_narrower_window_compiles_only_when_what_it_saves_repays_it():
  """An arm runs 0.2 s chunks at bucket 1 at a wider window than it needs; the narrower one
  would read 10% fewer bytes. At 5 chunks per rollout that saves 0.1 s per rollout: over 990
  rollouts left x 0.5, 49.5 s, against its compile (4.6 s, measured): compiled. At 0.05
  chunks per rollout: 0.5 s, not. Before the arm has a chunk there, the plain chunks' time
  stands for its (a chunk that would lose at the wider window runs plainly: `runs_wide`).
  An open-ended gate compiles every window; a probe, the windows its rows need (at a wider
  one its verdict would measure the window)."""
  g = SpecGate(GateConfig(lead="4_1_5", min_chunks=1, margin=0.0, horizon=1000))
  for _ in range(10):
    g.begin_rollout(0, {1: ARMS})
  g.compiled(PLAIN, 1, None, 1.4)
  g.compiled(SPEC, 1, "4_1_5", 4.6)
  assert g.state.status[1] == "probing" and g.repays_window(1, "4_1_5", 0.05, 0.1)
  g.state = g.state.put(1, dataclasses.replace(g.state.at[1], status="pays"))
  assert not g.repays_window(1, "4_1_5", 5, 0.1)  # no chunk measured there yet
  for _ in range(2):  # (the first chunk of each kind is a warm-up, not counted)
    g.record(1, None, 0.2, 16)
  assert g.repays_window(1, "4_1_5", 5, 0.1)  # the plain chunks' time
  assert not g.repays_window(1, "4_1_5", 0.05, 0.1)
  g.record(1, "4_1_5", 0.2, 16, 16, 16)
  g.record(1, "4_1_5", 0.01, 16, 16, 16)
  assert not g.repays_window(1, "4_1_5", 5, 0.1)  # the arm's own: 0.005 s a rollout
  g.record(1, "4_1_5", 0.39, 16, 16, 16)
  assert g.repays_window(1, "4_1_5", 5, 0.1)  # 0.2 s a chunk
  assert not g.repays_window(1, "4_1_5", 0.05, 0.1)
  assert SpecGate(GateConfig(horizon=0)).repays_window(1, "4_1_5", 0.0, 0.1)  # open-ended


def test_an_arm_runs_at_a_wider_window_only_while_its_tokens_outweigh_the_extra_bytes():
  """A speculative chunk at a compiled window wider than its rows' reads `extra` x a plain
  step's bytes there: bytes-bound, it costs at least `extra` plain steps, so it may run only
  while the arm's tokens per verification exceed `extra` (before a chunk of it, its best case
  depth + 1). The 32B recipe's bulk: 3.9x the bytes for ~3 tokens, measured 0.89x."""
  a, b, h = Strategy("3_1_4"), Strategy("4_1_5"), Strategy("hist_4")
  g = SpecGate(GateConfig(lead="3_1_4", min_chunks=1, margin=0.0, horizon=1000))
  g.begin_rollout(0, {64: ARMS})
  assert g.runs_wide(64, a, 3.9) and not g.runs_wide(64, a, 4.1)  # 4 at best
  assert g.runs_wide(64, b, 4.1) and not g.runs_wide(64, h, 5.1)
  for _ in range(2):  # 16 drafts accepted in 16 verifications: 2 tokens (after a warm-up)
    g.record(64, a, 0.3, 16, 16, 16)
  assert g.runs_wide(64, a, 1.9) and not g.runs_wide(64, a, 2.1)
  assert g.runs_wide(64, b, 4.1)  # (another arm: its own best case)


def test_compile_costs_are_kept_with_the_verdicts(tmp_path):
  """The second run of a config prices compiles at the first run's cold costs, not at its
  persistent-cache hits."""
  path = str(tmp_path / "verdicts.json")
  fp = {"device_kind": "cpu"}
  g = SpecGate(GateConfig(horizon=40), verdicts=VerdictCache(path, fp))
  g.begin_rollout(0, {1: ARMS})
  g.compiled(PLAIN, 1, None, 1.4)
  h = SpecGate(GateConfig(horizon=40), verdicts=VerdictCache(path, fp))
  h.begin_rollout(0, {1: ARMS})
  h.compiled(PLAIN, 1, None, 0.01)  # a persistent-cache hit
  assert h.state.ledger.plain_compile(1) == 1.4
  assert VerdictCache(path, {"device_kind": "gpu"}).load_costs() == {}


def test_payoff_config_validation():
  for kw in ({"horizon": -1}, {"payback": 0.0}, {"payback": 1.5}, {"compile_factor": 0.0}):
    with pytest.raises(ValueError, match=next(iter(kw))):
      GateConfig(**kw)


def test_the_ledger_survives_a_resume_and_funding_is_asked_again():
  g = SpecGate(GateConfig(lead="4_1_5", min_chunks=2, horizon=40))
  for _ in _cpu_run(g, 1.6, 1, 4):
    for _ in range(2):  # most of the time at 1 (the probe there is worth the most)
      g.record(1, None, 1.6, 16)
  assert g.arms(0, 1) == ["4_1_5"]
  s = GateState.restore(g.state.cfg, g.state.state_dict())
  assert s.ledger.costs() == g.state.ledger.costs() and s.ledger.calls == 8
  assert s.ledger.made == frozenset()
  assert s.at[1].funded == frozenset()  # asked again, by the first caller after the resume:
  s = s.begin_rollout(3, {b: ARMS for b in (1, 2, 4)})
  assert s.prober == 3 and s.at[1].funded == {"4_1_5"}  # the ledger still says it repays


def test_without_gating_every_bucket_is_open_and_compiles_are_still_priced():
  """tlt.spec.gate.enabled=False: every bucket speculates with every arm from the first
  rollout (no probe), the drafter is wanted throughout, a resume stays open, and a narrower
  attention window is still compiled only where it repays."""
  g = SpecGate(GateConfig(gating=False, horizon=40))
  assert g.drafter_wanted()  # before the first rollout too: spot training from the start
  assert g.allows(0, 1)  # and speculation (evaluation may decode before any training rollout)
  g.begin_rollout(0, {b: ARMS for b in (1, 2, 4)})
  g.begin_rollout(1, {b: ARMS for b in (1, 2, 4)})
  for b in (1, 2, 4):
    assert g.arms(1, b) == ARMS and g.allows(1, b) and g.probe_arm(b, "off") == "off"
  g.compiled(PLAIN, 1, None, 1.4)
  g.compiled(SPEC, 1, "4_1_5", 4.6)
  g.record(1, "4_1_5", 0.2, 16, 16, 16)
  g.record(1, "4_1_5", 0.2, 16, 16, 16)
  assert g.state.decisions == () and g.state.status == {1: "pays", 2: "pays", 4: "pays"}
  assert not g.repays_window(1, "4_1_5", 0.05, 0.1)  # 0.2 x 0.05 x 0.1 x 38 x 0.5 < 4.6 s
  h = SpecGate(GateState.restore(GateConfig(gating=False, horizon=40),
                                 GateState(GateConfig(horizon=40)).state_dict()))
  h.begin_rollout(0, {1: ARMS})
  assert h.arms(0, 1) == ARMS


def test_the_bandit_chooses_among_the_arms_the_gate_paid_for():
  """A paying bucket whose gate funded two of its four arms: the bandit's exploration rounds
  and its greedy choice stay among those two; given every arm (or none), it is the bandit it
  was (the same choices from the same seed)."""
  from tlt_jax.rollout.policies.cells import make_selector
  arms = ["4_1_5", "3_1_4", "hist_4", "off"]
  sel = make_selector("beg", {1: arms}, epsilon=0.5, seed=3, min_pulls=2)
  seen = set()
  for i in range(40):
    a = sel.select(1, arms=["3_1_4", "off"])
    seen.add(a)
    sel.update(a, 1, 10.0 if a == "3_1_4" else 5.0)
  assert seen == {"3_1_4", "off"}
  a, b = (make_selector("beg", {1: arms}, epsilon=0.5, seed=3, min_pulls=2) for _ in range(2))
  for i in range(30):
    x, y = a.select(1), b.select(1, arms=arms)
    assert x == y
    a.update(x, 1, float(i % 7))
    b.update(y, 1, float(i % 7))
  assert sel.select(1, arms=["6_1_7"]) == "6_1_7"  # none of the bucket's: the first given


def test_the_rule_at_its_boundaries():
  """A best case exactly equal to the compile repays it (1 s a rollout x 10 left x 0.5 x
  0.5 = 2.5 s); an arm's compile is priced by its own measured factor before the mean of
  every arm's (4_1_5 took 4x the plain chunk at bucket 2, 3_1_4 2x: at bucket 1, whose plain
  chunk took 0.5 s, 4_1_5 costs 2.0 s, an arm never measured the mean factor 3: 1.5 s)."""
  rule = dict(horizon=20, rollouts=10, payback=0.5, gain=0.5)
  assert payoff.repays(1.0, cost=2.5, **rule)
  assert not payoff.repays(1.0, cost=2.5000001, **rule)
  led = (Ledger().compiled(PLAIN, 2, None, 1.0).compiled(SPEC, 2, "4_1_5", 4.0)
         .compiled(SPEC, 2, "3_1_4", 2.0).compiled(PLAIN, 1, None, 0.5))
  assert led.arm_cost(1, "4_1_5", 3.0) == pytest.approx(2.0)
  assert led.arm_cost(1, "3_1_4", 3.0) == pytest.approx(1.0)
  assert led.arm_cost(1, "hist_4", 10.0) == pytest.approx(1.5)


def _with(s, b, **kw):
  return s.put(b, dataclasses.replace(s.at[b], **kw))


def test_a_compile_is_priced_per_worker_and_the_buckets_one_off_compiles_once():
  """funding.price: the prober's probe does not pay again for what it compiled in this run,
  but every worker compiles a paying bucket's arms itself (3.0 s here, measured), plus the
  bucket's one-off compiles (1.5 x the plain chunk's 1.0 s) until something is funded there."""
  from tlt_jax.rollout.policies import funding
  s = GateState(GateConfig(lead="4_1_5", horizon=100)).begin_rollout(0, {1: ARMS, 2: ARMS})
  s = s.compiled(PLAIN, 1, None, 1.0).compiled(SPEC, 1, "4_1_5", 3.0)
  a = Strategy("4_1_5")
  assert funding.price(s, 1, a, False) == 0.0  # the prober made both in this run
  assert funding.price(s, 1, a, True) == pytest.approx(3.0 + 1.5)
  s = _with(s, 1, status="pays", funded=frozenset({Strategy("3_1_4")}))
  assert funding.price(s, 1, a, True) == pytest.approx(3.0)  # the one-off compiles are paid


def test_what_a_batch_carries_down_is_the_next_funded_buckets_ratio_slowed_by_its_step():
  """funding.carried: rows at bucket 2 with nothing compiled there run at bucket 4's funded
  arm (3x plain there: 300 against 100 tokens/s per row), whose step takes 20 ms against
  10 ms at bucket 2: 3 x 10 / 20 = 1.5x plain decoding at 2. A bucket paying with funded
  arms of its own does not carry itself; nothing above the largest: 1.0."""
  from tlt_jax.rollout.policies import funding
  s = GateState(GateConfig(lead="4_1_5", horizon=100)).begin_rollout(
      0, {b: ARMS for b in (1, 2, 4)})
  a = Strategy("4_1_5")
  s = _with(s, 4, status="pays", funded=frozenset({a}),
            plain=(Chunk(4, None, 0.16, 16),) * 2, spec={a: (Chunk(4, a, 0.16, 16, 32, 16),) * 2})
  s = dataclasses.replace(s, steps_at={1: (Step(0.005),), 2: (Step(0.01),), 4: (Step(0.02),)})
  assert funding.carried(s, 2) == pytest.approx(1.5)
  assert funding.carried(s, 1) == 1.0  # 3 x 5 / 20 = 0.75: plain decoding is faster
  s = _with(s, 2, status="pays", funded=frozenset({Strategy("3_1_4")}))  # not measured at 2
  assert funding.carried(s, 2) == pytest.approx(1.5) and funding.carried(s, 4) == 1.0


def test_a_paying_bucket_funds_the_fastest_measured_arm_first_and_only_what_beats_it():
  """The lead (ratio 0.64, ceiling 0.64 x 5 / 2 = 1.6) falls short on acceptance, 3_1_4 is
  probed and pays (ratio 2.0, 3 tokens per verification). Funding, fastest measured first:
  3_1_4 (its best case over plain); then the lead would have to beat 2.0 with a ceiling of
  1.6, and "off" with 1.0: neither is compiled, on any worker."""
  g = SpecGate(GateConfig(lead="4_1_5", min_chunks=2, margin=0.1, horizon=1000))
  g.begin_rollout(0, {1: ARMS})
  g.compiled(PLAIN, 1, None, 0.1)
  for _ in range(3):
    g.record(1, None, 0.16, 16)  # 100 tokens/s per row
  for _ in range(3):
    g.record(1, "4_1_5", 0.5, 16, 16, 16)  # 2 x 32 steps/s = 64
  assert g.state.status[1] == "probing" and g.state.probe_arms(1) == ["4_1_5", "3_1_4"]
  for _ in range(3):
    g.record(1, "3_1_4", 0.24, 16, 32, 16)  # 3 x 66.7 steps/s = 200
  assert g.state.status[1] == "pays" and g.state.decisions[-1]["best_arm"] == "3_1_4"
  assert g.arms(1, 1) == ["3_1_4"] and g.state.at[1].funded == {"3_1_4"}


def test_an_open_ended_probe_funds_the_probed_arms_only():
  """Horizon 0: every compile repays, but on probation only what the probe measures is
  funded (the lead; every drafting arm once it widens), not "off" nor the other arms."""
  s = GateState(GateConfig(lead="4_1_5")).begin_rollout(0, {1: ARMS, 2: ARMS})
  assert s.at[1].funded == {"4_1_5"} and s.summary()["funded"] == {"1": ["4_1_5"]}


def test_an_arm_runs_wide_only_where_its_tokens_exceed_the_extra_bytes():
  """Tokens equal to the extra bytes do not exceed them: 4_1_5's best case, 5 tokens, at
  exactly 5x the bytes decodes plainly."""
  g = SpecGate(GateConfig(lead="4_1_5", horizon=1000))
  g.begin_rollout(0, {8: ARMS})
  assert not g.runs_wide(8, Strategy("4_1_5"), 5.0) and g.runs_wide(8, Strategy("4_1_5"), 4.99)


def test_a_paying_bucket_without_funded_arms_may_still_close():
  """SpecGate.closes: only a bucket that pays WITH funded arms is never closed (a funded arm
  stays funded); one that pays but funds nothing (no arm repays its compile) may be."""
  g = SpecGate(GateConfig(lead="4_1_5", horizon=100))
  g.begin_rollout(0, {1: ARMS, 2: ARMS})
  g.state = _with(g.state, 2, status="pays", funded=frozenset())
  assert g.closes(2) and g.closes(1)
  g.state = _with(g.state, 1, status="closed", funded=frozenset())
  assert not g.may_speculate()  # a bucket that pays without a funded arm runs nothing
  g.state = _with(g.state, 2, funded=frozenset({Strategy("4_1_5")}))
  assert not g.closes(2) and g.may_speculate()
