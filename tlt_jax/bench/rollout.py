"""The Hugging Face peers of the rollout benchmarks (scripts/bench_rollout.py,
scripts/bench_regime.py): batched `generate`, assisted generation with an assistant cut from
the target, and a best-of timer. torch and transformers are imported inside, on first use.
"""

from __future__ import annotations

import time

import numpy as np


def hf_generate(model, prompts, new_tokens, *, sample, eos, pad_id, seed=0):
  """Left-padded batched HF generate; returns useful tokens (up to and incl. EOS)."""
  import torch
  torch.manual_seed(seed)
  width = max(len(p) for p in prompts)
  ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
  mask = torch.zeros_like(ids)
  for i, p in enumerate(prompts):
    ids[i, width - len(p):] = torch.tensor(p)
    mask[i, width - len(p):] = 1
  kw = dict(max_new_tokens=new_tokens, do_sample=sample, pad_token_id=pad_id,
            eos_token_id=eos, attention_mask=mask)
  if sample:
    kw.update(temperature=1.0, top_k=0, top_p=1.0)
  else:
    kw.update(min_new_tokens=new_tokens if eos is None else 0)
  with torch.no_grad():
    out = model.generate(ids, **kw)[:, width:].numpy()
  tokens = 0
  for row in out:
    n = len(row)
    if eos is not None:
      hits = np.nonzero(np.isin(row, eos))[0]
      n = hits[0] + 1 if len(hits) else n
    tokens += n
  return tokens


def hf_assisted(model, assistant, prompts, new_tokens, *, sample, eos, pad_id, seed=0):
  """HF assisted generation (speculative, batch 1): one prompt at a time. Returns useful tokens
  (up to and incl. EOS) and HF's acceptance length (tokens per target forward)."""
  import torch
  tokens, target_calls = 0, 0
  for i, p in enumerate(prompts):
    torch.manual_seed(seed + i)
    ids = torch.tensor([p])
    kw = dict(max_new_tokens=new_tokens, do_sample=sample, pad_token_id=pad_id,
              eos_token_id=eos, attention_mask=torch.ones_like(ids), assistant_model=assistant)
    if sample:
      kw.update(temperature=1.0, top_k=0, top_p=1.0)
    else:
      kw.update(min_new_tokens=new_tokens if eos is None else 0)
    calls = [0]
    hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
      with torch.no_grad():
        row = model.generate(ids, **kw)[0, len(p):].numpy()
    finally:
      hook.remove()
    n = len(row)
    if eos is not None:
      hits = np.nonzero(np.isin(row, eos))[0]
      n = hits[0] + 1 if len(hits) else n
    tokens += n
    target_calls += calls[0]
  return tokens, tokens / max(target_calls, 1)


def first_layer_assistant(params, cfg, model_dir, out_dir):
  """The target cut to its first decoder layer (its embedding, final norm and LM head, layer
  0), written to out_dir as an HF checkpoint and loaded with transformers: HF's assistant must
  be a standalone causal LM and our drafter is EAGLE-style (it reads the target's hidden
  states), so this is the strongest assistant derivable from the target without training."""
  import jax
  import torch
  import transformers
  from tlt_jax.models.hf_io import save_hf_model
  one = cfg.replace(num_layers=1)
  p1 = dict(params, layers=jax.tree.map(lambda a: a[:1], params["layers"]))
  save_hf_model(p1, one, out_dir, tokenizer_dir=model_dir)
  return transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()


def timed(fn, repeats=1):
  """(fn()'s output, seconds) of the fastest of `repeats` calls: best-of filters the load of
  other processes on a shared machine."""
  best = None
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    best = (out, dt) if best is None or dt < best[1] else best
  return best
