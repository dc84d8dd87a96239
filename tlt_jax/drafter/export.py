"""A run's drafter as a servable by-product: EAGLE exports beside the run's checkpoints.

The drafter trained during RL deploys with the final policy in vLLM / SGLang with no conversion
step: with `train.export_drafter` (default on) every checkpoint of a TLT run also writes

    <workdir>/drafter_eagle/<step>/model.safetensors + config.json

(`export_eagle`'s layout and convention, tlt_jax/drafter/model.py) for the engine
`train.export_engine` names, next to `<workdir>/checkpoints/<step>/` that holds the same
drafter for resuming. Exports of steps the checkpointer no longer keeps are deleted with them,
so the workdir holds as many exports as checkpoints. `python -m tlt_jax.export` writes one from
a finished run's checkpoint beside the policy (tlt_jax/export.py), e.g. for the other engine.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from tlt_jax.drafter.model import ENGINES, eagle_architecture, export_eagle
from tlt_jax.models.config import ModelConfig

EXPORT_DIR = "drafter_eagle"


class ExportError(ValueError):
  """A run directory / step / engine that cannot give an export (the message names the fix)."""


def export_path(workdir: str, step: int) -> str:
  return os.path.join(workdir, EXPORT_DIR, str(int(step)))


def check_engine(cfg: ModelConfig, engine: str) -> None:
  """ExportError (one line) for an engine name that is not one, or that has no EAGLE-1 class
  for this architecture (vLLM and qwen2)."""
  if engine not in ENGINES:
    raise ExportError(f"engine {engine!r} is not one of {list(ENGINES)}")
  try:
    eagle_architecture(cfg, engine)
  except ValueError as e:
    raise ExportError(str(e)) from None


def keep_newest(root: str, keep: int) -> None:
  """Deletes all but the newest `keep` step folders `root/<step>`, as the checkpointer does
  with its steps."""
  steps = sorted(int(n) for n in os.listdir(root) if n.isdigit())
  for s in steps[:-keep]:
    shutil.rmtree(os.path.join(root, str(s)), ignore_errors=True)


def export_step(workdir: str, step: int, dparams, cfg: ModelConfig, *, engine: str,
                target_hf_config: dict[str, Any], keep: int | None = None) -> str:
  """Writes step `step`'s export; with `keep` (config.train.keep_checkpoints), deletes all
  but the newest `keep` exports. Returns the export's directory."""
  out = export_path(workdir, step)
  export_eagle(out, dparams, cfg, target_hf_config=target_hf_config, engine=engine)
  if keep is not None:
    keep_newest(os.path.join(workdir, EXPORT_DIR), keep)
  return out
