"""Where a speculative step's time goes: per-forward costs inside compiled loops.

Shared by scripts/profile_spec.py (the table), scripts/bench_rollout.py and
scripts/bench_regime.py (the bounds beside their measured speedups) and
tlt_jax/bench/roofline.py (the plain step against copy bandwidth).
Every component is timed the way the engine runs it: N repetitions inside ONE jitted
`lax.fori_loop` / `while_loop` (the KV cache is loop-carried, so nothing is hoisted), divided
by N: the in-loop cost, without the per-call dispatch a single jitted call would add. Weights
are arguments, as in the engine: closed-over weights become constants that XLA:CPU pre-packs,
which made a plain step 1.7x faster than any engine call sees.

  plain step        one plain decode step (decode_chunk with chunk=N): logits, sample, 1-token
                    target forward. The unit everything else is divided by.
  verify fwd T=n    target forward over the n verified tokens with the cache, + logits.
  drafter fwd T=t   drafter forward with its cache, + logits: t=1 one chain draft step,
                    t=topk one tree level, t=steps+1 the catch-up (it also yields draft 1).
  verify rule       verify_chain / verify_tree (jnp reference and Pallas kernel; off-GPU the
                    kernel runs in interpret mode), on [B, n, V] log-probs.
  spec step         one whole speculative step (spec_chunk with chunk=N).

Bounds on the speedup over plain decoding for a = tokens per verification (accepted + 1):
  lead's    a / (1 + steps * r), r = drafter step / plain step (verify priced as 1 plain step)
  ideal     a / (verify + catch-up + (steps - 1) * drafter step)  (the forwards alone)
  measured  a / (spec step)  (everything in the step; still excludes host work per chunk)
  perfect   the ideal bound at a = steps + 1 (every draft accepted): what no drafter can beat
            with this arm on this machine. On a GPU the verify forward of a few tokens costs
            about one plain step; on a CPU it grows with the tokens verified (compute-bound).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np


def per_iter(fn, args, iters: int, repeats: int = 5) -> float:
  """Seconds per loop iteration of fn(args, iters) (compiled once; best of `repeats`)."""
  exe = jax.jit(fn, static_argnums=1).lower(args, iters).compile()
  jax.block_until_ready(exe(args))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(exe(args))
    best = min(best, time.perf_counter() - t0)
  return best / iters


def measure_costs(params, dparams, cfg, batch: int, arms, sp, *, iters: int = 200,
                  prompt_len: int = 64, cache_len: int = 384, rules: bool = False,
                  kv_len: int | None = None) -> dict[str, float]:
  """Seconds per call of each component (module docstring) at this batch size, for the
  plain step and for each strategy name in `arms`. dparams None: the plain step alone (no
  drafter). kv_len: the plain step's attention window (None: the whole cache); it must hold
  prompt_len + iters, the slots the loop's rows reach."""
  from tlt_jax.drafter.model import drafter_cache, drafter_forward
  from tlt_jax.kernels.verify import verify_chain, verify_tree
  from tlt_jax.kernels.verify.reference import draw_tree_randomness, draw_verify_randomness
  from tlt_jax.models import compute_logits, forward, init_cache, unstack_layers
  from tlt_jax.rollout import decode, spec_state, speculative
  from tlt_jax.rollout.sampling import processed_logprobs
  params = jax.jit(unstack_layers)(params)  # the rollout replicas' layout
  from tlt_jax.rollout.policies.strategy import Strategy

  b, v = batch, cfg.vocab_size
  rng = np.random.RandomState(0)
  toks = jnp.asarray(rng.randint(2, v, (b, prompt_len)), jnp.int32)
  lens = jnp.full((b,), prompt_len, jnp.int32)
  keys = jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(jnp.arange(b))
  max_new = jnp.full((b,), 1 << 30, jnp.int32)  # nobody finishes inside the loops
  strategies = [Strategy(a) for a in arms]
  cache = init_cache(cfg, b, cache_len)
  if dparams is None:
    base = jax.jit(functools.partial(decode.prefill, cfg=cfg))(
        params, cache, toks, lens, keys, max_new)
  else:
    state = jax.jit(functools.partial(
        spec_state.prefill, cfg=cfg, max_steps=max([s.steps for s in strategies] + [1])))(
            params, dparams, cache, drafter_cache(cfg, b, cache_len), toks, lens, keys, max_new)
    base = state.base

  def fwd_loop(a, iters, t, drafter):
    params, dparams, cache, x = a
    tok = jnp.ones((b, t), jnp.int32)

    def body(i, carry):
      cache, x = carry
      pos = cache.lengths[:, None] + jnp.arange(t)[None, :]
      if drafter:
        g, lg, cache = drafter_forward(dparams, params, tok, x, pos, cfg=cfg, cache=cache)
      else:
        o = forward(params, tok, pos, cfg=cfg, cache=cache, return_logits=False)
        lg = processed_logprobs(compute_logits(params, o.hidden, cfg), sp)
        g, cache = o.hidden, o.cache
      return cache, x + 1e-6 * g + 1e-9 * jnp.sum(lg)  # keeps the loop's dependency chain
    return jax.lax.fori_loop(0, iters, body, (cache, x))

  def fwd(t, drafter):
    name = f"{'drafter' if drafter else 'verify'} fwd T={t}"
    if name not in out:
      cache = state.dcache if drafter else state.base.cache
      x = jnp.zeros((b, t, cfg.hidden_size))
      out[name] = per_iter(functools.partial(fwd_loop, t=t, drafter=drafter),
                           (params, dparams, cache, x), iters)
    return out[name]

  out: dict[str, float] = {}
  out["plain step"] = per_iter(
      lambda a, n: decode.decode_chunk(a[0], a[1], cfg=cfg, sp=sp, stop_tokens=(), chunk=n,
                                       capture_hidden=False, kv_len=kv_len), (params, base), iters)
  if dparams is None:
    return out
  fwd(1, False)
  fwd(1, True)
  for st in strategies:
    n = st.verify_tokens
    fwd(n, False)
    fwd(st.steps + 1, True)
    fwd(st.topk, True)
    out[f"spec step {st.name}"] = per_iter(
        lambda a, it, st=st: speculative.spec_chunk(
            *a, cfg=cfg, sp=sp, stop_tokens=(), chunk=it, strategy=st,
            capture_hidden=False, use_kernel=False), (params, dparams, state), max(iters // 4, 10))
    if not rules:
      continue
    tlp = jax.nn.log_softmax(jnp.asarray(rng.randn(b, n, v), jnp.float32))
    for kern in (False, True):
      tag = f"verify rule {st.name} {'kernel' if kern else 'ref'}"
      if st.topk == 1:
        dlp = None if sp.greedy else jax.nn.log_softmax(jnp.asarray(rng.randn(b, n - 1, v)))
        dtok = jnp.asarray(rng.randint(0, v, (b, n - 1)), jnp.int32)

        def rule(a, it, kern=kern, dlp=dlp, dtok=dtok):
          def body(i, acc):
            u, g = draw_verify_randomness(jax.random.key(i), b, n - 1, v)
            na, nxt = verify_chain(tlp, (dtok + acc[:, None]) % v, dlp, u, g, greedy=sp.greedy,
                                   use_kernel=kern)
            return (acc + na + nxt) % 2
          return jax.lax.fori_loop(0, it, body, a)
      else:
        kids = jnp.full((b, n, st.topk), -1, jnp.int32).at[:, 0, 0].set(1)

        def rule(a, it, kern=kern, kids=kids):
          def body(i, acc):
            u, g = draw_tree_randomness(jax.random.key(i), b, n, v)
            _, na, nxt = verify_tree(tlp, jnp.broadcast_to(acc[:, None], (b, n)), kids, u, g,
                                     greedy=sp.greedy, max_depth=st.steps, use_kernel=kern)
            return (acc + na + nxt) % 2
          return jax.lax.fori_loop(0, it, body, a)
      out[tag] = per_iter(rule, jnp.zeros((b,), jnp.int32), max(iters // 4, 10))
  return out


def bounds(costs: dict[str, float], arm: str, accept: float) -> dict[str, float]:
  """The three speedup bounds of the module docstring for `arm` at `accept` tokens per
  verification (costs from `measure_costs`)."""
  from tlt_jax.rollout.policies.strategy import Strategy
  st = Strategy(arm)
  unit = costs["plain step"]
  r = costs["drafter fwd T=1"] / unit
  ideal = (costs[f"verify fwd T={st.verify_tokens}"] + costs[f"drafter fwd T={st.steps + 1}"]
           + (st.steps - 1) * costs[f"drafter fwd T={st.topk}"]) / unit
  step = costs[f"spec step {st.name}"] / unit
  return {"r": r, "ideal_cost": ideal, "step_cost": step, "lead": accept / (1 + st.steps * r),
          "ideal": accept / ideal, "measured": accept / step, "perfect": (st.steps + 1) / ideal}
