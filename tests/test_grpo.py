"""GRPO math against a float64 numpy reference, and learning on a toy reward."""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tlt_jax.models import ModelConfig, forward, init_params
from tlt_jax.optim import make_optimizer
from tlt_jax.rl import advantages, batching, grpo
from tlt_jax.rl import learner as rl_learner
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.records import Request
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.sharding import make_mesh

CFG = ModelConfig(arch="qwen2", vocab_size=23, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True,
                  tie_word_embeddings=False)


def test_group_advantages_match_numpy_float64():
  rng = np.random.RandomState(0)
  r = rng.rand(5, 4)
  r[2] = 1.0  # a group with no signal
  want = np.zeros_like(r)
  for i in range(5):
    m = sum(r[i]) / 4
    sd = (sum((x - m) ** 2 for x in r[i]) / 3) ** 0.5  # Bessel, as torch.std
    want[i] = [(x - m) / (sd + 1e-6) for x in r[i]]
  np.testing.assert_allclose(advantages.group_advantages(r), want, rtol=1e-5, atol=1e-6)
  assert np.all(advantages.group_advantages(r)[2] == 0)
  np.testing.assert_allclose(advantages.group_advantages(r, norm_by_std=False),
                             r - r.mean(1, keepdims=True), rtol=1e-6, atol=1e-7)


_FWD = jax.jit(functools.partial(forward, cfg=CFG))


def _np_logprobs(params, seq, temperature):
  """float64 log-softmax of our forward's logits (forward itself is checked against HF in
  test_models): logp[t] = log p(seq[t] | seq[:t])."""
  t = len(seq)
  padded = np.zeros((1, 64), np.int32)  # one compiled shape; causal, so the padding is unseen
  padded[0, :t] = seq
  out = _FWD(params, jnp.asarray(padded), jnp.arange(64)[None])
  logits = np.asarray(out.logits[0, :t], np.float64) / temperature
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  lp = logits - logz[:, None]
  ent = -(np.exp(lp) * lp).sum(-1)
  res = np.zeros(t)
  res[1:] = lp[np.arange(t - 1), seq[1:]]
  e = np.zeros(t)
  e[1:] = ent[:-1]
  return res, e


def _np_grpo_loss(new, old, ref, samples, gcfg):
  """The loss aggregated as gcfg.loss_agg says over every response token of the batch (one
  mini-batch), float64, no padding anywhere, and the token means of the metrics: (loss,
  entropy, KL to ref, clipped policy-gradient term (importance-weighted where gcfg.rollout_is
  says), share of tokens clipped, share bounded by the dual clip, and from the samples'
  rollout log-probs: log pi_rollout - log pi_old, r - 1 - log r of r = pi_old / pi_rollout,
  |pi_old - pi_rollout|, the importance weight, the share of weights capped)."""
  n_tok, loss, sums = 0, 0.0, np.zeros(10)
  for s in samples:
    seq = list(s.prompt_ids) + list(s.response_ids)
    lp, ent = _np_logprobs(new, seq, gcfg.temperature)
    lo, _ = _np_logprobs(old, seq, gcfg.temperature)
    lr, _ = _np_logprobs(ref, seq, gcfg.temperature)
    lro = np.zeros(len(seq))
    lro[len(s.prompt_ids):] = s.rollout_logp
    log_r = lo - lro  # [t]: log pi_old / pi_rollout of each token
    seq_log_r = log_r[len(s.prompt_ids):].sum()
    gspo = np.exp(min(np.mean(lp[len(s.prompt_ids):] - lo[len(s.prompt_ids):]), 10.0))
    terms = []
    for t in range(len(s.prompt_ids), len(seq)):
      ratio = gspo if gcfg.loss_mode == "gspo" else np.exp(lp[t] - lo[t])
      a = s.advantage
      clipped = -a * min(max(ratio, 1 - gcfg.eps_low), 1 + gcfg.eps_high)
      pg = max(-a * ratio, clipped)
      lower = gcfg.clip_ratio_c > 0 and a < 0 and pg > -a * gcfg.clip_ratio_c
      if lower:  # dual-clip PPO (VeRL's clip_ratio_c)
        pg = -a * gcfg.clip_ratio_c
      w = {"": 1.0, "token": np.exp(log_r[t]), "sequence": np.exp(seq_log_r),
           "geometric": np.exp(seq_log_r / len(s.response_ids))}[gcfg.rollout_is]
      capped = w > gcfg.rollout_is_cap
      pg *= min(w, gcfg.rollout_is_cap)  # truncated importance sampling
      d = lr[t] - lp[t]
      kl = {"low_var_kl": np.exp(d) - d - 1, "kl": -d, "mse": d * d / 2,
            "abs": abs(d)}[gcfg.kl_loss_type]
      terms.append(pg + gcfg.kl_coef * kl - gcfg.entropy_coef * ent[t])
      sums += (ent[t], kl, pg, clipped > -a * ratio, lower, -log_r[t],
               np.exp(log_r[t]) - 1 - log_r[t], abs(np.exp(lo[t]) - np.exp(lro[t])),
               min(w, gcfg.rollout_is_cap), capped)
    n_tok += len(terms)
    if gcfg.loss_agg == "token-mean":  # summed here, divided by every token below
      loss += sum(terms)
    elif gcfg.loss_agg == "seq-mean-token-mean":
      loss += np.mean(terms) / len(samples)
    elif gcfg.loss_agg == "seq-mean-token-sum":
      loss += sum(terms) / len(samples)
    else:
      loss += sum(terms) / gcfg.loss_norm_len / len(samples)
  if gcfg.loss_agg == "token-mean":
    loss /= n_tok
  return (loss, *(sums / n_tok))


def test_overlong_penalty_is_dapos_soft_punishment():
  """0 up to max_len - buffer tokens, then linear to -penalty at max_len (DAPO, eq. 13)."""
  got = advantages.overlong_penalty(np.array([[0, 6], [7, 8], [9, 10]]), max_len=10, buffer=4,
                              penalty=0.5)
  np.testing.assert_allclose(got, [[0, 0], [-0.125, -0.25], [-0.375, -0.5]], rtol=1e-6)
  assert not advantages.overlong_penalty(np.array([10, 3]), max_len=10, buffer=0).any()


@pytest.fixture(scope="module")
def setup():
  old = init_params(CFG, jax.random.key(0), std=0.3)
  # new = old moved as an update moves it: ratios 0.67-1.54 (5th-95th percentile), about 40%
  # of them outside [1 - eps, 1 + eps] (both branches of the clip); ref = old moved less
  # (KL to it ~0.05 a token): the policy-gradient and KL terms are of the sizes they have in
  # a run, so neither hides an error in the other
  move = lambda scale, seed: jax.tree.map(  # noqa: E731
      lambda a, b: a + scale * b, old, init_params(CFG, jax.random.key(seed), std=0.3))
  new, ref = move(0.02, 1), move(0.01, 2)
  rng = np.random.RandomState(0)
  samples = [batching.Sample(rng.randint(1, 23, rng.randint(2, 9)),
                         rng.randint(1, 23, rng.choice([1, 3, 17, 40])), float(rng.randn()))
             for _ in range(11)]
  return old, new, ref, samples


@pytest.mark.parametrize(
    "kl_coef,temperature,loss_agg,entropy_coef,kl_loss_type,clip_c,rollout_is,loss_mode", [
        (0.0, 1.0, "token-mean", 0.0, "low_var_kl", 0.0, "", "vanilla"),
        (0.05, 0.7, "seq-mean-token-mean", 0.0, "low_var_kl", 0.0, "", "vanilla"),
        (0.0, 1.0, "seq-mean-token-sum", 0.03, "low_var_kl", 0.0, "", "vanilla"),
        (0.05, 0.7, "seq-mean-token-sum-norm", 0.01, "low_var_kl", 0.0, "", "vanilla"),
        (0.05, 1.0, "token-mean", 0.0, "kl", 0.0, "", "vanilla"),
        (0.05, 1.0, "token-mean", 0.0, "mse", 0.0, "", "vanilla"),
        (0.05, 1.0, "token-mean", 0.0, "abs", 1.2, "", "vanilla"),
        (0.0, 0.7, "token-mean", 0.0, "low_var_kl", 0.0, "token", "vanilla"),
        (0.0, 1.0, "seq-mean-token-mean", 0.0, "low_var_kl", 1.2, "sequence", "vanilla"),
        (0.05, 1.0, "token-mean", 0.0, "low_var_kl", 0.0, "geometric", "vanilla"),
        (0.0, 1.0, "seq-mean-token-mean", 0.0, "low_var_kl", 1.02, "", "gspo"),
        (0.05, 0.7, "token-mean", 0.01, "low_var_kl", 0.0, "token", "gspo")])
def test_microbatched_loss_matches_float64_reference(setup, kl_coef, temperature, loss_agg,
                                                     entropy_coef, kl_loss_type, clip_c,
                                                     rollout_is, loss_mode):
  """The loss as each aggregation defines it over the whole batch (its responses of 1-40
  tokens, so the aggregations differ), with the KL term (each estimator), the entropy bonus,
  the dual clip (at 1.2, inside this setup's ratios: it binds) and the rollout's truncated
  importance weights per token, per response and per response's geometric mean (the
  rollout's log-probs the old policy's off by a noise of 0.25 nats a token: weights on both
  sides of the cap, 1.5, or 1.03 for the geometric mean), the metrics token means whatever it
  is, the distance to the rollout's distribution among them; PPO's token ratio and GSPO's
  per response (clipped at 0.03 / 0.04 as its paper does, where this setup's response ratios
  fall on both sides)."""
  old, new, ref, samples = setup
  eps = (0.03, 0.04) if loss_mode == "gspo" else (0.2, 0.28)
  gcfg = grpo.GRPOConfig(eps_low=eps[0], eps_high=eps[1], kl_coef=kl_coef, temperature=temperature,
                         loss_mode=loss_mode,
                         logit_chunk=8,  # chunked LM head with a ragged last chunk
                         loss_agg=loss_agg, loss_norm_len=48, entropy_coef=entropy_coef,
                         kl_loss_type=kl_loss_type, clip_ratio_c=clip_c,
                         rollout_is=rollout_is,
                         rollout_is_cap=1.03 if rollout_is == "geometric" else 1.5)
  rng = np.random.RandomState(1)  # short samples too: they outlast the long rows' gaps
  samples = samples + [batching.Sample(rng.randint(1, 23, 3), rng.randint(1, 23, rng.randint(1, 9)),
                                   float(rng.randn())) for _ in range(12)]
  samples = [dataclasses.replace(s, rollout_logp=(_np_logprobs(
      old, list(s.prompt_ids) + list(s.response_ids), temperature)[0][len(s.prompt_ids):]
      + rng.normal(0, 0.25, len(s.response_ids))).astype(np.float32)) for s in samples]
  want, want_ent, want_kl, want_pg, want_clip, want_lower, *want_rollout = _np_grpo_loss(
      new, old, ref, samples, gcfg)
  mbs = list(batching.micro_batches(samples, rows=2, pad_multiple=16, max_len=64,
                                    loss_agg=loss_agg, norm_len=48))
  assert len({mb.tokens.shape[1] for mb in mbs}) > 1  # micro-batches of several lengths
  assert max(mb.segment_ids.max() for mb in mbs) >= 3  # rows packed with several samples
  n = sum(mb.loss_mask.sum() for mb in mbs)
  rollout_keys = ["rollout_kl", "rollout_k3", "rollout_prob_diff", "rollout_is_weight",
                  "rollout_is_clip_frac"]
  got = dict.fromkeys(["loss", "entropy", "kl_ref", "pg_loss", "clip_frac", "clip_frac_lower"]
                      + rollout_keys, 0.0)
  lp_fn = jax.jit(functools.partial(grpo.token_logprobs, cfg=CFG, temperature=temperature,
                                    chunk=8))
  for mb in mbs:
    packed = (jnp.asarray(mb.tokens), jnp.asarray(mb.positions), jnp.asarray(mb.segment_ids))
    dev = grpo.Batch(*packed, jnp.asarray(mb.loss_mask), jnp.asarray(mb.loss_weight),
                     jnp.asarray(mb.advantages),
                     lp_fn(old, *packed)[0], lp_fn(ref, *packed)[0],
                     rollout_logp=jnp.asarray(mb.rollout_logp))
    loss, m = grpo.grpo_loss(new, dev, cfg=CFG, gcfg=gcfg, num_tokens=jnp.float32(n))
    for k in got:
      got[k] += float(loss if k == "loss" else m.get(k, 0.0))
  np.testing.assert_allclose(got["loss"], want, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(got["pg_loss"], want_pg, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(got["entropy"], want_ent, rtol=2e-5)
  if kl_coef:
    np.testing.assert_allclose(got["kl_ref"], want_kl, rtol=2e-5)
  # the clipped tokens, counted (a float32 ratio on a clip boundary may count either way)
  np.testing.assert_allclose(got["clip_frac"], want_clip, atol=1.5 / n)
  assert 0.1 < want_clip < 0.9  # both branches of the clip were exercised
  np.testing.assert_allclose(got["clip_frac_lower"], want_lower, atol=1.5 / n)
  assert (0.02 < want_lower < 0.5) == (clip_c > 0)  # the dual clip bound where it is on
  for k, w in zip(rollout_keys[:3], want_rollout):  # measured whether corrected or not
    np.testing.assert_allclose(got[k], w, rtol=1e-4, atol=1e-6, err_msg=k)
  if rollout_is:
    np.testing.assert_allclose(got["rollout_is_weight"], want_rollout[3], rtol=1e-4)
    np.testing.assert_allclose(got["rollout_is_clip_frac"], want_rollout[4], atol=1.5 / n)
    assert 0.05 < want_rollout[4] < 0.95  # weights on both sides of the cap
  else:
    assert got["rollout_is_weight"] == got["rollout_is_clip_frac"] == 0.0  # (not reported)


@pytest.mark.parametrize("kind", ["low_var_kl", "kl", "mse", "abs"])
def test_kl_estimators_against_the_exact_kl_of_a_categorical(kind):
  """Each estimator's expectation over tokens sampled from pi, and the expectation of its
  gradient (the term as a loss on those samples), summed exactly over an 11-token vocabulary
  in float64 against the KLs computed from the two distributions: k1 and k3 are unbiased
  values of KL(pi || pi_ref); the gradient of k2 is KL(pi || pi_ref)'s, of k3 the reverse
  KL(pi_ref || pi)'s, of k1 zero (rl/kl.py's docstring)."""
  from tlt_jax.rl.kl import kl_penalty
  jax.config.update("jax_enable_x64", True)
  try:
    rng = np.random.default_rng(3)
    theta, ref = rng.normal(size=11), jax.nn.log_softmax(rng.normal(size=11))
    pi = np.exp(jax.nn.log_softmax(theta))

    def expected(th, estimator=lambda lp: kl_penalty(lp, ref, kind)):  # E_{x ~ pi (fixed)}
      return jnp.sum(jax.lax.stop_gradient(jnp.exp(jax.nn.log_softmax(th)))
                     * estimator(jax.nn.log_softmax(th)))

    forward = lambda th: jnp.sum(jnp.exp(jax.nn.log_softmax(th)) * (  # noqa: E731
        jax.nn.log_softmax(th) - ref))
    reverse = lambda th: jnp.sum(jnp.exp(ref) * (ref - jax.nn.log_softmax(th)))  # noqa: E731
    kl = float(np.sum(pi * (np.log(pi) - np.asarray(ref))))
    value, grad = float(expected(theta)), np.asarray(jax.grad(expected)(jnp.asarray(theta)))
    assert value >= 0 or kind == "kl"
    if kind in ("low_var_kl", "kl"):
      np.testing.assert_allclose(value, kl, rtol=1e-12)
    want = {"low_var_kl": jax.grad(reverse)(jnp.asarray(theta)),
            "mse": jax.grad(forward)(jnp.asarray(theta)), "kl": np.zeros(11)}.get(kind)
    if want is not None:
      np.testing.assert_allclose(grad, want, atol=1e-12)
    else:  # abs: -sign(d) x the score
      d = np.asarray(ref) - np.log(pi)
      score = np.eye(11) - pi[None, :]  # d log pi(x) / d theta, row x
      np.testing.assert_allclose(grad, (pi * -np.sign(d)) @ score, atol=1e-12)
  finally:
    jax.config.update("jax_enable_x64", False)


def _summed_alone(grad_of, samples):
  """sum over samples of grad_of(seq [1, T], response mask [T], sample): each sample alone in
  a row, padded at its end to one length (one compile; causal: what follows a token changes
  nothing before it)."""
  T = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
  total = None
  for s in samples:
    seq = np.concatenate([s.prompt_ids, s.response_ids])
    pos = np.arange(T)
    g = grad_of(jnp.asarray(np.pad(seq, (0, T - len(seq))))[None],
                jnp.asarray((pos >= len(s.prompt_ids)) & (pos < len(seq))), s)
    total = g if total is None else jax.tree.map(jnp.add, total, g)
  return total


def test_ratio_is_one_on_policy_and_gradient_is_policy_gradient(setup):
  """With old == new the loss is -mean(A) and its gradient is -mean(A * grad log p): the
  REINFORCE estimator with group baselines (checked against jax.grad of that expression,
  summed over the samples each run alone, unpacked)."""
  old, _, _, samples = setup
  gcfg = grpo.GRPOConfig()
  mbs = list(batching.micro_batches(samples, rows=2, pad_multiple=64, max_len=64))
  n = jnp.float32(sum(float(mb.loss_mask.sum()) for mb in mbs))
  # (jitted: eager grads compile every op once per shape, a minute of this test)
  loss_grad = jax.jit(jax.grad(
      lambda p, dev: grpo.grpo_loss(p, dev, cfg=CFG, gcfg=gcfg, num_tokens=n)[0]))
  loss_of = jax.jit(lambda p, dev: grpo.grpo_loss(p, dev, cfg=CFG, gcfg=gcfg, num_tokens=n))
  g_loss, total = None, 0.0
  for mb in mbs:
    packed = (jnp.asarray(mb.tokens), jnp.asarray(mb.positions), jnp.asarray(mb.segment_ids))
    dev = grpo.Batch(*packed, jnp.asarray(mb.loss_mask), jnp.asarray(mb.loss_weight),
                     jnp.asarray(mb.advantages),
                     grpo.token_logprobs(old, *packed, cfg=CFG, temperature=1.0)[0])
    g = loss_grad(old, dev)
    g_loss = g if g_loss is None else jax.tree.map(jnp.add, g_loss, g)
    loss, m = loss_of(old, dev)
    total += float(loss)
    assert float(m["clip_frac"]) == 0.0 and abs(float(m["approx_kl_old"])) < 1e-6  # ratio 1
  # the loss: -(sum over samples of A x its response tokens) / all response tokens
  want = -sum(s.advantage * len(s.response_ids) for s in samples) / float(n)
  assert abs(want) > 1e-3  # (the advantages sum to 0 per group; the lengths differ)
  np.testing.assert_allclose(total, want, rtol=1e-5, atol=1e-7)

  @jax.jit
  @jax.grad
  def reinforce(p, seq, response, advantage):  # one sample, alone: -A * sum of its log p
    lp = grpo.token_logprobs(p, seq, cfg=CFG, temperature=1.0)[0][0]
    return -advantage * jnp.sum(jnp.where(response, lp, 0.0)) / n

  g_ref = _summed_alone(lambda seq, resp, s: reinforce(old, seq, resp, s.advantage), samples)
  for a, b in zip(jax.tree.leaves(g_loss), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_update_steps_by_the_gradient_of_each_minibatchs_token_mean():
  """`update` over two mini-batches of several micro-batches each (packed rows of several
  lengths), with plain SGD so that a step is the gradient: each step is the gradient of that
  mini-batch's token-mean clipped objective, the samples each run alone (unpacked) as the
  reference, the second under the params the first step left and the old log-probs of the
  params before both (`prepare`); the metrics are the mean over the two mini-batches."""
  lr, gcfg = 0.1, grpo.GRPOConfig()
  mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  spec = rl_learner.LearnerSpec(CFG, gcfg, optax.sgd(lr), mesh, micro_batch=0, pad_multiple=8,
                          micro_batch_tokens=48)
  p0 = init_params(CFG, jax.random.key(5), std=0.3)
  rng = np.random.RandomState(2)
  samples = [batching.Sample(rng.randint(1, 23, rng.randint(2, 6)),
                             rng.randint(1, 23, rng.choice([1, 4, 9, 20])), float(rng.randn()))
             for _ in range(12)]
  batches = batching.minibatches(samples, spec, num_minibatches=2, seed=0)
  assert all(len(group) >= 2 for group in batches)  # several micro-batches per step...
  assert len({mb.tokens.shape for group in batches for mb in group}) >= 2  # ...of two lengths
  state = rl_learner.init_learner(jax.tree.map(jnp.copy, p0), spec)
  state, m = rl_learner.update(state, rl_learner.prepare(state, batches, spec), spec)

  T = 32
  def padded(s):
    seq = np.concatenate([s.prompt_ids, s.response_ids])
    pos = np.arange(T)
    return (jnp.asarray(np.pad(seq, (0, T - len(seq))))[None],
            jnp.asarray((pos >= len(s.prompt_ids)) & (pos < len(seq))))

  @jax.jit
  def lp_of(p, seq):
    return grpo.token_logprobs(p, seq, cfg=CFG, temperature=1.0)[0][0]

  @jax.jit
  def clipped_sum(p, seq, response, lp_old, adv):  # one sample: its tokens' clipped terms
    ratio = jnp.exp(lp_of(p, seq) - lp_old)
    pg = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - gcfg.eps_low, 1 + gcfg.eps_high))
    return jnp.sum(jnp.where(response, pg, 0.0))

  grad_sum = jax.jit(jax.value_and_grad(clipped_sum))
  params, losses = p0, []
  old = {i: lp_of(p0, padded(s)[0]) for i, s in enumerate(samples)}  # before any step
  for part in batching.minibatch_parts(len(samples), 2, 0):
    n = sum(len(samples[i].response_ids) for i in part)
    loss, grad = 0.0, jax.tree.map(jnp.zeros_like, params)
    for i in part:
      v, g = grad_sum(params, *padded(samples[i]), old[int(i)], samples[i].advantage)
      loss, grad = loss + float(v) / n, jax.tree.map(lambda a, b: a + b / n, grad, g)
    losses.append(loss)
    params = jax.tree.map(lambda a, b: a - lr * b, params, grad)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(m["loss"], np.mean(losses), rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(m["pg_loss"], np.mean(losses), rtol=1e-4, atol=1e-7)


def test_micro_batches_layout():
  samples = [batching.Sample(np.array([5, 6]), np.array([7] * k), float(k)) for k in (9, 1, 4)]
  # lengths 11, 3, 6; 2 rows of the 11-token sample's bucket 16: first-fit longest first puts
  # the 6 beside nothing it fits with (11 + 6 > 16) and the 3 beside the 11
  mbs = list(batching.micro_batches(samples, rows=2, pad_multiple=4, max_len=64))
  assert len(mbs) == 1 and mbs[0].tokens.shape == (2, 16)
  mb = mbs[0]
  np.testing.assert_array_equal(mb.tokens[0, :14], [5, 6] + [7] * 9 + [5, 6, 7])
  np.testing.assert_array_equal(mb.positions[0, :14], list(range(11)) + [0, 1, 2])
  np.testing.assert_array_equal(mb.segment_ids[0], [1] * 11 + [2] * 3 + [0] * 2)
  np.testing.assert_array_equal(mb.loss_mask[0], [0, 0] + [1] * 9 + [0, 0, 1] + [0] * 2)
  np.testing.assert_array_equal(mb.advantages[0, :14], [9.0] * 11 + [1.0] * 3)
  np.testing.assert_array_equal(mb.index[0], [0] * 11 + [1] * 3 + [-1] * 2)
  np.testing.assert_array_equal(mb.index[1], [2] * 6 + [-1] * 10)
  assert mb.segment_ids[1].max() == 1 and mb.advantages[1, 6:].sum() == 0
  # capped at max_len (rounded up to the multiple): with max_len 12 rows are 12 long, and the
  # 3 no longer fits beside the 11; it goes beside the 6
  capped = list(batching.micro_batches(samples, rows=2, pad_multiple=4, max_len=12))
  assert [mb.tokens.shape for mb in capped] == [(2, 12)]
  np.testing.assert_array_equal(capped[0].index[1, :9], [2] * 6 + [1] * 3)
  # token budget 32: 2 rows at T=16 hold all but one 2-token sample (11+3+2, 6+2x5), which gets
  # its own micro-batch of 8 rows at T=4 (a multiple of row_multiple 2), shortest first
  many = samples + [batching.Sample(np.array([5]), np.array([7]), 0.0) for _ in range(7)]
  mbs = list(batching.micro_batches(many, rows=0, pad_multiple=4, max_len=64, max_tokens=32,
                                row_multiple=2))
  assert [mb.tokens.shape for mb in mbs] == [(8, 4), (2, 16)]
  held = [i for mb in mbs for i in np.unique(mb.index) if i >= 0]
  assert sorted(held) == list(range(10)) and len(np.unique(mbs[0].index)) == 2
  with pytest.raises(ValueError, match="longer than max_len"):
    batching.micro_layout([13], 2, 4, 12)


@pytest.mark.parametrize("loss_agg", batching.LOSS_AGG)
def test_minibatches_weigh_each_token_as_the_configured_aggregation(loss_agg):
  """Each response token's loss weight, read back per sample through the packed layout: the
  mini-batch's aggregation as defined (token-mean: 1 / its response tokens; the sequence means:
  each response 1 / the responses, its tokens alike (token-mean-of-sequence), or 1 / the
  generation budget each (-norm)); nothing on prompts or padding."""
  rng = np.random.RandomState(3)
  samples = [batching.Sample(rng.randint(1, 9, rng.randint(1, 5)),
                             rng.randint(1, 9, rng.choice([1, 2, 7, 13])), 1.0)
             for _ in range(14)]
  mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  spec = rl_learner.LearnerSpec(CFG, grpo.GRPOConfig(loss_agg=loss_agg, loss_norm_len=20), None,
                          mesh, micro_batch=3, pad_multiple=4)
  groups = batching.minibatches(samples, spec, num_minibatches=3, seed=1)
  for group, part in zip(groups, batching.minibatch_parts(len(samples), 3, 1)):
    lens = {j: len(samples[i].response_ids) for j, i in enumerate(part)}  # (index: in part)
    for mb in group:
      assert np.all(mb.loss_weight[mb.loss_mask == 0] == 0)
      for i in np.unique(mb.index[mb.index >= 0]):
        w = mb.loss_weight[(mb.index == i) & (mb.loss_mask == 1)]
        assert w.size == lens[int(i)] and np.all(w == w[0])
        want = {"token-mean": 1 / sum(lens.values()),
                "seq-mean-token-mean": 1 / (len(lens) * lens[int(i)]),
                "seq-mean-token-sum": 1 / len(lens),
                "seq-mean-token-sum-norm": 1 / (len(lens) * 20)}[loss_agg]
        np.testing.assert_allclose(w[0], want, rtol=1e-6)


def test_micro_layout_buckets_and_token_budget_rows_by_hand():
  """A micro-batch's T is the smallest pad_multiple x 2^k holding its longest sample (one of
  exactly 16 tokens fits 16, not 32); under a token budget its rows are max_tokens // T
  rounded down to row_multiple (40 // 4 = 10 -> 8 rows of 4 tokens), at least row_multiple."""
  [(bins, t, n)] = batching.micro_layout([16, 5], 2, 4, 64)
  assert (t, n) == (16, 2) and bins == [[0], [1]]
  [(bins, t, n)] = batching.micro_layout([17], 2, 4, 64)
  assert (t, n) == (32, 2)
  [(bins, t, n)] = batching.micro_layout([2] * 3, 0, 4, 64, max_tokens=40, row_multiple=4)
  assert (t, n) == (4, 8) and bins[:2] == [[0, 1], [2]] and not any(bins[2:])
  [(_, t, n)] = batching.micro_layout([30], 0, 4, 64, max_tokens=40, row_multiple=4)
  assert (t, n) == (32, 4)  # 40 // 32 = 1 row: still row_multiple of them


def test_micro_layout_with_max_rows_computes_the_fewest_tokens():
  """max_rows: six samples of 20 under a 128-token budget (max_len 62 -> 64) fill two rows of
  64 in one micro-batch (128 tokens), where the buckets put one in each row of 32 (two
  micro-batches, 256); three of 10 with rows in fours (a budget of 64) keep the buckets' four
  rows of 16 (64 tokens), not four rows of 64 (256). On random lengths it never computes more
  tokens than the buckets, and places every sample once in rows it fits."""
  [(bins, t, n)] = batching.micro_layout([20] * 6, 0, 4, 62, max_tokens=128, max_rows=True)
  assert (t, n) == (64, 2) and bins == [[0, 1, 2], [3, 4, 5]]
  assert [(t, n) for _, t, n in batching.micro_layout([20] * 6, 0, 4, 62, max_tokens=128)] == [
      (32, 4), (32, 4)]
  [(_, t, n)] = batching.micro_layout([10] * 3, 0, 4, 62, max_tokens=64, row_multiple=4,
                                      max_rows=True)
  assert (t, n) == (16, 4)
  rng = np.random.default_rng(3)
  for _ in range(20):
    lens = [int(x) for x in rng.integers(1, 62, int(rng.integers(1, 300)))]
    kw = dict(max_tokens=int(rng.choice([128, 512, 2048])), row_multiple=int(rng.choice([1, 4])))
    got = batching.micro_layout(lens, 0, 4, 62, max_rows=True, **kw)
    buckets = batching.micro_layout(lens, 0, 4, 62, **kw)
    assert sum(t * n for _, t, n in got) <= sum(t * n for _, t, n in buckets)
    assert sorted(i for bins, _, _ in got for b in bins for i in b) == list(range(len(lens)))
    assert all(sum(lens[i] for i in b) <= t for bins, t, _ in got for b in bins)


def test_minibatches_are_a_seeded_random_partition():
  """Not cut from the samples' order (a step of only short, then only long responses): a
  partition into near-equal parts that is a function of the seed."""
  n = 12
  for seed in range(4):
    parts = batching.minibatch_parts(n, 3, seed)
    assert sorted(np.concatenate(parts).tolist()) == list(range(n))
    assert [len(p) for p in parts] == [4, 4, 4]
    assert [p.tolist() for p in parts] == [p.tolist() for p in
                                           batching.minibatch_parts(n, 3, seed)]
  cuts = {tuple(map(tuple, map(sorted, batching.minibatch_parts(n, 3, seed))))
          for seed in range(4)}
  assert len(cuts) == 4 and ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)) not in cuts
  assert len(batching.minibatch_parts(2, 5, 0)) == 2  # never an empty mini-batch


def test_grpo_raises_a_toy_reward_on_a_sharded_learner():
  """Reward = share of response tokens equal to 3. A few GRPO steps (rollout -> rewards ->
  FSDP learner on 8 devices -> weight sync) must raise it well above its start."""
  params = init_params(CFG, jax.random.key(3), std=0.05)
  mesh = make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
  gcfg = grpo.GRPOConfig()
  tx = make_optimizer(3e-2, warmup_steps=1, total_steps=10, weight_decay=0.0, b1=0.9, b2=0.99,
                      grad_clip=1.0)
  spec = rl_learner.LearnerSpec(CFG, gcfg, tx, mesh, micro_batch=16, pad_multiple=8)
  state = rl_learner.init_learner(params, spec)
  leaf = state.params["layers"]["up"]
  assert leaf.sharding.spec[1] == "fsdp" and len(leaf.addressable_shards) == 8
  worker = Engine(params, CFG, EngineConfig(max_batch=32, buckets=(8, 32),
                                                   max_prompt_len=8, max_new_tokens=8))
  sp = SamplingParams(temperature=1.0)
  rng = np.random.RandomState(0)
  means = []
  for step in range(8):
    prompts = [list(rng.randint(1, 23, 4)) for _ in range(8)]
    reqs = [Request(p, i, s) for i, p in enumerate(prompts) for s in range(4)]
    res = worker.generate(reqs, sp, seed=step)
    r = np.zeros((8, 4))
    for x in res:
      r[x.request_id, x.sample_index] = np.mean(x.response_ids == 3)
    means.append(r.mean())
    adv = advantages.group_advantages(r)
    samples = [batching.Sample(x.prompt_ids, x.response_ids, adv[x.request_id, x.sample_index])
               for x in res]
    minibatches = batching.minibatches(samples, spec, num_minibatches=2, seed=step)
    assert len(minibatches) == 2
    state, m = rl_learner.update(state, rl_learner.prepare(state, minibatches, spec), spec)
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
    worker.set_params(state.params)
  assert means[0] < 0.15, means
  assert np.mean(means[-2:]) > 2.5 * means[0] and np.mean(means[-2:]) > 0.25, means


def test_a_minibatch_whose_gradients_are_not_finite_takes_no_step():
  """A mini-batch whose gradients hold a NaN (here a NaN advantage) takes no optimizer step:
  params, Adam's moments and its count stay as they were, and the next mini-batch steps from
  them as if it were the first (== an update over that mini-batch alone); the metrics average
  the mini-batch that stepped and count the skip."""
  mesh = make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
  tx = make_optimizer(1e-2, weight_decay=0.0, b1=0.9, b2=0.99, grad_clip=1.0)
  spec = rl_learner.LearnerSpec(CFG, grpo.GRPOConfig(), tx, mesh, micro_batch=8, pad_multiple=8)
  params = init_params(CFG, jax.random.key(3), std=0.05)
  rng = np.random.RandomState(0)

  def samples(advantages):
    return [batching.Sample(rng.randint(1, 23, 4), rng.randint(1, 23, 6), float(a))
            for a in advantages]
  bad = batching.minibatches(samples([np.nan] + list(rng.randn(7))), spec)
  good = batching.minibatches(samples(rng.randn(8)), spec)
  state = rl_learner.init_learner(params, spec)
  state, m = rl_learner.update(state, rl_learner.prepare(state, bad + good, spec), spec)
  ref = rl_learner.init_learner(params, spec)
  ref, want = rl_learner.update(ref, rl_learner.prepare(ref, good, spec), spec)
  assert m["skipped"] == 1 and want["skipped"] == 0
  assert int(state.opt_state[1][0].count) == int(ref.opt_state[1][0].count) == 1
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(m["loss"], want["loss"], rtol=1e-5, atol=1e-7)
  assert np.isfinite(m["grad_norm"]) and m["grad_norm"] == pytest.approx(want["grad_norm"])


@pytest.mark.parametrize("warmup", [0, 2])
def test_learner_first_step_runs_at_the_scheduled_lr(warmup):
  """update(state, batches) -> (state, metrics) with the state donated. Adam's first step moves
  a param by lr_0 * |g| / (|g| + eps): by the full lr wherever the gradient is not ~0 when
  there is no warm-up (the learner once ran it at lr 0), by nothing with one."""
  lr = 1e-2
  mesh = make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
  tx = make_optimizer(lr, warmup_steps=warmup, weight_decay=0.0, b1=0.9, b2=0.99,
                      grad_clip=0.0)
  spec = rl_learner.LearnerSpec(CFG, grpo.GRPOConfig(), tx, mesh, micro_batch=8, pad_multiple=8)
  state = rl_learner.init_learner(init_params(CFG, jax.random.key(3), std=0.05), spec)
  # copies made on the device: reading the array itself into numpy keeps a view of its CPU
  # buffer (JAX caches it on the array; jax 0.11), and a viewed buffer is not donated
  before = [np.asarray(jnp.copy(x)) for x in jax.tree.leaves(state.params)]
  rng = np.random.RandomState(0)
  samples = [batching.Sample(rng.randint(1, 23, 4), rng.randint(1, 23, 6), float(a))
             for a in rng.randn(12)]
  old = state
  batches = batching.minibatches(samples, spec)
  state, m = rl_learner.update(state, rl_learner.prepare(state, batches, spec), spec)
  assert all(x.is_deleted() for x in jax.tree.leaves(old))  # donated
  assert m["grad_norm"] > 0 and int(state.opt_state[0][0].count) == 1
  moved = np.concatenate([np.abs(np.asarray(a, np.float64) - b).ravel()
                          for a, b in zip(jax.tree.leaves(state.params), before)])
  if warmup:
    assert moved.max() == 0
  else:
    assert moved.max() <= lr * (1 + 1e-4)
    assert np.mean(np.abs(moved - lr) < 1e-2 * lr) > 0.5, np.percentile(moved, [10, 50, 90])


@pytest.mark.parametrize("fsdp,lora_rank", [(1, 0), (8, 0), (8, 4)])
def test_learner_compiles_each_micro_batch_shape_once(fsdp, lora_rank):
  """Over several RL steps of two mini-batches each, every micro-batch shape's old-log-prob
  pass and gradient step compile once: not again for the first micro-batch of a mini-batch
  (its metric sums came in uncommitted) nor after the first optimizer step (the params came
  out of it in another layout than init_learner put them in), nor for the first mini-batch's
  on-policy micro-batches (no old log-probs computed); nor in a second run of the process
  (a new learner of the same config: its own optimizer and mesh objects, as a notebook's next
  run builds them); with LoRA and a KL term, the reference (the base, zero adapters) in no
  program of its own. Counted by JAX's own log of what it compiles ("Compiling jit(...)": once
  per XLA compile, whatever the persistent cache holds; its per-call dispatch cache may key one
  executable twice where two layouts are the same)."""
  from tlt_jax.models.lora import LoraConfig
  lora = LoraConfig(lora_rank) if lora_rank else None
  gcfg = grpo.GRPOConfig(kl_coef=0.01 if lora else 0.0)
  mesh = make_mesh({"data": 1, "fsdp": fsdp, "tensor": 1}, devices=jax.devices()[:fsdp])
  tx = make_optimizer(1e-3, weight_decay=0.0, grad_clip=1.0)
  spec = rl_learner.LearnerSpec(CFG, gcfg, tx, mesh, micro_batch=8, pad_multiple=8,
                                micro_batch_tokens=64, lora=lora)
  state = rl_learner.init_learner(init_params(CFG, jax.random.key(3), std=0.05), spec)
  rng = np.random.RandomState(0)
  shapes = set()
  compiled = []

  class Log(logging.Handler):
    def emit(self, record):
      compiled.extend(n for n in ("_accumulate", "logprobs")
                      if record.getMessage().startswith(f"Compiling jit({n})"))

  handler = Log(level=logging.DEBUG)
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  level = logger.level
  logger.setLevel(logging.DEBUG)
  try:
    with jax.log_compiles():
      for step in range(3):
        # short and long samples (6 and 29 tokens: a short one fits no long row's gap):
        # micro-batches of 8 x 8 and 2 x 32 tokens (8 x 32 over 8 devices: rows come in
        # multiples of them), in both positions
        samples = [batching.Sample(rng.randint(1, 23, 3), rng.randint(1, 23, n),
                               float(rng.randn())) for n in rng.choice([3, 26], 24)]
        batches = batching.minibatches(samples, spec, num_minibatches=2, seed=step)
        shapes |= {mb.tokens.shape for group in batches for mb in group}
        state, _ = rl_learner.update(state, rl_learner.prepare(state, batches, spec), spec)
      mesh = make_mesh({"data": 1, "fsdp": fsdp, "tensor": 1}, devices=jax.devices()[:fsdp])
      spec = rl_learner.LearnerSpec(CFG, gcfg,
                                    make_optimizer(1e-3, weight_decay=0.0, grad_clip=1.0), mesh,
                                    micro_batch=8, pad_multiple=8, micro_batch_tokens=64,
                                    lora=lora)
      state = rl_learner.init_learner(init_params(CFG, jax.random.key(4), std=0.05), spec)
      state, _ = rl_learner.update(state, rl_learner.prepare(state, batches, spec), spec)
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
  assert shapes == {(8, 8), (max(2, fsdp), 32)}
  assert sorted(compiled) == sorted(["_accumulate", "logprobs"] * len(shapes)), compiled


@pytest.mark.parametrize("fsdp,attention,max_rows,rollout_is,loss_mode", [
    (1, "xla", False, "", "vanilla"), (8, "xla", False, "", "vanilla"),
    (8, "fused", False, "", "vanilla"), (1, "xla", True, "", "vanilla"),
    (8, "xla", False, "sequence", "vanilla"), (8, "xla", False, "", "gspo")])
def test_packed_learner_equals_each_sample_run_alone(setup, fsdp, attention, max_rows,
                                                     rollout_is, loss_mode):
  """The learner's packed micro-batches (several samples per row, on 1 or 8 devices; XLA's
  masked attention or the Pallas flash-attention kernel, interpreted here, per shard; rows of
  length buckets or all of the max length; with the rollout's log-probs and their
  per-response importance weights, rows split over 8 devices; GSPO's per-response ratio in
  its token form against the sequence objective it stands for): every
  response token's old log-prob, and the loss and gradient of the mini-batch, equal those of
  each sample run alone in a row of its own (no packing, plain causal attention:
  grpo.token_logprobs without segments), summed; off policy (a later mini-batch) and on
  policy (the first: old log-probs not computed)."""
  params, new, _, samples = setup
  rng = np.random.RandomState(2)
  samples = samples + [batching.Sample(rng.randint(1, 23, 3), rng.randint(1, 23, rng.randint(1, 9)),
                                   float(rng.randn())) for _ in range(9)]
  # each sample alone in a row of its own, right-padded (harmless under the causal mask)
  rows = np.zeros((len(samples), 64), np.int32)
  resp = np.zeros((len(samples), 64), np.float32)
  for i, s in enumerate(samples):
    k, n_s = len(s.prompt_ids), s.length
    rows[i, :n_s] = np.concatenate([s.prompt_ids, s.response_ids])
    resp[i, k:n_s] = 1.0
  alone = jax.jit(lambda p: grpo.token_logprobs(p, jnp.asarray(rows), cfg=CFG,
                                                temperature=1.0)[0])
  old = np.asarray(alone(params))
  weight = np.ones((len(samples), 1), np.float32)  # each response's importance weight
  if rollout_is:  # the rollout's log-probs off the old policy's by 0.1 nats a token
    samples = [dataclasses.replace(s, rollout_logp=(
        old[i, len(s.prompt_ids):s.length] + rng.normal(0, 0.1, len(s.response_ids))
    ).astype(np.float32)) for i, s in enumerate(samples)]
    weight[:, 0] = [min(np.exp(np.sum(old[i, len(s.prompt_ids):s.length].astype(np.float64)
                                      - s.rollout_logp)), 1.2) for i, s in enumerate(samples)]
    assert 0 < np.mean(weight < 1.2) < 1  # weights capped, and not
  cfg = dataclasses.replace(CFG, attention=attention)
  mesh = make_mesh({"data": 1, "fsdp": fsdp, "tensor": 1}, devices=jax.devices()[:fsdp])
  tx = make_optimizer(1e-3, weight_decay=0.0, grad_clip=0.0)
  eps = (0.03, 0.04) if loss_mode == "gspo" else (0.2, 0.28)
  spec = rl_learner.LearnerSpec(cfg, grpo.GRPOConfig(eps_low=eps[0], eps_high=eps[1],
                                               rollout_is=rollout_is, rollout_is_cap=1.2,
                                               loss_mode=loss_mode),
                          tx, mesh, micro_batch=8, pad_multiple=16, max_len=64,
                          micro_batch_tokens=128 if max_rows else 256, max_rows=max_rows)
  state = rl_learner.init_learner(params, spec)
  group = list(batching.micro_batches(samples, spec.micro_batch, spec.pad_multiple, spec.max_len,
                                  spec.micro_batch_tokens, spec.row_multiple,
                                  max_rows=max_rows))
  if max_rows:  # rows of 64 in every micro-batch (buckets: 8 rows of 16 in one of them)
    assert {mb.tokens.shape[1] for mb in group} == {64} and len(group) > 2
  assert max(mb.segment_ids.max() for mb in group) >= 3
  assert len(group) > 1 or fsdp > 1  # accumulated over micro-batches (8 x 64 holds them all)
  # the same micro-batches as a step's first mini-batch (on policy: no old log-probs
  # computed) and as a later one (computed)
  first, prepared = rl_learner.prepare(state, [group, group], spec)
  assert all(bool(b.on_policy) for b in first) and not any(bool(b.on_policy) for b in prepared)
  n = sum(float(mb.loss_mask.sum()) for mb in group)
  for mb, dev in zip(group, prepared):
    got = np.asarray(dev.old_logp)
    for r, t in zip(*np.nonzero(mb.loss_mask)):
      np.testing.assert_allclose(got[r, t], old[mb.index[r, t], mb.positions[r, t]],
                                 rtol=1e-5, atol=1e-5)

  gcfg = spec.gcfg
  adv = np.asarray([s.advantage for s in samples], np.float32)[:, None]

  def reference_loss(p):  # the clipped objective of every response token, sample by sample
    ratio = jnp.exp(alone(p) - old)
    if loss_mode == "gspo":  # each response's geometric mean ratio, a function of p itself
      ratio = jnp.broadcast_to(jnp.exp(jnp.sum((alone(p) - old) * resp, 1, keepdims=True)
                                       / resp.sum(1, keepdims=True)), ratio.shape)
    pg = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - gcfg.eps_low, 1 + gcfg.eps_high))
    return jnp.sum(pg * weight * resp) / n

  # the learner's gradient at `new` (ratios away from 1, clipping on both sides)
  state = state.replace(params=jax.device_put(new, jax.tree.map(lambda x: x.sharding,
                                                                state.params)))
  zeros = functools.partial(rl_learner._zero_grads, spec=spec)
  step = functools.partial(rl_learner._accumulate, spec=spec)
  metrics = ("pg_loss", "entropy", "clip_frac", "approx_kl_old", "loss") + (
      ("rollout_kl", "rollout_k3", "rollout_prob_diff", "rollout_is_weight",
       "rollout_is_clip_frac") if rollout_is else ())
  acc = (zeros(state.params), {k: jax.device_put(jnp.zeros(()), rl_learner.replicated(mesh))
                               for k in metrics})
  for dev in prepared:
    acc = step(state.params, None, acc, dev, jnp.float32(n))
  want_loss, want = jax.value_and_grad(reference_loss)(new)
  # a per-response importance weight is exp of a sum of its tokens' log-probs, each the
  # reference's within the 1e-5 checked above: ~1e-5 x a response's tokens (1.7e-5 seen on
  # jax 0.11.2's CPU fusion order)
  loss_rtol = 1e-4 if rollout_is else 1e-5
  np.testing.assert_allclose(float(acc[1]["loss"]), float(want_loss), rtol=loss_rtol, atol=1e-6)
  assert 0.05 < float(acc[1]["clip_frac"]) < 0.95  # ratios clipped, and not
  for a, b in zip(jax.tree.leaves(acc[0]), jax.tree.leaves(want)):  # float32 sums' rounding
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3,
                               atol=1e-4 * float(jnp.max(jnp.abs(b))))
  # on policy (the first mini-batch, at the old params): the loss's own log-probs as the old
  # ones give the reference's loss and gradient there too
  at_old = jax.device_put(params, jax.tree.map(lambda x: x.sharding, state.params))
  acc = (zeros(at_old), {k: jax.device_put(jnp.zeros(()), rl_learner.replicated(mesh))
                         for k in metrics})
  for dev in first:
    acc = step(at_old, None, acc, dev, jnp.float32(n))
  want_loss, want = jax.value_and_grad(reference_loss)(params)
  np.testing.assert_allclose(float(acc[1]["loss"]), float(want_loss), rtol=loss_rtol, atol=1e-6)
  for a, b in zip(jax.tree.leaves(acc[0]), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3,
                               atol=1e-4 * float(jnp.max(jnp.abs(b))))


def test_ppo_epochs_pass_over_the_minibatches_against_the_rollout_policys_log_probs(setup):
  """grpo.ppo_epochs=2 over two mini-batches: four optimizer steps (SGD, so each is exactly
  its gradient x 0.1), in order A, B, A, B, each the gradient of the clipped objective of its
  samples run alone at the params so far, every ratio against the log-probs of the params the
  step started from (the first mini-batch's computed too: its second pass is off policy)."""
  params, _, _, samples = setup
  rng = np.random.RandomState(4)
  samples = samples + [batching.Sample(rng.randint(1, 23, 3), rng.randint(1, 23, rng.randint(1, 9)),
                                   float(rng.randn())) for _ in range(5)]
  mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 1}, devices=jax.devices()[:2])
  gcfg = grpo.GRPOConfig(eps_low=0.2, eps_high=0.28, ppo_epochs=2)
  spec = rl_learner.LearnerSpec(CFG, gcfg, optax.sgd(0.1), mesh, micro_batch=4, pad_multiple=16,
                          max_len=64)
  state = rl_learner.init_learner(params, spec)
  batches = batching.minibatches(samples, spec, 2, seed=3)
  prepared = rl_learner.prepare(state, batches, spec)
  assert not any(bool(b.on_policy) for group in prepared for b in group)
  parts = batching.minibatch_parts(len(samples), 2, 3)
  state, m = rl_learner.update(state, prepared, spec)
  assert m["skipped"] == 0 and m["approx_kl_old"] != 0  # (later steps moved off the old)

  def alone(p, s):  # the sample's response tokens' log-probs, run in a row of its own
    seq = jnp.asarray(np.concatenate([s.prompt_ids, s.response_ids]))[None]
    return grpo.token_logprobs(p, seq, cfg=CFG, temperature=1.0)[0][0, len(s.prompt_ids):]

  def objective(p, part):  # the mini-batch's token mean of the clipped terms
    terms = []
    for i in part:
      s = samples[i]
      ratio = jnp.exp(alone(p, s) - alone(params, s))
      terms.append(jnp.maximum(-s.advantage * ratio, -s.advantage * jnp.clip(ratio, 0.8, 1.28)))
    return jnp.sum(jnp.concatenate(terms)) / sum(len(t) for t in terms)

  want = params
  for part in [*parts, *parts]:
    g = jax.grad(objective)(want, part)
    want = jax.tree.map(lambda w, d: w - 0.1 * d, want, g)
  moved = jax.tree.map(lambda w, p: float(jnp.max(jnp.abs(w - p))), want, params)
  assert max(jax.tree.leaves(moved)) > 0.05  # (the steps are not negligible)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_the_reference_forward_runs_only_with_a_kl_term(kl_coef):
  """kl_coef == 0 (the DAPO / Dr. GRPO setting): no reference params kept and no reference
  log-probs computed; > 0: both, equal to the initial policy's log-probs."""
  mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  spec = rl_learner.LearnerSpec(CFG, grpo.GRPOConfig(kl_coef=kl_coef), make_optimizer(1e-3), mesh,
                          micro_batch=4, pad_multiple=32)
  state = rl_learner.init_learner(init_params(CFG, jax.random.key(3), std=0.05), spec)
  rng = np.random.RandomState(0)
  samples = [batching.Sample(rng.randint(1, 23, 3), rng.randint(1, 23, 9), float(a))
             for a in rng.randn(8)]
  first, later = rl_learner.prepare(state, batching.minibatches(samples, spec, 2), spec)
  assert (state.ref_params is None) == (kl_coef == 0)
  for b in first + later:
    assert (b.ref_logp is None) == (kl_coef == 0)
  if kl_coef:
    np.testing.assert_array_equal(np.asarray(later[0].ref_logp), np.asarray(later[0].old_logp))


def test_advantage_estimators_against_their_definitions():
  """rloo: each response against the mean of the others in its group, written as that loop;
  reinforce_plus_plus_baseline: r - the group's mean, repeated over each response's tokens,
  whitened over all the batch's tokens (ddof 1, 1e-8 under the root), read back per response;
  grpo: group_advantages."""
  from tlt_jax.rl.advantages import advantages, group_advantages
  rng = np.random.default_rng(3)
  r = rng.integers(0, 2, (5, 4)).astype(np.float64) + rng.normal(0, 0.1, (5, 4))
  lengths = rng.integers(1, 40, (5, 4)).astype(np.float64)
  loo = np.array([[r[p, i] - np.mean([r[p, j] for j in range(4) if j != i]) for i in range(4)]
                  for p in range(5)])
  np.testing.assert_allclose(advantages(r, lengths, estimator="rloo"), loo, rtol=1e-5)
  per_token = np.concatenate([np.full(int(lengths[p, i]), r[p, i] - r[p].mean())
                              for p in range(5) for i in range(4)])
  whitened = (per_token - per_token.mean()) / np.sqrt(per_token.var(ddof=1) + 1e-8)
  starts = np.cumsum([0] + [int(x) for x in lengths.ravel()])[:-1]
  np.testing.assert_allclose(
      advantages(r, lengths, estimator="reinforce_plus_plus_baseline").ravel(),
      whitened[starts], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(advantages(r, lengths), group_advantages(r))
  with pytest.raises(ValueError, match="unknown estimator 'ppo'"):
    advantages(r, lengths, estimator="ppo")
  # a batch of one response token has no token variance (ddof 1): no signal, not NaN
  one = advantages(np.array([[1.0, 0.0]]), np.array([[1.0, 0.0]]),
                   estimator="reinforce_plus_plus_baseline")
  np.testing.assert_array_equal(one, np.zeros((1, 2), np.float32))


def test_the_entropy_bonus_differentiates_as_the_entropy_of_each_sample_alone(setup):
  """grpo.entropy_coef: the packed loss's gradient with the bonus less its gradient without is
  -coef x the gradient of the response tokens' entropy summed over each sample run alone
  (unpacked) over the batch's tokens (token-mean)."""
  old, new, _, samples = setup
  mbs = list(batching.micro_batches(samples, rows=2, pad_multiple=64, max_len=64))
  n = jnp.float32(sum(float(mb.loss_mask.sum()) for mb in mbs))

  def grad_with(coef):
    gcfg = grpo.GRPOConfig(entropy_coef=coef)
    fn = jax.jit(jax.grad(lambda p, dev: grpo.grpo_loss(p, dev, cfg=CFG, gcfg=gcfg,
                                                        num_tokens=n)[0]))
    total = None
    for mb in mbs:
      packed = (jnp.asarray(mb.tokens), jnp.asarray(mb.positions),
                jnp.asarray(mb.segment_ids))
      dev = grpo.Batch(*packed, jnp.asarray(mb.loss_mask), jnp.asarray(mb.loss_weight),
                       jnp.asarray(mb.advantages),
                       grpo.token_logprobs(old, *packed, cfg=CFG, temperature=1.0)[0])
      g = fn(new, dev)
      total = g if total is None else jax.tree.map(jnp.add, total, g)
    return total

  @jax.jit
  @jax.grad
  def entropy(p, seq, response):
    ent = grpo.token_logprobs(p, seq, cfg=CFG, temperature=1.0)[1][0]
    return jnp.sum(jnp.where(response, ent, 0.0)) / n

  g_ent = _summed_alone(lambda seq, resp, s: entropy(new, seq, resp), samples)
  diff = jax.tree.map(jnp.subtract, grad_with(0.1), grad_with(0.0))
  for a, b in zip(jax.tree.leaves(diff), jax.tree.leaves(g_ent)):
    np.testing.assert_allclose(np.asarray(a), -0.1 * np.asarray(b), rtol=2e-3, atol=1e-6)
  assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g_ent)) > 1e-3
