"""Helpers shared by the speculative decoding tests: the tiny target the engine tests share
(`TINY`, its weights the `tiny` fixture of conftest.py, `SMALL` an engine layout for it), a
peaked target whose exact joint distribution over a few tokens is enumerable, and chi-square
tests against it (lossless sampling must pass, a broken acceptance rule must fail)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from tlt_jax.drafter.model import init_drafter
from tlt_jax.models import ModelConfig, forward, init_params
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.sampling import SamplingParams, processed_logprobs

# the engine tests' tiny target: its weights are conftest.py's `tiny` fixture
TINY = ModelConfig(arch="qwen2", vocab_size=61, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True,
                   tie_word_embeddings=True)
SMALL = dict(max_batch=4, buckets=(1, 2, 4), chunk_size=4, max_prompt_len=16, max_new_tokens=24)


def make_tiny():
  """(params, drafter params) of `TINY`: a random target with logits sharp enough to decode
  distinct answers, and a random drafter."""
  return init_params(TINY, jax.random.key(0), std=0.3), init_drafter(TINY, jax.random.key(1))


class PlainGreedy:
  """Plain greedy decoding of `TINY` in the `SMALL` layout (conftest.py's `plain_greedy`
  fixture): the reference the engine tests compare speculation with. `(reqs, stop_tokens=())`
  -> the results of a plain engine (no drafter) with those stop tokens.

  One engine per stop-token set, kept for the session, and its results kept per request
  list: a test asking for a reference another test already computed gets it without
  building an engine and compiling its executables again. What it returns is what a fresh
  engine returns: greedy decoding is deterministic, and a row's tokens do not depend on the
  engine, call or batch that decodes it (the speculative tests compare against exactly that).
  """

  def __init__(self, params):
    self.params = params
    self.engines: dict = {}
    self.results: dict = {}

  def engine(self, stop_tokens=()) -> Engine:
    stop = tuple(int(t) for t in stop_tokens)
    if stop not in self.engines:
      self.engines[stop] = Engine(self.params, TINY, EngineConfig(**SMALL, stop_tokens=stop))
    return self.engines[stop]

  def __call__(self, reqs, stop_tokens=()):
    stop = tuple(int(t) for t in stop_tokens)
    key = (stop, tuple((tuple(int(t) for t in r.prompt_ids), r.request_id, r.sample_index,
                        r.max_new_tokens) for r in reqs))
    if key not in self.results:
      self.results[key] = self.engine(stop).generate(list(reqs),
                                                     SamplingParams(temperature=0.0))
    return self.results[key]


V = 6
PEAKED = ModelConfig(arch="llama", vocab_size=V, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, tie_word_embeddings=False)
PROMPT = [1, 4, 2]
NEW = 3  # joint distribution of the first 3 tokens: V**3 = 216 cells
N = 12000


def make_peaked():
  """A target whose next-token distributions are peaked but not deterministic, and a random
  (mismatched) drafter."""
  params = init_params(PEAKED, jax.random.key(3), std=0.25)
  dparams = init_drafter(PEAKED, jax.random.key(4), std=0.3)
  return params, dparams


def exact_joint(params, sp: SamplingParams) -> np.ndarray:
  """p(t1, t2, t3 | prompt) under the processed distribution, by enumerating every prefix."""
  seqs = np.array(list(itertools.product(range(V), repeat=NEW - 1)), np.int32)  # [V^2, 2]
  toks = np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], axis=1)
  pos = np.broadcast_to(np.arange(toks.shape[1]), toks.shape)
  logits = forward(params, jnp.asarray(toks), jnp.asarray(pos), cfg=PEAKED).logits
  lp = np.asarray(processed_logprobs(logits, sp), np.float64)  # [V^2, T, V]
  p0 = len(PROMPT) - 1
  joint = np.zeros((V,) * NEW)
  for i, (a, b) in enumerate(seqs):
    joint[a, b, :] = np.exp(lp[i, p0, a] + lp[i, p0 + 1, b] + lp[i, p0 + 2])
  return joint / joint.sum()


def chi_square_p(seqs, joint):
  counts = np.zeros(joint.size)
  np.add.at(counts, np.ravel_multi_index(seqs.T, joint.shape), 1)
  expected = joint.ravel() * len(seqs)
  assert counts[expected == 0].sum() == 0, "sampled a token outside the target's support"
  keep = expected > 5  # pool sparse cells (chi-square validity)
  obs = np.append(counts[keep], counts[~keep].sum())
  exp = np.append(expected[keep], expected[~keep].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  return stats.chisquare(obs, exp).pvalue


SAMPLING = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4)]


def broken_p(seqs, joint):
  counts = np.zeros(joint.size)
  np.add.at(counts, np.ravel_multi_index(seqs.T, joint.shape), 1)
  keep = joint.ravel() * N > 5
  return stats.chisquare(np.append(counts[keep], counts[~keep].sum()),
                         np.append(joint.ravel()[keep], joint.ravel()[~keep].sum()) * N).pvalue
