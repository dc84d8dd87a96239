"""Reward functions, named in the config: a registry name or a `module.path:function`.

A reward function is `fn(response_text: str, answer: str) -> float`.
"""

from __future__ import annotations

import importlib
from typing import Callable

RewardFn = Callable[[str, str], float]


def _arith(response: str, answer: str) -> float:
  from tlt_jax.data import arith
  return arith.score(response, answer)


REGISTRY: dict[str, RewardFn] = {"arith": _arith}


def get_reward_fn(name: str) -> RewardFn:
  if name in REGISTRY:
    return REGISTRY[name]
  if ":" in name:
    module, _, attr = name.partition(":")
    try:
      fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
      raise ValueError(f"reward {name!r}: cannot import ({e}); use 'package.module:function'"
                       ) from None
    if not callable(fn):
      raise ValueError(f"reward {name!r} is not callable")
    return fn
  raise ValueError(f"reward {name!r} is unknown; use one of {sorted(REGISTRY)} or "
                   "'package.module:function'")
