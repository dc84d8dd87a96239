"""The drafter's acceptance read off finished sequences (tlt_jax/drafter/acceptance.py) against
the engine's own speculative decoding: greedy, they must agree exactly."""

import numpy as np
import pytest

from tlt_jax.drafter.acceptance import measure, walk


def _surv(acc, depth=4):
  """Deterministic acceptance counts -> S_k(t) (1 while k <= acc[t])."""
  return (np.arange(1, depth + 1)[None, :] <= np.asarray(acc)[:, None]).astype(np.float64)


def test_walk_follows_the_engines_verifications():
  # prompt of 3 tokens, 7 response tokens x_3..x_9; accepted drafts per start t
  acc = np.zeros((9,), np.int32)
  acc[2] = 2  # from f_2: pending x_3, drafts x_4, x_5 accepted: 3 committed, x_6 pending
  acc[5] = 3  # pending x_6, x_7..x_9 accepted: the row ends inside the drafts
  assert walk(_surv(acc), 3, 10) == (7, 2)
  acc[5] = 2  # x_6..x_8 committed, the pending x_9 is the last token: no third verification
  assert walk(_surv(acc), 3, 10) == (6, 2)
  assert walk(_surv(np.zeros((9,))), 3, 10) == (6, 6)  # nothing accepted: x_9 is a bonus
  assert walk(_surv(np.zeros((3,))), 3, 4) == (1, 1)  # one response token: one verification


def test_walk_expects_over_random_acceptance():
  """S_k(t) in (0, 1): the walk's expectation, against enumerating every acceptance path."""
  rng = np.random.default_rng(0)
  a = rng.uniform(0.3, 0.95, (11, 3))
  surv = np.cumprod(a, axis=1)  # S_k = a_1 ... a_k
  surv[9:] = 0.0  # no draft past the sequence's end (length 12)

  def paths(t, prob, tokens, ver):
    if t + 1 >= 12 - 1 and ver:
      yield prob, tokens, ver
      return
    s = np.concatenate([[1.0], surv[t], [0.0]])
    for k in range(4):
      if s[k] - s[k + 1] > 0:
        yield from paths(t + k + 1, prob * (s[k] - s[k + 1]), tokens + k + 1, ver + 1)

  want = np.zeros(3)
  for prob, tokens, ver in paths(2, 1.0, 0, 0):
    want += prob * np.asarray([1.0, tokens, ver])
  assert want[0] == pytest.approx(1.0)
  assert walk(surv, 3, 12) == pytest.approx((want[1], want[2]), rel=1e-12)


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


def test_spot_training_with_context_keeps_a_good_drafter_good(default_target, monkeypatch):
  """The defect behind the drift benchmark (docs/drafter.md): trained on bare response windows, the
  shipped drafter got worse on its own policy's data (it drafts attending to the prompt and earlier
  response, which the windows lacked). 30 steps of the spot trainer's recipe on the policy's own
  rollouts: with the prompt as context it keeps (or improves) its acceptance; without, it loses a
  clear margin."""
  from tlt_jax.bench import drift
  from tlt_jax.config import asset_path
  from tlt_jax.data.prompts import load_prompt_rows
  from tlt_jax.models.tokenizer import load_tokenizer
  cfg, params, dparams, stop, _ = default_target
  tok = load_tokenizer(asset_path("default", "model"))
  train, _ = load_prompt_rows(asset_path("default", "data", "train.jsonl"))
  test, _ = load_prompt_rows(asset_path("default", "data", "test.jsonl"))
  greedy, _ = drift.generate(params, cfg, [tok.encode(r.prompt) for r in test[:32]], stop,
                             temperature=0.0, seed=0, max_new=288)
  seqs = [(r.prompt_ids, r.response_ids) for r in greedy]
  frozen = measure(params, dparams, seqs, cfg=cfg)["tokens_per_verify"]
  # Both fits train on the policy's rollouts of the same prompts at the same temperature and
  # seed: the same sequences (sampling is keyed by seed and row), generated once and handed
  # to both (the fits differ only in the context their buffer windows keep).
  rollouts, generate = {}, drift.generate

  def generate_once(params_, cfg_, prompts_, stop_, **kw):
    key = (id(params_), tuple(map(tuple, prompts_)), tuple(stop_), tuple(sorted(kw.items())))
    if key not in rollouts:
      rollouts[key] = generate(params_, cfg_, prompts_, stop_, **kw)
    return rollouts[key]

  monkeypatch.setattr(drift, "generate", generate_once)
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
  assert len(rollouts) == 1
  print(f"greedy chain-4 tokens per verification: shipped {frozen:.3f}, after 30 spot steps "
        f"with context {got[128]:.3f}, without {got[0]:.3f}")
  assert got[128] >= frozen - 0.05
  assert got[128] > got[0] + 0.15


def test_sampled_acceptance_is_the_engines_in_expectation(default_target):
  """T=1: the engine decodes with chain 4_1_5 (drafts sampled from q, accepted with
  min(1, p/q)); given the sequences it emitted, the number of verifications it ran is random
  only through its acceptance draws, which `survival` gives exactly (module docstring). The
  engine's count must sit inside the distribution the walk implies (simulated from the same
  S_k); the shipped drafter's S_k read by a fresh drafter must not."""
  import jax
  from tlt_jax.drafter import init_drafter
  from tlt_jax.rollout.config import EngineConfig, SpecConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.records import Request
  from tlt_jax.rollout.sampling import SamplingParams
  cfg, params, dparams, stop, prompts = default_target
  prompts = [p for p in prompts for _ in range(4)]
  spec = SpecConfig(strategy="4_1_5", bs_threshold=16, patience=1, use_kernel=False)
  ecfg = EngineConfig(max_batch=16, buckets=(1, 2, 4, 8, 16), chunk_size=8,
                      max_prompt_len=16 * -(-max(map(len, prompts)) // 16), max_new_tokens=48,
                      stop_tokens=stop, spec=spec)
  sp = SamplingParams(temperature=1.0)
  engine = Engine(params, cfg, ecfg, drafter_params=dparams)
  out = engine.generate([Request(p, request_id=i) for i, p in enumerate(prompts)], sp, seed=7)
  chunks = [c for c in engine.chunk_log if c.mode != "plain"]
  assert len(chunks) == len(engine.chunk_log)
  engine_ver = sum(c.verifications for c in chunks)
  seqs = [(r.prompt_ids, r.response_ids) for r in sorted(out, key=lambda r: r.request_id)]

  def simulated(dp, sims=4000):
    """The total verifications' distribution over acceptance draws, given the sequences."""
    import jax.numpy as jnp
    from tlt_jax.drafter.acceptance import survival
    m = measure(params, dp, seqs, cfg=cfg, depth=4, sampling=sp)
    t_len = 64 * -(-max(len(p) + len(r) for p, r in seqs) // 64)
    tok = np.zeros((len(seqs), t_len), np.int32)
    starts = np.zeros((len(seqs), t_len - 1), bool)
    for i, (p, r) in enumerate(seqs):
      tok[i, :len(p) + len(r)] = np.concatenate([p, r])
      starts[i, len(p) - 1:len(p) + len(r) - 1] = True
    lens = np.asarray([len(p) + len(r) for p, r in seqs], np.int32)
    surv = np.asarray(survival(params, dp, jnp.asarray(tok), jnp.asarray(lens),
                               jnp.asarray(starts), cfg=cfg, depth=4, sampling=sp))
    rng = np.random.default_rng(1)
    total = np.zeros((sims,))
    for i, (p, r) in enumerate(seqs):
      end, t = len(p) + len(r), np.full((sims,), len(p) - 1)
      live = np.ones((sims,), bool)
      while live.any():
        a = (rng.uniform(size=(sims, 1)) < surv[i][t]).sum(-1)
        total += live
        t = np.where(live, t + a + 1, t)
        live &= t <= end - 3
    return m, total

  m, total = simulated(dparams)
  # compiled ahead of time (the training metric's background compile): the same figures
  from tlt_jax.drafter.acceptance import compile_survival
  t_len = 64 * -(-max(len(p) + len(r) for p, r in seqs) // 64)
  exe = compile_survival(params, dparams, len(seqs), t_len, cfg=cfg, depth=4, sampling=sp)
  ahead = measure(params, dparams, seqs, cfg=cfg, depth=4, sampling=sp, length=t_len,
                  executable=exe)
  assert ahead["per_sequence"] == m["per_sequence"]
  assert sum(v for _, v in m["per_sequence"]) == pytest.approx(total.mean(), rel=0.01)
  lo, hi = np.quantile(total, [0.0005, 0.9995])
  print(f"T=1 chain-4 on {len(seqs)} samples: engine {engine_ver} verifications, the walk's "
        f"expectation {total.mean():.1f} (99.9% of draws in [{lo:.0f}, {hi:.0f}]); tokens per "
        f"verification {m['tokens_per_verify']:.3f} +- {m['stderr']:.3f}")
  assert lo <= engine_ver <= hi
  _, fresh = simulated(init_drafter(cfg, jax.random.key(3)), sims=500)
  assert engine_ver < fresh.min()


def test_measure_reports_the_ratio_estimator_and_its_textbook_standard_error(monkeypatch):
  """tokens_per_verify is all tokens over all verifications, its standard error the ratio
  estimator's over n sequences: sqrt(sum (t_i - R v_i)^2 / (n - 1) / n) / mean(v), from the
  per-sequence walks (here of random survival curves, no model)."""
  from tlt_jax.drafter import acceptance
  rng = np.random.default_rng(1)
  seqs = [(np.arange(1, 4), np.arange(1, int(n) + 1)) for n in rng.integers(5, 40, 6)]

  def fake_survival(target_params, dparams, tokens, lengths, starts, *, cfg, depth, sampling):
    a = rng.uniform(0.2, 0.9, tuple(starts.shape) + (depth,))
    return np.cumprod(a, -1) * np.asarray(starts)[..., None]

  monkeypatch.setattr(acceptance, "survival", fake_survival)
  out = acceptance.measure(None, None, seqs, cfg=None, depth=3)
  t, v = np.asarray(out["per_sequence"], np.float64).T
  n, ratio = len(t), t.sum() / v.sum()
  assert n == 6 and out["tokens_per_verify"] == pytest.approx(ratio, rel=1e-12)
  want = np.sqrt(((t - ratio * v) ** 2).sum() / (n - 1) / n) / v.mean()
  assert out["stderr"] == pytest.approx(want, rel=1e-12)


def test_paired_difference_has_the_spread_of_repeated_experiments():
  """`difference`'s standard error against the spread of the difference over many repeated
  data sets of a known model: sequences of shared difficulty (which cancels in the pair) and
  each drafter's own noise."""
  from tlt_jax.drafter.acceptance import difference
  rng = np.random.default_rng(0)
  diffs, ses = [], []
  for _ in range(2000):
    v = rng.integers(3, 30, 100).astype(float)  # verifications per sequence
    hard = rng.normal(0, 0.4, 100) * v  # shared: some sequences are easy for every drafter
    ta = 3.9 * v + hard + rng.normal(0, 0.3, 100) * np.sqrt(v)
    tb = 3.7 * v + hard + rng.normal(0, 0.3, 100) * np.sqrt(v)
    d, se = difference({"per_sequence": list(zip(ta, v))}, {"per_sequence": list(zip(tb, v))})
    diffs.append(d)
    ses.append(se)
  assert np.mean(diffs) == pytest.approx(0.2, abs=0.002)
  assert np.mean(ses) == pytest.approx(np.std(diffs), rel=0.1)
  with pytest.raises(ValueError, match="same sequences"):
    difference({"per_sequence": [(4.0, 1.0)] * 3}, {"per_sequence": [(4.0, 1.0)] * 2})


def test_drift_verdicts_count_only_a_decay_above_noise():
  from tlt_jax.bench.drift import verdicts
  def row(step, frozen, spot, ceiling, se):
    r = {"step": step}
    for kind in ("greedy", "sampled"):
      r.update({f"frozen_{kind}": frozen, f"frozen_{kind}_se": se, f"spot_{kind}": spot,
                f"ceiling_{kind}": ceiling, f"spot_minus_frozen_{kind}": spot - frozen})
    return r
  rows = [row(0, 3.9, 3.9, 3.9, 0.03), row(10, 3.6, 3.75, 3.8, 0.03),
          row(20, 3.85, 3.95, 3.9, 0.03)]
  v = verdicts(rows)
  assert v[0]["recovered_greedy"] == pytest.approx(0.15 / 0.3)
  assert v[0]["spot_over_ceiling_sampled"] == pytest.approx(3.75 / 3.8)
  assert v[0]["decay_sampled_se"] == pytest.approx(0.03 * np.sqrt(2))
  assert v[1]["recovered_greedy"] is None  # 0.05 < 2 x 0.042: no decay to recover
