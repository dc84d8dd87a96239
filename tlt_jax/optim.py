"""The one optimizer factory: the GRPO learner (tlt_jax/rl/grpo.py) and the drafter
(tlt_jax/drafter/train_step.py, online and offline) both build theirs here.

AdamW behind a global-norm clip, with a linear warm-up from 0 to `lr` over `warmup_steps`
optimizer steps, then constant (RL: the policy keeps moving) or a cosine decay to lr/10 by
`total_steps` (a fixed data set). optax counts steps from 0, so with a warm-up the first step
runs at lr 0 (warm-up is meant to start there); with warmup_steps=0 the first step runs at the
full lr: a warm-up of 0 steps is no warm-up, not one step at lr 0.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax

from tlt_jax.errors import ConfigError, check

SCHEDULES = ("constant", "cosine")


def lr_schedule(lr: float, *, warmup_steps: int = 0, total_steps: int = 0,
                schedule: str = "constant") -> optax.Schedule:
  """step -> learning rate (see the module docstring)."""
  if lr <= 0:
    raise ValueError(f"lr={lr}: must be > 0")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps={warmup_steps}: must be >= 0")
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule={schedule!r}: use 'constant' or 'cosine'")
  w = int(warmup_steps)
  if schedule == "cosine":
    if w == 0:
      return optax.cosine_decay_schedule(lr, max(int(total_steps), 1), alpha=0.1)
    return optax.warmup_cosine_decay_schedule(0.0, lr, w, max(int(total_steps), w + 1),
                                              end_value=lr * 0.1)
  if w == 0:
    return optax.constant_schedule(lr)
  return optax.join_schedules([optax.linear_schedule(0.0, lr, w), optax.constant_schedule(lr)],
                              [w])


def check_config(o) -> None:
  """config.optim's values, each a ConfigError naming its key: AdamW's betas in [0, 1) (at 1 a
  moment never moves; past it, or below 0, the update diverges), a weight decay and a clip
  norm >= 0 (0: none)."""
  check(o.lr > 0, "optim.lr", o.lr, "must be > 0")
  check(o.schedule in SCHEDULES, "optim.schedule", o.schedule,
        "use 'constant' (after warm-up) or 'cosine'")
  check(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
  for k in ("b1", "b2"):
    check(0 <= o[k] < 1, f"optim.{k}", o[k], "must be in [0, 1) (AdamW's moment decay, "
          "e.g. 0.9 for b1, 0.99 or 0.999 for b2)")
  check(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0 (0: none)")
  check(o.grad_clip >= 0, "optim.grad_clip", o.grad_clip,
        "must be >= 0 (the gradients' global-norm bound; 0: no clipping)")


@functools.lru_cache(maxsize=None)
def make_optimizer(lr: float, *, warmup_steps: int = 0, total_steps: int = 0,
                   schedule: str = "constant", weight_decay: float = 0.01, b1: float = 0.9,
                   b2: float = 0.95, grad_clip: float = 1.0) -> optax.GradientTransformation:
  """AdamW on `lr_schedule`, after a global-norm clip (grad_clip > 0). The defaults are the
  reference implementation's drafter recipe; the learner passes config.optim's values.

  One object per hyperparameter set in a process (a transformation is pure functions, no
  state): the jitted steps that take it as a static argument (learner.LearnerSpec, the drafter's
  `make_train_step`) then key equal across runs, and a notebook's or a test file's second run
  traces and compiles none of them again."""
  sched = lr_schedule(lr, warmup_steps=warmup_steps, total_steps=total_steps, schedule=schedule)
  parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
  parts.append(optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay))
  return optax.chain(*parts)


def if_finite(ok: jax.Array, new, old):
  """`new` where `ok` (a scalar: the gradients' global norm is finite), else `old`, leaf by
  leaf: an optimizer step whose gradients hold a NaN or an inf is not taken (params, moments
  and count kept). A select, not a `lax.cond`: no host sync on a GPU, and XLA fuses it into
  the update's elementwise pass over the donated state."""
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


STUCK_STEPS = 3  # steps in a row with no mini-batch stepped before a run stops


class NonFiniteUpdates(ConfigError):
  """Steps in a row whose every mini-batch's gradients were not finite (`stuck`)."""


def stuck(steps: int, grad_norm: float, step: int, cfg) -> int:
  """Steps in a row, to `step`, whose every mini-batch took no step (`grad_norm`, the update's
  metric, not finite: `if_finite` kept the state), given `steps` before it;
  NonFiniteUpdates once they are STUCK_STEPS (cfg: the run's config, for the fix)."""
  steps = steps + 1 if not math.isfinite(grad_norm) else 0
  if steps == STUCK_STEPS:
    raise NonFiniteUpdates(
        f"the learner's gradients held a NaN or an inf in every mini-batch of steps "
        f"{step - steps + 1}-{step}, which took no optimizer step: lower optim.lr (now "
        f"{cfg.optim.lr}), check the rewards, or compute in float32 (model.dtype, now "
        f"{cfg.model.dtype})")
  return steps
