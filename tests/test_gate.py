"""The speculation gate (tlt_jax/rollout/gate.py): decisions from known per-row rates, and
the engine compiling and speculating only where the gate opens, losslessly."""

import jax
import numpy as np
import pytest

from tlt_jax.drafter.model import init_drafter
from tlt_jax.models import ModelConfig, init_params
from tlt_jax.rollout.engine import EngineConfig, Request, RolloutWorker, SpecConfig
from tlt_jax.rollout.gate import GateConfig, SpecGate
from tlt_jax.rollout.sampling import SamplingParams


def _feed(gate, bucket, arm, rate, n, live=1):
  """n chunks of `rate` tokens/s per live row (16 tokens per row each), after a first chunk
  50x slower where (bucket, arm) has not run yet: a warm-up the gate must not count."""
  if (bucket, arm) not in gate._warm:
    gate.record(bucket, arm, 16 * live, 50 * 16 / rate, live)
  for _ in range(n):
    gate.record(bucket, arm, 16 * live, 16 / rate, live)


def test_opens_bucket_by_bucket_while_it_pays_then_declines_the_rest():
  g = SpecGate(GateConfig(min_chunks=3, margin=0.1, reprobe_every=0))
  g.begin_rollout(7, [1, 2, 4, 8])  # the first to start a rollout probes
  g.begin_rollout(8, [1, 2, 4, 8])
  assert g.opened(7) == {1} and g.opened(8) == set()
  assert not g.allows(7, 1)  # plain decoding at bucket 1 not measured yet
  _feed(g, 1, None, 100.0, 3)
  assert g.allows(7, 1) and not g.allows(8, 1) and not g.allows(7, 2)
  _feed(g, 1, "4_1_5", 150.0, 2)
  assert g.status[1] == "probing"  # 2 speculative chunks < min_chunks
  _feed(g, 1, "off", 90.0, 1)
  assert g.status == {1: "pays", 2: "probing", 4: "closed", 8: "closed"}
  assert g.opened(8) == {1} and g.opened(7) == {1, 2}  # a paying bucket: every worker
  # at bucket 2 the best drafting arm is 5% faster, under the 10% margin: declined with 4, 8
  _feed(g, 2, None, 200.0, 3, live=2)
  _feed(g, 2, "3_1_4", 210.0, 2, live=2)
  _feed(g, 2, "4_1_5", 120.0, 2, live=2)
  assert g.status == {1: "pays", 2: "declined", 4: "declined", 8: "declined"}
  d = g.decisions[-1]
  assert d["bucket"] == 2 and d["best_arm"] == "3_1_4" and d["ratio"] == pytest.approx(1.05)
  assert g.opened(7) == {1}


def test_declines_when_only_off_was_measured_and_reprobes_later():
  g = SpecGate(GateConfig(min_chunks=2, margin=0.0, reprobe_every=3))
  g.begin_rollout(0, [1, 2])
  _feed(g, 1, None, 100.0, 2)
  _feed(g, 1, "off", 100.0, 2)  # no drafting arm measured: nothing shows drafts pay
  assert g.status == {1: "declined", 2: "declined"} and not g.drafter_wanted()
  g.begin_rollout(1, [1, 2])  # another worker's rollouts do not advance the clock
  g.begin_rollout(0, [1, 2])
  g.begin_rollout(0, [1, 2])
  assert g.status[1] == "declined"
  g.begin_rollout(0, [1, 2])  # 3 rollouts of the prober since the decline
  assert g.status == {1: "probing", 2: "declined"} and g.drafter_wanted()
  for _ in range(4):  # one bucket probed at a time: 2 waits for 1's verdict
    g.begin_rollout(0, [1, 2])
  assert g.status == {1: "probing", 2: "declined"}
  _feed(g, 1, "4_1_5", 130.0, 2)  # the drafter got better: pays now, bucket 2 reopens
  assert g.status == {1: "pays", 2: "probing"}


def test_a_probe_tries_each_drafting_arm_in_turn():
  g = SpecGate(GateConfig(min_chunks=4, margin=0.0))
  g.begin_rollout(0, [1, 2])
  arms = ["4_1_5", "3_1_4", "off"]
  assert g.probe_arm(1, arms, "off") == "4_1_5"  # the bandit's "off" is overridden
  _feed(g, 1, "4_1_5", 100.0, 1)
  assert g.probe_arm(1, arms, "off") == "3_1_4"
  assert g.probe_arm(2, arms, "off") == "off"  # bucket 2 is not on probation
  _feed(g, 1, None, 50.0, 4)
  _feed(g, 1, "3_1_4", 100.0, 2)
  _feed(g, 1, "4_1_5", 100.0, 1)
  assert g.status[1] == "pays" and g.probe_arm(1, arms, "off") == "off"


def test_state_survives_a_resume():
  g = SpecGate(GateConfig(min_chunks=1, margin=0.0))
  g.begin_rollout(0, [1, 2])
  _feed(g, 1, None, 100.0, 1)
  _feed(g, 1, "3_1_4", 150.0, 2)
  h = SpecGate(GateConfig(min_chunks=1, margin=0.0))
  h.load_state_dict(g.state_dict())
  assert h.status == g.status == {1: "pays", 2: "probing"}
  h.begin_rollout(5, [1, 2])
  assert h.opened(5) == {1, 2}  # the first to start a rollout after a resume probes


def test_config_validation():
  for kw in ({"min_chunks": 0}, {"margin": -0.1}, {"reprobe_every": -1},
             {"min_chunks": 8, "window": 4}):
    with pytest.raises(ValueError, match=next(iter(kw))):
      GateConfig(**kw)


# ------------------------------------------------------------------------ through the engine
CFG = ModelConfig(arch="qwen2", vocab_size=61, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True,
                  tie_word_embeddings=True)
SMALL = dict(max_batch=4, buckets=(1, 2, 4), chunk_size=4, max_prompt_len=16, max_new_tokens=24)


def _requests(n):
  rng = np.random.RandomState(0)
  return [Request(list(rng.randint(1, 61, rng.randint(2, 12))), i) for i in range(n)]


def test_workers_compile_and_speculate_only_where_the_gate_opens():
  """Two workers share a gate. While bucket 1 is probed only the prober compiles speculative
  executables (bucket 1's only); a bucket declined stops speculation on both; a bucket that
  pays is compiled by the other worker at its next rollout and speculated at. Greedy outputs
  stay plain decoding's throughout."""
  params = init_params(CFG, jax.random.key(0), std=0.3)
  dparams = init_drafter(CFG, jax.random.key(1))
  reqs, sp = _requests(9), SamplingParams(temperature=0.0)
  plain = {r.request_id: r.response_ids
           for r in RolloutWorker(params, CFG, EngineConfig(**SMALL)).generate(reqs, sp)}
  spec = SpecConfig(strategy="3_1_4", bs_threshold=4, patience=1, use_kernel=False,
                    background_compile=True)
  gate = SpecGate(GateConfig(min_chunks=1, margin=1e6, reprobe_every=0))  # never pays
  a, b = (RolloutWorker(params, CFG, EngineConfig(**SMALL, spec=spec), drafter_params=dparams,
                        worker_id=i, gate=gate) for i in (0, 1))

  def run(w):
    out = {r.request_id: r.response_ids for r in w.generate(reqs, sp)}
    w.wait_compiled(timeout=600)
    for k, v in plain.items():
      np.testing.assert_array_equal(out[k], v)

  def spec_buckets(w):
    return {r.batch for r in w.compile_log if r.name == "spec"}

  run(a)
  run(b)
  assert gate.prober == 0 and spec_buckets(a) == {1} and spec_buckets(b) == set()
  for _ in range(10):  # a's tail reaches bucket 1 and speculates there until decided
    if gate.status[1] != "probing":
      break
    run(a)
    run(b)
  assert gate.status == {1: "declined", 2: "declined", 4: "declined"}
  assert any(c.mode != "plain" and c.bucket == 1 for c in a.chunk_log)
  n_a, n_b = len(a.chunk_log), len(b.chunk_log)
  run(a)
  run(b)
  assert all(c.mode == "plain" for c in a.chunk_log[n_a:] + b.chunk_log[n_b:])
  assert spec_buckets(a) == {1} and spec_buckets(b) == set()

  gate.status[1] = "pays"  # as if measured: the other worker compiles bucket 1 now
  run(b)
  assert spec_buckets(b) == {1}
  n_b = len(b.chunk_log)
  run(b)
  assert any(c.mode == "3_1_4" and c.bucket == 1 for c in b.chunk_log[n_b:])
  assert all(c.mode == "plain" for c in b.chunk_log[n_b:] if c.bucket > 1)
