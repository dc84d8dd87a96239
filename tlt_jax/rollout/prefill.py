"""A prefill's host side: its prompts' padded arrays (`prefill_arrays`: a GRPO group's
responses share their prompt's prefill), the rule a prompt must meet (`prompt_problem`), the
call of its executable (`prefill_call`: plain, or warm with the drafter's prefill) that the
engine runs and the compile plan compiles ahead from, and what a new row's prefill leaves to
feed (`to_feed`): a preempted row's tokens so far (it is resumed from them, not decoded again)
and an adopted row's prompt past the pages it shares with a sibling, fed a prefill's width at
a time (`resume_chunks`, `decode.extend`)."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models import ModelConfig
from tlt_jax.rollout import decode
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.records import Request
from tlt_jax.rollout.scheduler import kv_bucket


def prompt_len(reqs: Sequence[Request], ecfg: EngineConfig) -> int:
  """The padded length of these prompts' prefill: a multiple of prompt_bucket."""
  longest = max(len(r.prompt_ids) for r in reqs)
  return min(-(-longest // ecfg.prompt_bucket) * ecfg.prompt_bucket, ecfg.max_prompt_len)


def prefill_rows(reqs: Sequence[Request], batch: int, ecfg: EngineConfig) -> int:
  """The rows a prefill of `reqs` at `batch` rows computes: each distinct prompt once (a GRPO
  group's responses share their prompt) when that makes a smaller batch (the bucket of U
  distinct prompts < batch: a "shared" prefill, whose rows also share the prompt's pages,
  pages.share_prompts), else every row."""
  u = ecfg.bucket_for(len({tuple(int(t) for t in r.prompt_ids) for r in reqs}))
  return u if u < batch else batch


def prefill_arrays(reqs: Sequence[Request], batch: int, base_key, ecfg: EngineConfig):
  """A prefill's inputs for `reqs` at `batch` rows: tokens [U, P] right-padded to a multiple
  of prompt_bucket, lens [U], src [batch] (row -> its prompt, `decode.expand_rows`; None when
  row i is prompt i), keys [batch, 2] (each row's own stream: (request_id, sample_index)
  folded into the call's key), max_new [batch]. A group's responses share their prompt: each
  distinct prompt is prefilled once (U rows) when that makes a smaller batch."""
  p = prompt_len(reqs, ecfg)
  keys = np.zeros((batch, 2), np.uint32)
  max_new = np.zeros((batch,), np.int32)
  src = np.full((batch,), -1, np.int32)  # row -> its distinct prompt
  distinct: dict[tuple[int, ...], int] = {}
  for i, r in enumerate(reqs):
    src[i] = distinct.setdefault(tuple(int(t) for t in r.prompt_ids), len(distinct))
    k = jax.random.fold_in(jax.random.fold_in(base_key, r.request_id), r.sample_index)
    keys[i] = np.asarray(jax.random.key_data(k))
    max_new[i] = min(r.max_new_tokens or ecfg.max_new_tokens, ecfg.max_new_tokens)
  rows = prefill_rows(reqs, batch, ecfg)
  shared = rows < batch
  tokens = np.zeros((rows, p), np.int32)
  lens = np.zeros((rows,), np.int32)
  for ids, j in distinct.items() if shared else ((r.prompt_ids, i) for i, r in
                                                 enumerate(reqs)):
    tokens[j, :len(ids)] = ids
    lens[j] = len(ids)
  return (jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(src) if shared else None,
          jnp.asarray(keys), jnp.asarray(max_new))


def to_feed(reqs: Sequence[Request], outputs, starts: Sequence[int] | None = None
            ) -> tuple[list[np.ndarray], list[int]]:
  """What each new row's cache lacks of its text after its prefill, fed by `resume_chunks`:
  the prompt past `starts[i]` (an adopted row's shared slots; None: every prompt prefilled)
  and the response tokens a preempted request had decoded (`outputs`: the call's request key
  -> Output, kept through a preemption). Returns (tokens, how many of them are prompt)."""
  texts, prompt = [], []
  for i, r in enumerate(reqs):
    tail = [] if starts is None else list(r.prompt_ids[starts[i]:])
    o = outputs.get(r.key)
    done = [np.concatenate(o.tokens)] if o is not None and o.length else []
    texts.append(np.concatenate([np.asarray(tail, np.int32)] + done).astype(np.int32))
    prompt.append(len(tail))
  return texts, prompt


def resume_chunks(texts: Sequence[np.ndarray], prompt: Sequence[int], batch: int,
                  ecfg: EngineConfig):
  """(tokens [batch, width], counts [batch], generated [batch]) of each forward that feeds
  these rows their text (`to_feed`: tokens, the first prompt[i] of row i prompt, the rest
  response; rows past them: none), in order: a prefill's width (max_prompt_len) at a time, so
  its activations are a prefill's; the last forward only as wide as the `length_grid` length
  (prompt_bucket x 2^k) that holds what is left (the preempted rows are the youngest: most
  have a few hundred tokens)."""
  longest = max((len(t) for t in texts), default=0)
  for start in range(0, longest, ecfg.max_prompt_len):
    width = kv_bucket(longest - start, ecfg.prompt_bucket, ecfg.max_prompt_len)
    tokens = np.zeros((batch, width), np.int32)
    counts = np.zeros((batch,), np.int32)
    generated = np.zeros((batch,), np.int32)
    for i, t in enumerate(texts):
      part = t[start:start + width]
      tokens[i, :len(part)] = part
      counts[i] = len(part)
      generated[i] = max(0, start + len(part) - max(start, prompt[i]))
    yield tokens, counts, generated


def prompt_problem(ids: Sequence[int], *, vocab_size: int, max_prompt_len: int) -> str | None:
  """What is wrong with a prompt for an engine (None: nothing). The one owner of the rule:
  the engine names the request, the generate CLI the prompt file's line."""
  if len(ids) == 0:
    return "empty prompt"
  if len(ids) > max_prompt_len:
    return (f"prompt has {len(ids)} tokens, more than max_prompt_len={max_prompt_len}; raise "
            "max_prompt_len or filter long prompts")
  bad = [t for t in ids if not 0 <= int(t) < vocab_size]
  if bad:
    return f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
  return None


def prefill_call(cfg: ModelConfig, hidden: bool, params, cache, tokens, lens, src, keys,
                 max_new) -> tuple:
  """(name, variant, fn, args, donate) of a prefill (concrete or abstract args): one row per
  prompt, or "shared" (src: row -> its prompt, each distinct prompt prefilled once); with
  `hidden` (a speculating engine's, tracked call or not: one executable) it also returns the
  prompts' hidden states [U, P, D] for `track_prompt_call`."""
  if src is None:
    fn = decode.prefill_with_hidden if hidden else decode.prefill
    args = (params, cache, tokens, lens, keys, max_new)
  else:
    fn = decode.prefill_shared_with_hidden if hidden else decode.prefill_shared
    args = (params, cache, tokens, lens, src, keys, max_new)
  # (an engine's prefills all return the hidden states or none do: one key per shape)
  return ("prefill", "shared" if src is not None else None, functools.partial(fn, cfg=cfg),
          args, (1,))


def track_prompt_call(cfg: ModelConfig, max_steps: int, params, dparams, base, dkv, tokens,
                      hidden, lens, src) -> tuple:
  """(name, variant, fn, args, donate) of a tracked call's drafter prefill after the target's
  (`spec_state.track_prompt`: a drafter-only executable; its catch-up room `max_steps`)."""
  from tlt_jax.rollout import spec_state
  fn = functools.partial(spec_state.track_prompt, cfg=cfg, max_steps=max_steps)
  return ("track_prompt", "shared" if src is not None else None, fn,
          (params, dparams, base, dkv, tokens, hidden, lens, src), (2, 3))


def run_prefill(run, cfg: ModelConfig, hidden: bool, max_steps: int, params, dparams, cache, dkv,
                tokens, lens, src, keys, max_new):
  """A prefill through `run(name, variant, fn, args, donate)` (the engine's device call, or
  the compile plan's abstract evaluation): the target's (`prefill_call`; `hidden`: a
  speculating engine's, which returns the prompts' hidden states) and, with the drafter's
  pools `dkv` (a tracked call's), the drafter's over the prompts after it."""
  state = run(*prefill_call(cfg, hidden, params, cache, tokens, lens, src, keys, max_new))
  if not hidden:
    return state
  state, prompt_hidden = state
  if dkv is None:
    return state
  return run(*track_prompt_call(cfg, max_steps, params, dparams, state, dkv, tokens,
                                prompt_hidden, lens, src))
