"""Does tlt_jax compute the same logits as Hugging Face transformers for a checkpoint?

`check_parity` runs one random token batch through transformers (PyTorch, CPU, eval mode) and
through tlt_jax (`load_hf_model` + `forward`), and, with ragged=True, a right-padded ragged
version of the same batch through tlt_jax's KV-cache path (prefill with a different committed
length per row, then one decode step per row), which must reproduce transformers' logits at
every real position. scripts/check_hf_parity.py prints its report.

The error metric is  max|ours - hf| / max(1, max|hf|): absolute for small logits, relative to
the logit scale for large ones (real checkpoints have logits of 10-40, tiny random ones ~1).
Non-finite logits fail even where both sides agree on them (a plain `diff > tol` would pass
NaN).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

# Default tolerances on the metric above.
#  float32:  both sides compute in float32 (matmul precision forced to "highest" on the JAX
#            side); what is left is summation-order noise, ~1e-7 relative per op, which grows
#            with depth to ~1e-6..1e-5 of the logit scale on real models. 1e-4 is far above
#            that noise and far below any mapping bug (a wrong bias, norm or rope shows up as
#            O(1e-2..1) differences).
#  bfloat16: both sides round activations to bfloat16 (8-bit mantissa, unit roundoff 2^-8 ~
#            4e-3) but at different points (XLA fuses rmsnorm/rope/softmax and keeps float32
#            intermediates where PyTorch rounds between ops), so one-ulp differences appear
#            everywhere and compound through the residual stream layer after layer. A 2-3
#            layer toy model already shows ~1.5e-2 of the logit scale (a few ulps of the
#            largest logit); deep real models show several times that. 1e-1 leaves room for
#            depth while a mapping bug (wrong/missing bias, norm, rope, head order) is still
#            O(1) of the logit scale. bfloat16 is a smoke test of the bf16 path: run float32
#            for the tight conversion check.
DEFAULT_TOL = {"float32": 1e-4, "bfloat16": 1e-1}




class UnloadableCheckpoint(ValueError):
  """The directory is missing, is no Hugging Face model, or tlt_jax cannot load it."""


class Check(NamedTuple):
  name: str
  finite: tuple[bool, bool]  # (tlt_jax's logits all finite, transformers')
  diff: float  # max|ours - hf| (nan when not finite)
  scale: float  # max|hf|
  rel: float  # diff / max(1, scale): the metric held against tol
  ok: bool


class Report(NamedTuple):
  cfg: object  # the checkpoint's ModelConfig
  tol: float
  checks: list[Check]
  ragged_lengths: list[int] | None  # [batch] committed tokens per row of the ragged check
  greedy: tuple[list[int], list[int], float] | None  # last-position argmax (ours, hf) and the
  #                                                   share of positions whose argmax agrees

  @property
  def failures(self) -> list[str]:
    return [c.name for c in self.checks if not c.ok]


def _check(name: str, ours: np.ndarray, ref: np.ndarray, tol: float) -> Check:
  finite = (bool(np.all(np.isfinite(ours))), bool(np.all(np.isfinite(ref))))
  if not all(finite):
    return Check(name, finite, float("nan"), float("nan"), float("nan"), False)
  diff = float(np.max(np.abs(ours - ref)))
  scale = float(np.max(np.abs(ref)))
  rel = diff / max(1.0, scale)
  return Check(name, finite, diff, scale, rel, rel <= tol)


def check_parity(model: str, *, dtype: str = "float32", batch: int = 2, seq: int = 32,
                 seed: int = 0, tol: float | None = None, ragged: bool = True) -> Report:
  """The parity report of the checkpoint in `model` (module docstring); UnloadableCheckpoint
  before torch is imported when tlt_jax cannot load it."""
  if not os.path.isdir(model):
    raise UnloadableCheckpoint(f"model directory {model!r} does not exist")
  if not os.path.exists(os.path.join(model, "config.json")):
    raise UnloadableCheckpoint(f"{model!r} has no config.json (not a Hugging Face model "
                               "directory)")
  tol = DEFAULT_TOL[dtype] if tol is None else tol

  import jax
  import jax.numpy as jnp

  from tlt_jax.models import forward, init_cache
  from tlt_jax.models.hf_io import load_hf_model

  if dtype == "float32":
    # Without this, XLA on GPU/TPU (and some CPU builds) run float32 matmuls in reduced
    # precision (tf32 / bf16 passes), which alone exceeds the float32 tolerance.
    jax.config.update("jax_default_matmul_precision", "highest")

  try:
    cfg, params = load_hf_model(model, dtype=dtype, param_dtype=dtype)
  except ValueError as e:  # CheckpointFormatError is a ValueError
    raise UnloadableCheckpoint(f"tlt_jax cannot load {model}: {e}") from None

  # Imported only now: torch + transformers take seconds, a bad checkpoint fails before that.
  import torch
  from transformers import AutoModelForCausalLM

  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()

  b, t = batch, seq
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, size=(b, t), dtype=np.int64)
  with torch.no_grad():
    ref = hf(torch.from_numpy(tokens)).logits.float().numpy()

  fwd = jax.jit(forward, static_argnames=("cfg",))
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  ours = np.asarray(fwd(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions),
                        cfg=cfg).logits)
  checks = [_check("full batch", ours, ref, tol)]
  lengths = None
  if ragged:
    # Right-padded rows of different lengths: row r keeps lengths[r] real tokens followed by
    # padding. Causality makes HF's full-batch logits at real positions the reference.
    lengths = np.array([t - 1 - (r * (t // 2)) // max(1, b - 1) for r in range(b)], np.int32)
    lengths = np.clip(lengths, 1, t - 1)
    padded = np.where(np.arange(t)[None, :] < lengths[:, None], tokens, 0).astype(np.int32)
    cache = init_cache(cfg, b, t)
    out = fwd(params, jnp.asarray(padded), jnp.asarray(positions), cfg=cfg, cache=cache)
    pre = np.asarray(out.logits)
    valid = np.arange(t)[None, :] < lengths[:, None]
    checks.append(_check("ragged prefill (cache)", pre[valid], ref[valid], tol))
    # Commit each row's real tokens only, then decode the next real token of every row: it
    # lands at a different cache slot per row and overwrites that row's padding.
    cache = out.cache.replace(lengths=jnp.asarray(lengths))
    nxt = tokens[np.arange(b), lengths][:, None].astype(np.int32)
    dec = fwd(params, jnp.asarray(nxt), jnp.asarray(lengths[:, None]), cfg=cfg, cache=cache)
    checks.append(_check("ragged decode step (cache)", np.asarray(dec.logits)[:, 0],
                         ref[np.arange(b), lengths], tol))
    lengths = lengths.tolist()

  greedy = None
  if np.all(np.isfinite(ours)) and np.all(np.isfinite(ref)):
    greedy = (ours[:, -1].argmax(-1).tolist(), ref[:, -1].argmax(-1).tolist(),
              float(np.mean(ours.argmax(-1) == ref.argmax(-1))))
  return Report(cfg, tol, checks, lengths, greedy)
