"""The environment of the command-line processes the tests start (python -m tlt_jax.train,
generate, eval, export, the scripts), as a user's install has it.

The test set installs torch (tests compare with transformers' models); a user's does not
(scripts/setup.sh without --dev). A process that finds torch imports it through transformers'
AutoTokenizer although nothing it runs uses it: ~3 s a process on this 2-core machine
(measured: loading the shipped tokenizer 4.4-4.8 s with torch, 1.5-2.2 s without), and the suite
starts ~45 of them. tests/without_torch/sitecustomize.py hides it, so these processes also
check that the command runs without torch. Not a test module."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WITHOUT_TORCH = os.path.join(ROOT, "tests", "without_torch")


def user_env(base: dict[str, str] | None = None, **overrides: str) -> dict[str, str]:
  """`base` (default: this process's environment) with `overrides`, torch hidden: the
  without_torch folder first on PYTHONPATH (a PYTHONPATH in `overrides` comes after it)."""
  env = dict(os.environ if base is None else base, **overrides)
  rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != WITHOUT_TORCH]
  env["PYTHONPATH"] = os.pathsep.join([WITHOUT_TORCH, *rest])
  return env
