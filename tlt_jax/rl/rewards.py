"""Reward functions, named in the config: a registry name or a `module.path:function`.

A reward function is `fn(response_text: str, answer: str) -> float`. They run in the worker
processes of `tlt_jax.rl.reward_pool.RewardPool` (a crash or hang costs one reward, not the
run), so they may be slow, call sympy, or even segfault.

  arith  the default task's verifier (tlt_jax/data/arith.py): 1.0 iff the final answer after
         "####" is right.
  math   math answers checked with math-verify (HF's maintained parser/equivalence checker):
         the response's final answer (\\boxed{...} preferred, else the last expression) is
         compared with the reference answer symbolically (1/2 == 0.5 == \\frac{1}{2}).
"""

from __future__ import annotations

import importlib
from typing import Callable

RewardFn = Callable[[str, str], float]


def _arith(response: str, answer: str) -> float:
  from tlt_jax.data import arith
  return arith.score(response, answer)


def _math(response: str, answer: str) -> float:
  from math_verify import parse, verify
  gold_text = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
  gold = parse(gold_text)
  if not gold:  # plain-text answer math-verify cannot read as math: exact match
    return float(response.strip().endswith(answer.strip()))
  pred = parse(response)
  return float(bool(pred) and verify(gold, pred))


REGISTRY: dict[str, RewardFn] = {"arith": _arith, "math": _math}


def get_reward_fn(name: str) -> RewardFn:
  if name in REGISTRY:
    return REGISTRY[name]
  if ":" in name:
    module, _, attr = name.partition(":")
    try:
      fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
      raise ValueError(f"reward {name!r}: cannot import ({e}); use 'package.module:function' "
                       "importable from the working directory or PYTHONPATH") from None
    if not callable(fn):
      raise ValueError(f"reward {name!r} is not callable")
    return fn
  raise ValueError(f"reward {name!r} is unknown; use one of {sorted(REGISTRY)} or "
                   "'package.module:function'")
