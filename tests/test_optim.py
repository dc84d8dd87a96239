"""The one optimizer factory (tlt_jax/optim.py), against hand-computed learning rates: the
warm-up starts at 0 and reaches lr, a warm-up of 0 steps is none (the first step runs at the
full lr: the learner once ran it at 0), and the cosine decay ends at lr/10."""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tlt_jax.optim import lr_schedule, make_optimizer

LR = 1e-3


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_no_warmup_starts_at_the_full_lr(schedule):
  sched = lr_schedule(LR, warmup_steps=0, total_steps=10, schedule=schedule)
  assert float(sched(0)) == pytest.approx(LR)
  assert float(sched(1)) == pytest.approx(LR if schedule == "constant"
                                          else LR * (0.1 + 0.45 * (1 + math.cos(math.pi / 10))))


def test_linear_warmup_then_constant():
  """The default learner's schedule (warmup_steps=4): 0, lr/4, lr/2, 3lr/4, then lr."""
  sched = lr_schedule(LR, warmup_steps=4)
  np.testing.assert_allclose([float(sched(s)) for s in range(7)],
                             [0, LR / 4, LR / 2, 3 * LR / 4, LR, LR, LR], rtol=1e-6)


def test_warmup_then_cosine_to_a_tenth():
  """Warm-up over 2 steps, cosine over the remaining 8 of 10: half-way down at step 6."""
  sched = lr_schedule(LR, warmup_steps=2, total_steps=10, schedule="cosine")
  np.testing.assert_allclose([float(sched(s)) for s in (0, 1, 2, 6, 10, 20)],
                             [0, LR / 2, LR, 0.55 * LR, 0.1 * LR, 0.1 * LR], rtol=1e-6)
  cos0 = lr_schedule(LR, warmup_steps=0, total_steps=10, schedule="cosine")
  np.testing.assert_allclose([float(cos0(s)) for s in (0, 5, 10)],
                             [LR, 0.55 * LR, 0.1 * LR], rtol=1e-6)


@pytest.mark.parametrize("warmup", [0, 3])
def test_the_optimizer_steps_at_the_scheduled_lr(warmup):
  """AdamW without decay or clipping, constant gradient: |m_hat / sqrt(v_hat)| = 1, so each
  step moves a parameter by exactly that step's lr."""
  tx = make_optimizer(LR, warmup_steps=warmup, weight_decay=0.0, grad_clip=0.0)
  p = {"w": jnp.ones((3,))}
  g = {"w": jnp.asarray([0.5, -2.0, 3.0])}
  opt = tx.init(p)
  moved = []
  for _ in range(5):
    upd, opt = tx.update(g, opt, p)
    p = optax.apply_updates(p, upd)
    moved.append(np.asarray(upd["w"]))
  want = [min(s / warmup, 1.0) * LR if warmup else LR for s in range(5)]
  for step, (u, lr) in enumerate(zip(moved, want)):
    np.testing.assert_allclose(u, -lr * np.sign(np.asarray(g["w"])), rtol=1e-5, atol=1e-12,
                               err_msg=f"step {step}")


@pytest.mark.parametrize("kw,match", [
    (dict(lr=0.0), "lr=0.0"),
    (dict(lr=LR, warmup_steps=-1), "warmup_steps=-1"),
    (dict(lr=LR, schedule="linear"), "schedule='linear'"),
])
def test_bad_values_are_named(kw, match):
  with pytest.raises(ValueError, match=match):
    make_optimizer(**kw)


def test_clipped_adamw_matches_a_float64_numpy_reference():
  """Several steps of varying gradients, every knob off its default (b1, b2, weight decay, a
  clip that binds on some steps and not others) against AdamW written out in float64: clip
  by the global norm over all leaves, Adam's bias-corrected moments, decoupled weight decay,
  all times the scheduled lr."""
  lr, warmup, b1, b2, wd, clip, eps = 1e-2, 2, 0.8, 0.9, 0.1, 1.0, 1e-8
  tx = make_optimizer(lr, warmup_steps=warmup, b1=b1, b2=b2, weight_decay=wd, grad_clip=clip)
  rng = np.random.default_rng(0)
  p = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=(2,))}
  grads = [{k: rng.normal(size=v.shape) * scale for k, v in p.items()}
           for scale in (3.0, 0.1, 2.0, 0.05, 1.0)]  # global norms above and below the clip
  params = {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}
  opt = tx.init(params)
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v2 = {k: np.zeros_like(v) for k, v in p.items()}
  for t, g in enumerate(grads):
    upd, opt = tx.update({k: jnp.asarray(x, jnp.float32) for k, x in g.items()}, opt, params)
    params = optax.apply_updates(params, upd)
    norm = np.sqrt(sum((x ** 2).sum() for x in g.values()))
    scale = min(1.0, clip / norm)
    lr_t = lr * min(t / warmup, 1.0)
    for k in p:
      gk = g[k] * scale
      m[k] = b1 * m[k] + (1 - b1) * gk
      v2[k] = b2 * v2[k] + (1 - b2) * gk ** 2
      m_hat, v_hat = m[k] / (1 - b1 ** (t + 1)), v2[k] / (1 - b2 ** (t + 1))
      p[k] = p[k] - lr_t * (m_hat / (np.sqrt(v_hat) + eps) + wd * p[k])
      np.testing.assert_allclose(np.asarray(params[k]), p[k], rtol=2e-5, atol=1e-6,
                                 err_msg=f"{k} after step {t}")
