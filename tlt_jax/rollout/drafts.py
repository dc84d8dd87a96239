"""The draft sources of speculative decoding, as arrays a verification step takes: the
drafter's chain (`draft_chain`, sampled or greedy) and EAGLE-2 tree (`draft_tree`), a host
index's padded draft as a tree (`external_tree`: the history arms), and the hybrid's merge of
the index's chain with the drafter's (`hybrid_draft`). speculative.py verifies and commits
them; a `Tree` is what a verification reads of any of them."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tlt_jax.drafter.model import drafter_forward, drafter_tree_forward
from tlt_jax.models import KVCache
from tlt_jax.rollout.sampling import processed_logprobs
from tlt_jax.rollout.policies.strategy import Strategy


def draft_chain(dparams, params, dc: KVCache, g, dlogits, keys, *, cfg, sp, steps, kv_len,
                live=None):
  """`steps` drafts, one drafter forward each after the first (the catch-up produced it).
  Greedy drafts are the argmax (no keys, no softmax); sampled drafts are drawn from the
  processed drafter distribution q with keys [B, steps], and q is returned for the
  acceptance test. live [B] bool: the rows still decoding (None: all; the others read no
  page). Returns (drafts [B, steps], q [B, steps, V] | None, drafter cache)."""
  drafts, qs = [], []
  base_len = dc.lengths
  for i in range(steps):
    if sp.greedy:
      d_i = jnp.argmax(dlogits, axis=-1).astype(jnp.int32)
    else:
      q = processed_logprobs(dlogits, sp)
      d_i = jax.vmap(jax.random.categorical)(keys[:, i], q).astype(jnp.int32)
      qs.append(q)
    drafts.append(d_i)
    if i + 1 < steps:
      pos = (base_len + i)[:, None]
      g3, dl3, dc = drafter_forward(dparams, params, d_i[:, None], g[:, None], pos, cfg=cfg,
                                    cache=dc.replace(lengths=base_len + i), kv_len=kv_len,
                                    live=live)
      g, dlogits = g3[:, 0], dl3[:, 0]
  q_all = jnp.stack(qs, axis=1) if qs else None
  return jnp.stack(drafts, axis=1), q_all, dc.replace(lengths=base_len)


class Tree(NamedTuple):
  """A draft tree of N nodes in verification order (node 0 = the root = the pending token;
  every node after its parent)."""

  tokens: jax.Array  # [B, N] int32 (root entry: 0, filled in by the caller)
  depth: jax.Array  # [B, N] int32 (root 0)
  children: jax.Array  # [B, N, topk] int32 node ids, -1 = none, in drafter-score order
  visible: jax.Array  # [B, N, N] bool: node j is an ancestor of node i or i itself


def draft_tree(dparams, params, dc: KVCache, g, dlogits, *, cfg, strategy: Strategy,
                kv_len: int | None):
  """EAGLE-2 dynamic tree. Depth 1: the top-k tokens of the drafter's distribution after the
  root. Each further depth expands the `topk` frontier nodes (the best by cumulative draft
  log-prob) with their top-k children, one drafter forward over the frontier per depth (the
  nodes attend to their own ancestors' drafter k/v: `drafter_tree_forward`). Every expanded
  node is a candidate; the `verify_tokens` best by cumulative score are verified. A child's
  score is its parent's plus a log-prob <= 0 and candidates are laid out after their parents,
  so a stable sort by score puts every node after its ancestors: the pruned tree is closed
  under ancestors, ties included. Drafts are deterministic (top-k, no randomness), as the
  target-only tree rule requires. Returns (Tree, drafter cache with speculative k/v)."""
  k, depth, n_verify = strategy.topk, strategy.steps, strategy.verify_tokens
  b = g.shape[0]
  rows = jnp.arange(b)[:, None]
  base_len = dc.lengths
  r = max(depth - 1, 1) * k  # drafter slots of the expanded (frontier) nodes
  slot_ids = jnp.arange(k)
  lq, tok = jax.lax.top_k(jax.nn.log_softmax(dlogits, axis=-1), k)  # [B, k]
  # Candidate lists (root first): token, cumulative score, parent candidate, sibling rank.
  c_tok, c_score = [jnp.zeros((b, 1), jnp.int32), tok], [jnp.zeros((b, 1)), lq]
  c_parent = [jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, k), jnp.int32)]
  c_rank = [jnp.zeros((b, 1), jnp.int32), jnp.broadcast_to(slot_ids, (b, k))]
  c_depth = [0] + [1] * k
  f_tok, f_score, f_id = tok, lq, jnp.broadcast_to(1 + slot_ids, (b, k))
  f_hid = jnp.broadcast_to(g[:, None], (b, k, g.shape[-1]))
  f_anc = jnp.broadcast_to(jnp.eye(k, r, dtype=jnp.bool_), (b, k, r))  # drafter-slot ancestors
  w = min(kv_len or dc.max_len, dc.max_len)  # the attention window
  rel = jnp.arange(w)[None, None, :] - base_len[:, None, None]  # [B, 1, W]
  for j in range(1, depth):
    slots = base_len[:, None] + (j - 1) * k + slot_ids[None, :]
    pos = jnp.broadcast_to(base_len[:, None] + (j - 1), (b, k))
    anc = jnp.take_along_axis(f_anc, jnp.broadcast_to(jnp.clip(rel, 0, r - 1), (b, k, w)),
                              axis=2)
    visible = (rel < 0) | ((rel < r) & anc)
    gj, lgj, dc = drafter_tree_forward(dparams, params, f_tok, f_hid, pos, slots, visible,
                                       cfg=cfg, cache=dc)
    clq, ctok = jax.lax.top_k(jax.nn.log_softmax(lgj, axis=-1), k)  # [B, k, k]
    cs = (f_score[:, :, None] + clq).reshape(b, k * k)
    offset = sum(x.shape[1] for x in c_tok)
    c_tok.append(ctok.reshape(b, k * k))
    c_score.append(cs)
    c_parent.append(jnp.repeat(f_id, k, axis=1))
    c_rank.append(jnp.tile(slot_ids, (b, k)))
    c_depth += [j + 1] * (k * k)
    if j + 1 < depth:  # the next frontier: the best k children
      f_score, idx = jax.lax.top_k(cs, k)
      par = idx // k
      f_tok = jnp.take_along_axis(ctok.reshape(b, k * k), idx, axis=1)
      f_id = offset + idx
      f_hid = jnp.take_along_axis(gj, par[:, :, None], axis=1)
      f_anc = (jnp.take_along_axis(f_anc, par[:, :, None], axis=1)
               | jax.nn.one_hot(j * k + slot_ids, r, dtype=jnp.bool_)[None])
  c_tok, c_score, c_parent, c_rank = (jnp.concatenate(x, axis=1)
                                      for x in (c_tok, c_score, c_parent, c_rank))
  sel = jnp.argsort(-c_score, axis=1, stable=True)[:, :n_verify]  # [B, N] candidate ids
  inv = jnp.zeros_like(c_tok).at[rows, sel].set(jnp.arange(n_verify, dtype=jnp.int32))
  node = jnp.arange(n_verify)[None, :]
  parent = jnp.where(node > 0, jnp.take_along_axis(
      inv, jnp.take_along_axis(c_parent, sel, axis=1), axis=1), -1)  # [B, N] node ids
  rank = jnp.take_along_axis(c_rank, sel, axis=1)
  children = jnp.full((b, n_verify, k), -1, jnp.int32).at[
      rows, jnp.where(node > 0, parent, n_verify), rank].set(
          jnp.broadcast_to(node, (b, n_verify)).astype(jnp.int32), mode="drop")
  visible = jnp.broadcast_to(jnp.eye(n_verify, dtype=jnp.bool_), (b, n_verify, n_verify))
  cur = parent
  for _ in range(depth):
    visible = visible | jax.nn.one_hot(cur, n_verify, dtype=jnp.bool_)
    cur = jnp.where(cur >= 0, jnp.take_along_axis(parent, jnp.maximum(cur, 0), axis=1), -1)
  tree = Tree(tokens=jnp.take_along_axis(c_tok, sel, axis=1),
              depth=jnp.asarray(c_depth, jnp.int32)[sel], children=children, visible=visible)
  return tree, dc.replace(lengths=base_len)


def external_tree(pending, tokens, parents, use, *, depth: int, topk: int) -> Tree:
  """A padded external draft (the host's history index: tokens [B, N], parents [B, N], -1 =
  child of the root, < -1 = padding, topological order; a chain is parents [-1, 0, 1, ...])
  as a `Tree` of N + 1 nodes with the pending token [B] as root. Rows with use [B] False
  draft nothing. A node is kept only if its parent is, it lies within `depth` and it is one of
  its parent's first `topk` children (so the verified tree is closed under ancestors and has
  the arm's static shape); dropped nodes are unreachable padding (token 0, seen by nothing
  but themselves). Drafts are deterministic: the target-only tree rule is exact for them."""
  b, n = tokens.shape
  rows = jnp.arange(b)
  par = parents.astype(jnp.int32) + 1  # node ids: 0 = root, draft i = node i + 1
  ok = jnp.zeros((b, n + 1), bool).at[:, 0].set(True)
  dep = jnp.zeros((b, n + 1), jnp.int32)
  rank = jnp.zeros((b, n + 1), jnp.int32)
  for i in range(n):  # topological order: a node's parent is settled before it
    p = jnp.clip(par[:, i], 0, n)
    r = jnp.sum(ok[:, 1:i + 1] & (par[:, :i] == par[:, i:i + 1]), axis=1)  # earlier siblings
    d = dep[rows, p] + 1
    keep = (use & (par[:, i] >= 0) & (par[:, i] <= i) & ok[rows, p] & (d <= depth)
            & (r < topk))
    ok, dep, rank = ok.at[:, i + 1].set(keep), dep.at[:, i + 1].set(d), rank.at[:, i + 1].set(r)
  node = jnp.arange(n + 1)[None, :]
  par = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), par], axis=1)
  par = jnp.where(ok & (node > 0), par, -1)  # [B, N+1]
  children = jnp.full((b, n + 1, topk), -1, jnp.int32).at[
      rows[:, None], jnp.where(par >= 0, par, n + 1), jnp.minimum(rank, topk - 1)].set(
          jnp.broadcast_to(node, (b, n + 1)).astype(jnp.int32), mode="drop")
  visible = jnp.broadcast_to(jnp.eye(n + 1, dtype=jnp.bool_), (b, n + 1, n + 1))
  cur = par
  for _ in range(depth):
    visible = visible | jax.nn.one_hot(cur, n + 1, dtype=jnp.bool_)
    cur = jnp.where(cur >= 0, jnp.take_along_axis(par, jnp.maximum(cur, 0), axis=1), -1)
  tok = jnp.concatenate([pending[:, None], jnp.where(ok[:, 1:], tokens, 0)], axis=1)
  return Tree(tokens=tok.astype(jnp.int32), depth=jnp.where(ok, dep, 0), children=children,
              visible=visible)


def hybrid_draft(hist, hist_parents, drafts, use):
  """A hybrid arm's tree: the index's chain hist [B, K] (its parents hist_parents: -1, 0, 1,
  ... while it lasts, padding after) and the drafter's argmax chain drafts [B, K] from the
  same root, merged where they agree: drafter node i is dropped while the drafter repeats the
  history chain's first i + 1 tokens, hangs under history node i - 1 where it first departs,
  and under drafter node i - 1 after that. use [B] False: the history chain is ignored (only
  the drafter's). Returns (tokens, parents) [B, 2K] for `external_tree` (topk 2: a node has
  at most the history child and the drafter's; history first). Both chains are
  deterministic, so the target-only tree rule verifies them exactly."""
  b, k = hist.shape
  idx = jnp.arange(k, dtype=jnp.int32)[None, :]
  h_len = jnp.where(use, jnp.sum(jnp.cumprod(hist_parents == idx - 1, axis=1), axis=1), 0)
  h_ok = idx < h_len[:, None]  # [B, K]
  agree = jnp.cumprod(h_ok & (drafts == hist), axis=1).astype(bool)  # d[:i+1] == h[:i+1]
  prev_agree = jnp.concatenate([jnp.ones((b, 1), bool), agree[:, :-1]], axis=1)
  d_par = jnp.where(idx == 0, -1, jnp.where(prev_agree, idx - 1, k + idx - 1))
  d_par = jnp.where(agree, -2, d_par)
  tokens = jnp.concatenate([hist, drafts], axis=1).astype(jnp.int32)
  parents = jnp.concatenate([jnp.where(h_ok, idx - 1, -2), d_par], axis=1).astype(jnp.int32)
  return tokens, parents
