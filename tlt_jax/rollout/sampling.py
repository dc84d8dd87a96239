"""The one sampler: temperature / top-k / top-p processing and sampling with explicit keys.

Speculative verification (tlt_jax/rollout/speculative.py) uses `processed_logprobs` too, so the
distribution SD preserves is exactly the one plain decoding samples from.

Order of processing follows Hugging Face `generate`: temperature, then top-k, then top-p.
Ties at the top-k / top-p threshold are kept (a tied token is never arbitrarily dropped).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from tlt_jax.errors import ConfigError

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 1.0  # 0 -> greedy (argmax)
  top_k: int = 0  # 0 -> off
  top_p: float = 1.0  # 1 -> off

  def __post_init__(self):
    if not 0 <= self.temperature < math.inf:  # (NaN too)
      raise ConfigError("must be a finite number >= 0 (0 means greedy)", "temperature",
                        self.temperature)
    if self.top_k < 0:
      raise ConfigError("must be >= 0 (0 disables top-k)", "top_k", self.top_k)
    if not 0.0 < self.top_p <= 1.0:
      raise ConfigError("must be in (0, 1] (1 disables top-p)", "top_p", self.top_p)

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def plain_variant(sp: SamplingParams) -> SamplingParams:
  """What a plain decode executable fixes of `sp`: the truncation (top-k / top-p; none for a
  greedy request). Its temperature is an argument (`sample_tokens(temperature=)`), so the
  greedy held-out evaluation and the sampled rollouts run the same plain executables (one
  compile per (batch, window), not one per sampling setting)."""
  if sp.greedy:
    return SamplingParams()
  return SamplingParams(top_k=sp.top_k, top_p=sp.top_p)


def processed_logprobs(logits: jax.Array, sp: SamplingParams,
                       temperature: jax.Array | None = None) -> jax.Array:
  """logits [..., V] -> log-probs [..., V] of the distribution actually sampled from
  (-inf outside the top-k / top-p support). Greedy: the plain softmax (temperature 1).
  temperature: a traced scalar that replaces sp's (0: greedy, read at temperature 1)."""
  logits = logits.astype(jnp.float32)
  if temperature is not None:
    logits = logits / jnp.where(temperature == 0, 1.0, temperature).astype(jnp.float32)
  elif sp.greedy:
    return jax.nn.log_softmax(logits, axis=-1)
  else:
    logits = logits / sp.temperature
  if sp.top_k and sp.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, sp.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, NEG_INF, logits)
  if sp.top_p < 1.0:
    probs = jax.nn.softmax(logits, axis=-1)
    sorted_p = jnp.sort(probs, axis=-1)[..., ::-1]
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    # The smallest kept probability: tokens are kept while the mass before them < top_p.
    kept = jnp.where(mass_before < sp.top_p, sorted_p, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    logits = jnp.where(probs < threshold, NEG_INF, logits)
  return jax.nn.log_softmax(logits, axis=-1)


def sample_tokens(keys: jax.Array, logits: jax.Array, sp: SamplingParams,
                  temperature: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """keys [B] (typed or raw), logits [B, V] -> (tokens [B] int32, logprobs [B] float32).

  One key per row, so a row's sample does not depend on which other rows share its batch
  (the engine compacts batches; results must not depend on the bucket schedule).
  temperature: a traced scalar replacing sp's (`plain_variant`); 0 takes the argmax, as a
  greedy `sp` does, and draws no sample.
  """
  logp = processed_logprobs(logits, sp, temperature)
  argmax = lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32)
  draw = lambda: jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(keys, logp).astype(
      jnp.int32)
  if temperature is not None:
    tokens = jax.lax.cond(temperature == 0, argmax, draw)
  else:
    tokens = argmax() if sp.greedy else draw()
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
