"""The drafter's acceptance read off finished sequences (tlt_jax/drafter/acceptance.py) against
the engine's own speculative decoding: greedy, they must agree exactly."""

import numpy as np
import pytest

from tlt_jax.drafter.acceptance import measure, walk


def test_walk_follows_the_engines_verifications():
  # prompt of 3 tokens, 7 response tokens x_3..x_9; accepted drafts per start t
  acc = np.zeros((9,), np.int32)
  acc[2] = 2  # from f_2: pending x_3, drafts x_4, x_5 accepted: 3 committed, x_6 pending
  acc[5] = 3  # pending x_6, x_7..x_9 accepted: the row ends inside the drafts
  assert walk(acc, 3, 10) == (7, 2)
  acc[5] = 2  # x_6..x_8 committed, the pending x_9 is the last token: no third verification
  assert walk(acc, 3, 10) == (6, 2)
  assert walk(np.zeros((9,), np.int32), 3, 10) == (6, 6)  # nothing accepted: x_9 is a bonus
  assert walk(np.zeros((3,), np.int32), 3, 4) == (1, 1)  # one response token: one verification


@pytest.fixture(scope="module")
def default_target():
  from tlt_jax.bench.bench_model import load_target
  cfg, params, dparams, _, stop, prompts = load_target()
  return cfg, params, dparams, stop, prompts[:12]


def _engine_greedy(cfg, params, dparams, stop, prompts, max_new):
  """Greedy chain 4_1_5 from the first token -> ([(prompt, response)], the engine's accepted
  drafts and verifications)."""
  from tlt_jax.rollout.config import EngineConfig, SpecConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import Request
  from tlt_jax.rollout.sampling import SamplingParams
  spec = SpecConfig(strategy="4_1_5", bs_threshold=4, patience=1, use_kernel=False)
  ecfg = EngineConfig(max_batch=4, buckets=(1, 2, 4), chunk_size=8,
                      max_prompt_len=16 * -(-max(map(len, prompts)) // 16),
                      max_new_tokens=max_new, stop_tokens=stop, spec=spec)
  engine = Engine(params, cfg, ecfg, drafter_params=dparams)
  out = engine.generate([Request(p, request_id=i) for i, p in enumerate(prompts)],
                        SamplingParams(temperature=0.0))
  chunks = [c for c in engine.chunk_log if c.mode != "plain"]
  assert len(chunks) == len(engine.chunk_log)  # speculation from the first chunk
  seqs = [(r.prompt_ids, r.response_ids) for r in sorted(out, key=lambda r: r.request_id)]
  return seqs, sum(c.accepted for c in chunks), sum(c.verifications for c in chunks)


def test_greedy_acceptance_equals_the_engines(default_target):
  """Prompts decoded greedily with chain 4_1_5 by the engine, then walked with the drafter's
  teacher-forced chains: the same verifications, the same accepted drafts. The engine counts
  the drafts its last verification accepted past a row's end (the verifier's acceptance,
  whatever a stop token cuts), so the sequences are decoded again past their end (no stop
  token, greedy: the same tokens, then what follows) for the walk to see them; over the
  sequences themselves the walk counts what was emitted. A fresh drafter reads ~1."""
  import jax
  from tlt_jax.drafter import init_drafter
  cfg, params, dparams, stop, prompts = default_target
  seqs, accepted, verifications = _engine_greedy(cfg, params, dparams, stop, prompts, 48)
  longer, _, _ = _engine_greedy(cfg, params, dparams, (), prompts, 48 + 5)
  for (p, r), (_, r2) in zip(seqs, longer):
    np.testing.assert_array_equal(r2[:len(r)], r)  # greedy: the same tokens, then more
  engine_tpv = (accepted + verifications) / verifications
  ends = [len(p) + len(r) for p, r in seqs]
  past = measure(params, dparams, longer, cfg=cfg, depth=4, ends=ends)
  assert sum(v for _, v in past["per_sequence"]) == verifications
  assert sum(t for t, _ in past["per_sequence"]) == accepted + verifications
  assert past["tokens_per_verify"] == pytest.approx(engine_tpv, abs=1e-12)
  got = measure(params, dparams, seqs, cfg=cfg, depth=4)
  assert [v for _, v in got["per_sequence"]] == [v for _, v in past["per_sequence"]]
  for (t, _), (_, r) in zip(got["per_sequence"], seqs):  # every token but a last pending one
    assert t in (len(r) - 1, len(r))
  print(f"greedy chain-4 tokens per verification on {len(seqs)} prompts: engine "
        f"{engine_tpv:.4f} (drafts past a row's end counted), emitted "
        f"{got['tokens_per_verify']:.4f} +- {got['stderr']:.3f}")
  assert 2.0 < got["tokens_per_verify"] <= engine_tpv  # the shipped drafter drafts well here
  fresh = init_drafter(cfg, jax.random.key(3))
  worse = measure(params, fresh, seqs, cfg=cfg, depth=4)
  assert worse["tokens_per_verify"] < 1.2 and worse["sequences"] == len(seqs)


def test_spot_training_with_context_keeps_a_good_drafter_good(default_target):
  """The defect behind DESIGN.md 5a: trained on bare response windows, the shipped drafter got
  worse on its own policy's data (it drafts attending to the prompt and earlier response,
  which the windows lacked). 30 steps of the spot trainer's recipe on the policy's own
  rollouts: with the prompt as context it keeps (or improves) its acceptance; without, it
  loses a clear margin."""
  from tlt_jax.bench import drift
  from tlt_jax.config import asset_path
  from tlt_jax.data.prompts import load_prompt_rows
  from tlt_jax.models.hf_io import load_tokenizer
  cfg, params, dparams, stop, _ = default_target
  tok = load_tokenizer(asset_path("default", "model"))
  train, _ = load_prompt_rows(asset_path("default", "data", "train.jsonl"))
  test, _ = load_prompt_rows(asset_path("default", "data", "test.jsonl"))
  greedy, _ = drift.generate(params, cfg, [tok.encode(r.prompt) for r in test[:32]], stop,
                             temperature=0.0, seed=0, max_new=288)
  seqs = [(r.prompt_ids, r.response_ids) for r in greedy]
  frozen = measure(params, dparams, seqs, cfg=cfg)["tokens_per_verify"]
  got = {}
  for context in (128, 0):
    run_cfg = {"rollout": {"temperature": 1.0}, "tlt": {"drafter": {
        "rows": 8, "row_len": 256, "window": 128, "context": context, "windows_per_response": 4,
        "lr": 3e-5, "warmup_steps": 0, "unroll": 1}}}
    fitted, steps = drift.fit_ceiling(params, dparams, cfg,
                                      [tok.encode(r.prompt) for r in train[-64:]], stop,
                                      tokens=30 * 8 * 256, run_cfg=run_cfg, seed=0, max_new=288)
    assert steps == 30
    got[context] = measure(params, fitted, seqs, cfg=cfg)["tokens_per_verify"]
  print(f"greedy chain-4 tokens per verification: shipped {frozen:.3f}, after 30 spot steps "
        f"with context {got[128]:.3f}, without {got[0]:.3f}")
  assert got[128] >= frozen - 0.05
  assert got[128] > got[0] + 0.15
