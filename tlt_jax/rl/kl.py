"""The KL term to the frozen reference policy: per-token estimators of KL(pi || pi_ref) from
the sampled tokens' log-probs, as VeRL's `kl_loss_type` names them (`core_algos.kl_penalty`).

With d = log pi_ref(x) - log pi(x) on a token x sampled from pi (Schulman, "Approximating KL
divergence", 2020):

- `low_var_kl` (k3, the default; VeRL's GRPO recipes): e^d - d - 1, gradient in log pi
  1 - e^d: an unbiased value, >= 0, of low variance; its gradient's expectation is that of
  the reverse KL(pi_ref || pi);
- `kl` (k1): -d, gradient 1: an unbiased value, but a gradient whose expectation is 0;
- `mse` (k2): d^2 / 2, gradient -d: a biased value (second order), >= 0, whose gradient's
  expectation is KL(pi || pi_ref)'s;
- `abs`: abs(d), gradient -sign(d): >= 0.
(The expectations over tokens sampled from pi: on-policy, the step's first mini-batch.)

VeRL clamps k3 to [-10, 10]; here it is not clamped (a token that far from the reference is
one the term should pull back).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KL_LOSS_TYPES = ("low_var_kl", "kl", "mse", "abs")


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str) -> jax.Array:
  """Each token's KL estimate (the table above) from its log-prob under the policy `logp` and
  under the reference `ref_logp`, both [..., T]."""
  d = ref_logp - logp
  if kind == "low_var_kl":
    return jnp.exp(d) - d - 1.0
  if kind == "kl":
    return -d
  if kind == "mse":
    return 0.5 * d * d
  if kind == "abs":
    return jnp.abs(d)
  raise ValueError(f"kl_loss_type={kind!r}: use one of {', '.join(KL_LOSS_TYPES)}")
