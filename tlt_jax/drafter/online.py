"""Online drafter training inside the RL loop: the drafter follows the moving policy.

Data comes for free: the learner's old-log-prob forward over every (prompt + response) row
already computes the policy's last-layer hidden states (the same f_t the rollout produced,
from the same params), so the drafter trains on those device arrays without another target
forward or a host round trip. The drafter therefore lags the policy by one update
("one-step-off", DESIGN.md 5). Only the drafter's own params and optimizer state are trained
and checkpointed; the target's embedding / final norm / LM head are read, frozen.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from tlt_jax.drafter.loss import LossConfig, drafter_loss
from tlt_jax.models import ModelConfig, Params


def drafter_mask(response_mask: jax.Array) -> jax.Array:
  """Learner response mask [B, T] -> drafter loss_mask [B, T]: hidden f_t is a target iff it
  produced a response token, i.e. token t+1 is a response token (tlt_jax/drafter/loss.py)."""
  return jnp.concatenate([response_mask[:, 1:], jnp.zeros_like(response_mask[:, :1])], axis=1)


class OnlineDrafterTrainer:
  """AdamW on the drafter's trainable params; `step` takes one micro-batch of the learner."""

  def __init__(self, dparams: Params, cfg: ModelConfig, *, lr: float, mesh=None,
               weight_decay: float = 0.01, grad_clip: float = 1.0,
               loss_cfg: LossConfig = LossConfig()):
    from tlt_jax.sharding import tree_shardings
    self.cfg = cfg
    self.tx = optax.chain(optax.clip_by_global_norm(grad_clip),
                          optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=weight_decay))
    # On the learner's mesh (the target params it reads live there), state included, so a
    # checkpoint restored onto these templates lands on the same devices.
    self.params = dparams if mesh is None else jax.device_put(dparams,
                                                               tree_shardings(dparams, mesh))
    opt_shardings = None if mesh is None else tree_shardings(
        jax.eval_shape(self.tx.init, self.params), mesh)
    self.opt_state = jax.jit(self.tx.init, out_shardings=opt_shardings)(self.params)
    loss = functools.partial(drafter_loss, cfg=cfg, loss_cfg=loss_cfg)

    def step(dparams, opt_state, target_params, batch):
      (_, m), g = jax.value_and_grad(loss, has_aux=True)(dparams, target_params, batch)
      updates, opt_state = self.tx.update(g, opt_state, dparams)
      return optax.apply_updates(dparams, updates), opt_state, {
          "loss": m["loss"], "acc": m["acc"], "tokens": m["tokens"]}

    self._step = jax.jit(step, donate_argnums=(0, 1))

  def step(self, target_params: Params, tokens: jax.Array, hidden: jax.Array,
           response_mask: jax.Array) -> dict[str, jax.Array]:
    """tokens [B, T], hidden [B, T, D] (the policy's pre-norm hidden), response_mask [B, T]."""
    b, t = tokens.shape
    batch = {"tokens": tokens, "hidden": jax.lax.stop_gradient(hidden),
             "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
             "loss_mask": drafter_mask(response_mask.astype(jnp.float32))}
    self.params, self.opt_state, m = self._step(self.params, self.opt_state, target_params,
                                                batch)
    return m
