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


def _import_math_verify() -> None:
  # At start-up, not on the first call: a missing or broken math-verify must stop the run with
  # its import error, not make every call raise inside a worker and score 0. Not at module
  # import either: other rewards must not pay for (or depend on) math-verify and sympy.
  try:
    from math_verify import parse, verify  # noqa: F401
  except Exception as e:  # noqa: BLE001 - a broken install fails in more ways than ImportError
    raise ValueError(f"config.reward.name='math' needs math-verify, which does not import "
                     f"({type(e).__name__}: {e}); install it: "
                     "pip install 'math-verify>=0.9,<0.10'") from None


REGISTRY: dict[str, RewardFn] = {"arith": _arith, "math": _math}


def get_reward_fn(name: str) -> RewardFn:
  if name in REGISTRY:
    if name == "math":
      _import_math_verify()
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
