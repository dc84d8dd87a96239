"""A history arm's chunk (strategy.py: "hist_<K>", "histtree_<K>_<topk>_<N>", "hyb_<K>").

A drafter arm's chunk is one jitted loop on the device; a history arm cannot be: its drafts
come from the host's history index (history.py), and a step's draft needs the tokens the
step before it emitted. So its chunk is a host loop of single jitted steps
(`speculative.history_step`), each with a host sync: the index drafts every live row from
everything emitted so far, one step verifies, its tokens extend the index.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from tlt_jax.models import Params
from tlt_jax.rollout import decode
from tlt_jax.rollout.policies.strategy import Strategy


def history_chunk(exe, params: Params, drafter_params: Params, state, strategy: Strategy,
                  index, rows: dict[int, Any], chunk_size: int, sharding: Sharding):
  """Up to `chunk_size` steps of `exe` (the arm's compiled step on the SpecState `state`) for
  the live `rows` (slot -> the request's key in `index`), until every one is done. The drafts
  go to the device on `sharding`. Returns (state, host copies of (ChunkOutput, done [B],
  stopped [B], [accepted drafts, verifications])) as `Engine._decode` does, the steps'
  outputs side by side."""
  b, n = state.batch_size, strategy.verify_tokens - 1
  rows = dict(rows)
  outs, counts = [], np.zeros((2,), np.int64)
  put = lambda x: jax.device_put(x, sharding)
  for _ in range(chunk_size):
    tokens, parents = np.zeros((b, n), np.int32), np.full((b, n), -2, np.int32)
    for s, key in rows.items():
      # a hybrid asks for the index's chain (the step adds the drafter's)
      d = (index.draft(key, strategy.steps) if strategy.hybrid else
           index.draft(key, strategy.steps, topk=strategy.topk, max_nodes=n))
      m = min(len(d.tokens), n)  # a prefix of a topological order keeps every parent
      tokens[s, :m], parents[s, :m] = d.tokens[:m], d.parents[:m]
    state, out, acc = exe(params, drafter_params, state, put(tokens), put(parents))
    base = state.base
    out, done, stopped, acc = jax.device_get((out, base.done, base.stopped, acc))
    outs.append(out)
    counts += acc
    for s, key in list(rows.items()):
      index.extend(key, out.tokens[s][out.valid[s]])
      if done[s]:
        del rows[s]
    if not rows:
      break
  cat = lambda *xs: None if xs[0] is None else np.concatenate(xs, axis=1)
  out = decode.ChunkOutput(tokens=cat(*(o.tokens for o in outs)),
                           logprobs=cat(*(o.logprobs for o in outs)),
                           hidden=cat(*(o.hidden for o in outs)),
                           valid=cat(*(o.valid for o in outs)), steps=len(outs))
  return state, (out, done, stopped, counts)
