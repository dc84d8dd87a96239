#!/usr/bin/env python
"""Checks that tlt_jax computes the same logits as Hugging Face transformers for a checkpoint.

  python scripts/check_hf_parity.py --model /path/to/hf_dir [--dtype float32|bfloat16]
      [--batch 2 --seq 32 --seed 0 --tol X] [--no-ragged]

Runs one random token batch through transformers (PyTorch, CPU, eval mode) and through
tlt_jax (`load_hf_model` + `forward`), and, unless --no-ragged, a right-padded ragged version
of the same batch through tlt_jax's KV-cache path (prefill with a different committed length
per row, then one decode step per row), which must reproduce transformers' logits at every
real position. Prints the max abs logit difference, the same relative to the logit scale, and
whether greedy next tokens agree.

The error metric is  max|ours - hf| / max(1, max|hf|): absolute for small logits, relative to
the logit scale for large ones (real checkpoints have logits of 10-40, tiny random ones ~1).

Exit status: 0 parity holds; 1 parity fails (difference above --tol, or non-finite logits);
2 the checkpoint cannot be loaded (missing directory, unsupported or inconsistent checkpoint).
"""

from __future__ import annotations

import argparse
import os
import sys

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


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", required=True, help="local Hugging Face model directory")
  p.add_argument("--dtype", default="float32", choices=sorted(DEFAULT_TOL),
                 help="param and compute dtype on both sides (default float32)")
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq", type=int, default=32)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--tol", type=float, default=None,
                 help="max allowed max|diff| / max(1, max|hf logit|) "
                      f"(default: {DEFAULT_TOL})")
  p.add_argument("--no-ragged", action="store_true",
                 help="skip the right-padded KV-cache check")
  args = p.parse_args(argv)
  if args.batch < 1 or args.seq < 2:
    p.error("--batch must be >= 1 and --seq >= 2")
  if args.tol is None:
    args.tol = DEFAULT_TOL[args.dtype]
  return args


def _err(ours, ref):
  import numpy as np
  diff = float(np.max(np.abs(ours - ref)))
  scale = float(np.max(np.abs(ref)))
  return diff, scale, diff / max(1.0, scale)


def main(argv=None) -> int:
  args = parse_args(argv)
  if not os.path.isdir(args.model):
    print(f"error: model directory {args.model!r} does not exist", file=sys.stderr)
    return 2
  if not os.path.exists(os.path.join(args.model, "config.json")):
    print(f"error: {args.model!r} has no config.json (not a Hugging Face model directory)",
          file=sys.stderr)
    return 2

  import jax
  import jax.numpy as jnp
  import numpy as np

  from tlt_jax.models import forward, init_cache
  from tlt_jax.models.hf_io import load_hf_model

  if args.dtype == "float32":
    # Without this, XLA on GPU/TPU (and some CPU builds) run float32 matmuls in reduced
    # precision (tf32 / bf16 passes), which alone exceeds the float32 tolerance.
    jax.config.update("jax_default_matmul_precision", "highest")

  try:
    cfg, params = load_hf_model(args.model, dtype=args.dtype, param_dtype=args.dtype)
  except ValueError as e:  # CheckpointFormatError is a ValueError
    print(f"error: tlt_jax cannot load {args.model}: {e}", file=sys.stderr)
    return 2
  print(f"model: {args.model}\n  {cfg.arch}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"heads {cfg.num_heads}/{cfg.num_kv_heads} (q/kv), head_dim {cfg.head_dim_}, "
        f"vocab {cfg.vocab_size}, tied={cfg.tie_word_embeddings}, "
        f"rope_scaling={'llama3' if cfg.rope_scaling else None}, dtype {args.dtype}")

  # Imported only now: torch + transformers take seconds, a bad checkpoint fails before that.
  import torch
  from transformers import AutoModelForCausalLM

  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
  hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch_dtype).eval()

  b, t = args.batch, args.seq
  rng = np.random.default_rng(args.seed)
  tokens = rng.integers(0, cfg.vocab_size, size=(b, t), dtype=np.int64)
  with torch.no_grad():
    ref = hf(torch.from_numpy(tokens)).logits.float().numpy()

  fwd = jax.jit(forward, static_argnames=("cfg",))
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  ours = np.asarray(fwd(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions),
                        cfg=cfg).logits)

  failures = []
  checks = []  # (name, ours, ref)
  checks.append(("full batch", ours, ref))

  if not args.no_ragged:
    # Right-padded rows of different lengths: row r keeps lengths[r] real tokens followed by
    # padding. Causality makes HF's full-batch logits at real positions the reference.
    lengths = np.array([t - 1 - (r * (t // 2)) // max(1, b - 1) for r in range(b)], np.int32)
    lengths = np.clip(lengths, 1, t - 1)
    padded = np.where(np.arange(t)[None, :] < lengths[:, None], tokens, 0).astype(np.int32)
    cache = init_cache(cfg, b, t)
    out = fwd(params, jnp.asarray(padded), jnp.asarray(positions), cfg=cfg, cache=cache)
    pre = np.asarray(out.logits)
    valid = np.arange(t)[None, :] < lengths[:, None]
    checks.append(("ragged prefill (cache)", pre[valid], ref[valid]))
    # Commit each row's real tokens only, then decode the next real token of every row: it
    # lands at a different cache slot per row and overwrites that row's padding.
    cache = out.cache.replace(lengths=jnp.asarray(lengths))
    nxt = tokens[np.arange(b), lengths][:, None].astype(np.int32)
    dec = fwd(params, jnp.asarray(nxt), jnp.asarray(lengths[:, None]), cfg=cfg, cache=cache)
    checks.append(("ragged decode step (cache)", np.asarray(dec.logits)[:, 0],
                   ref[np.arange(b), lengths]))
    print(f"  ragged row lengths: {lengths.tolist()}")

  for name, o, r in checks:
    if not (np.all(np.isfinite(o)) and np.all(np.isfinite(r))):
      print(f"{name:28s} NON-FINITE logits (tlt_jax finite: {bool(np.all(np.isfinite(o)))}, "
            f"transformers finite: {bool(np.all(np.isfinite(r)))})")
      failures.append(name)
      continue
    diff, scale, rel = _err(o, r)
    ok = rel <= args.tol
    print(f"{name:28s} max|diff| {diff:.3e}   logit scale {scale:.3e}   "
          f"max|diff|/max(1,scale) {rel:.3e}   {'ok' if ok else 'FAIL'} (tol {args.tol:g})")
    if not ok:
      failures.append(name)

  if np.all(np.isfinite(ours)) and np.all(np.isfinite(ref)):
    greedy_ours, greedy_ref = ours[:, -1].argmax(-1), ref[:, -1].argmax(-1)
    agree_all = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
    rows = int(np.sum(greedy_ours == greedy_ref))
    print(f"greedy next tokens: {'agree' if rows == b else 'DISAGREE'} ({rows}/{b} rows; "
          f"argmax agrees at {agree_all:.1%} of all positions)  "
          f"tlt_jax {greedy_ours.tolist()} transformers {greedy_ref.tolist()}")

  if failures:
    print(f"PARITY FAILED: {', '.join(failures)}")
    return 1
  print("PARITY OK")
  return 0


if __name__ == "__main__":
  sys.exit(main())
