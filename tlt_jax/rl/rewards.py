"""Reward functions, named in the config: a registry name, `package.module:function` or
`path/to/file.py:function`.

A reward function is either
  fn(response_text: str, answer: str) -> float
or verl's signature, recognised by its parameter names and called as verl calls it, by keyword
(so verl's own scorers and a verl user's reward files plug in unchanged):
  fn(data_source, solution_str, ground_truth, extra_info=None) -> float | {"score": float, ...}
with data_source the row's config.data.source_key value (None without one) and extra_info its
`extra_info` field (None without one; passed only if fn takes it). `get_reward_fn` returns
either kind as one `(response, answer, source=None, extra_info=None) -> float`; with
extras=True as `-> (float, extra)`, extra the rest of a verl-style dict (verl's extra metrics,
e.g. DAPO's {"score", "acc", "pred"}: the run averages the numbers among them per step,
`extra_means`, and writes them with the responses it logs), else None. They run in
the worker processes of `tlt_jax.rl.reward_pool.RewardPool` (a crash or hang costs one reward,
not the run), so they may be slow, call sympy, or even segfault.

  arith  the default task's verifier (tlt_jax/data/arith.py): 1.0 iff the final answer after
         "####" is right.
  math   math answers checked with math-verify (HF's maintained parser/equivalence checker):
         the response's final answer (\\boxed{...} preferred, else the last expression) is
         compared with the reference answer symbolically (1/2 == 0.5 == \\frac{1}{2}).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from typing import Any, Callable, Iterable

RewardFn = Callable[[str, str], float]  # a registry function: (response, answer) -> reward
# verl's reward manager passes these by keyword; a function taking all three is verl-style.
VERL_PARAMS = ("data_source", "solution_str", "ground_truth")


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


def _load_module(module: str):
  """`module`: a dotted module name, or a .py file (as verl's custom_reward_function.path)."""
  if not module.endswith(".py"):
    return importlib.import_module(module)
  if not os.path.isfile(module):
    raise ImportError(f"no file {module!r}")
  spec = importlib.util.spec_from_file_location(
      "_tlt_reward_" + os.path.basename(module)[:-3], os.path.abspath(module))
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # as an import would (dataclasses in it look themselves up)
  spec.loader.exec_module(mod)
  return mod


def _uniform(fn: Callable) -> Callable[..., Any]:
  """fn, of either kind (module docstring), as `(response, answer, source, extra_info)`."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):  # a builtin without a signature: not verl-style
    params = {}
  named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  if not set(VERL_PARAMS) <= named:
    return lambda response, answer, source=None, extra_info=None: fn(response, answer)
  takes_extra = "extra_info" in named or any(p.kind is p.VAR_KEYWORD for p in params.values())

  def verl_style(response, answer, source=None, extra_info=None):
    kw = {"extra_info": extra_info} if takes_extra else {}
    return fn(data_source=source, solution_str=response, ground_truth=answer, **kw)
  return verl_style


def score_and_extra(out: Any) -> tuple[Any, dict[str, Any] | None]:
  """A reward function's return -> (its reward, the rest of verl's {"score": r, ...metrics}
  dict, or None)."""
  if isinstance(out, dict):
    return out["score"], {k: v for k, v in out.items() if k != "score"} or None
  return out, None


def extra_means(extras: Iterable[dict[str, Any] | None]) -> dict[str, float]:
  """The mean of each numeric entry (numbers and booleans) over the extras that have it."""
  values: dict[str, list[float]] = {}
  for extra in extras:
    for k, v in (extra or {}).items():
      if isinstance(v, (bool, int, float)) and math.isfinite(v):
        values.setdefault(k, []).append(float(v))
  return {k: sum(v) / len(v) for k, v in values.items()}


def get_reward_fn(name: str, extras: bool = False) -> Callable[..., Any]:
  """The reward `name` as `(response, answer, source=None, extra_info=None) -> reward`; with
  extras, `-> (reward, extra)` (`score_and_extra`)."""
  fn = _reward_fn(name)
  if extras:
    return lambda *a, **kw: score_and_extra(fn(*a, **kw))
  return lambda *a, **kw: score_and_extra(fn(*a, **kw))[0]


def _reward_fn(name: str) -> Callable[..., Any]:
  if name in REGISTRY:
    if name == "math":
      _import_math_verify()
    return _uniform(REGISTRY[name])
  if ":" in name:
    module, _, attr = name.rpartition(":")
    try:
      fn = getattr(_load_module(module), attr)
    except (ImportError, AttributeError) as e:
      raise ValueError(f"reward {name!r}: cannot import ({e}); use 'package.module:function' "
                       "importable from the working directory or PYTHONPATH, or "
                       "'path/to/file.py:function'") from None
    if not callable(fn):
      raise ValueError(f"reward {name!r} is not callable")
    return _uniform(fn)
  raise ValueError(f"reward {name!r} is unknown; use one of {sorted(REGISTRY)}, "
                   "'package.module:function' or 'path/to/file.py:function'")
