"""The drafter's one train step and its state.

One pure jitted function `(state, target_params, batch) -> (state, metrics)` serves every
caller: the offline warm-up (scripts/train_drafter.py), spot training on idle rollout workers
(tlt_jax/coordinator/) and serial training after the policy update, and the tests. Only the
drafter's own params are trained and kept in `DrafterState`; the target's embedding, final
norm and LM head are read from `target_params` (the rollout worker's copy of the policy),
frozen.

Optimizer: tlt_jax/optim.py `make_optimizer` (its defaults are the reference implementation's
recipe: AdamW(b1 0.9, b2 0.95, wd 0.01), global-norm clip 1.0). Trained copies are merged in
tlt_jax/drafter/merge.py.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from tlt_jax.drafter.loss import LossConfig, drafter_loss
from tlt_jax.models import ModelConfig, Params
from tlt_jax.optim import if_finite


class DrafterState(NamedTuple):
  params: Params  # the drafter's trainable params (tlt_jax/drafter/model.py)
  opt_state: Any  # optax state of tlt_jax.optim.make_optimizer
  step: jax.Array  # [] int32 optimizer steps taken


def init_state(params: Params, tx: optax.GradientTransformation, shardings=None
               ) -> DrafterState:
  """A fresh state; `shardings`: a DrafterState-shaped tree of shardings (else params' own
  devices and a replicated step)."""
  def init(p):
    return DrafterState(p, tx.init(p), jnp.zeros((), jnp.int32))
  return jax.jit(init, out_shardings=shardings)(params)


def state_shardings(params: Params, tx: optax.GradientTransformation, mesh) -> DrafterState:
  """Shardings of a DrafterState on `mesh`: params and Adam moments by the partition rules
  (they match "mu/fc" as they match "fc"), scalars replicated."""
  from tlt_jax.sharding import tree_shardings
  abstract = jax.eval_shape(
      lambda p: DrafterState(p, tx.init(p), jnp.zeros((), jnp.int32)), params)
  return tree_shardings(abstract, mesh)


_STEPS: dict = {}  # make_train_step's jitted steps, by what they are a function of


def make_train_step(cfg: ModelConfig, tx: optax.GradientTransformation,
                    loss_cfg: LossConfig = LossConfig(), *, donate: bool = True,
                    state_shardings: DrafterState | None = None):
  """-> jitted step(state, target_params, batch) -> (state, metrics). batch: the packed
  layout of tlt_jax/drafter/packing.py (tokens, hidden, positions, segment_ids, loss_mask).
  donate=False keeps the input state alive (a caller that may drop an in-flight step).
  state_shardings (`state_shardings(...)` on one mesh): the new state keeps exactly that
  layout (left to XLA, a tensor-parallel step may return another, and the next call of an
  executable compiled for the first would be refused). The same arguments (`tx` the same
  object: optim.make_optimizer returns one per hyperparameter set) return the same jitted
  step, so a process's later runs reuse what it traced and compiled."""
  key = (cfg, tx, loss_cfg, donate, jax.tree.structure(state_shardings),
         tuple(jax.tree.leaves(state_shardings)))
  if key not in _STEPS:
    _STEPS[key] = _make_train_step(cfg, tx, loss_cfg, donate, state_shardings)
    _PROGRAMS[_STEPS[key]] = ("drafter_step", cfg, tx, loss_cfg, donate)
  return _STEPS[key]


# make_train_step's jitted steps -> what each is a function of besides its arguments (their
# shardings' devices not included: the same program on every worker's devices)
_PROGRAMS: dict = {}


def program_of(step_fn) -> tuple | None:
  """The device-free identity of a `make_train_step` step (None for another function): the
  workers' steps are one program, compiled once and loaded onto each worker's devices
  (rollout/executables.compile_shared)."""
  try:
    return _PROGRAMS.get(step_fn)
  except TypeError:  # (unhashable)
    return None


def _make_train_step(cfg, tx, loss_cfg, donate, state_shardings):
  loss = functools.partial(drafter_loss, cfg=cfg, loss_cfg=loss_cfg)

  def step(state: DrafterState, target_params: Params, batch: dict[str, jax.Array]):
    batch = dict(batch, hidden=jax.lax.stop_gradient(batch["hidden"]))
    (_, m), grads = jax.value_and_grad(loss, has_aux=True)(state.params, target_params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    gnorm = optax.tree.norm(grads)  # (not finite: no step taken, optim.if_finite)
    new = if_finite(jnp.isfinite(gnorm), DrafterState(params, opt_state, state.step + 1), state)
    return new, dict(m, grad_norm=gnorm)

  out = None
  if state_shardings is not None:
    from jax.sharding import NamedSharding, PartitionSpec
    mesh = jax.tree.leaves(state_shardings)[0].mesh
    out = (state_shardings, NamedSharding(mesh, PartitionSpec()))
  return jax.jit(step, donate_argnums=(0,) if donate else (), out_shardings=out)
