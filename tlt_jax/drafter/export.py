"""A run's drafter as a servable by-product: EAGLE exports beside the run's checkpoints.

The drafter trained during RL deploys with the final policy in vLLM / SGLang with no conversion
step: with `train.export_drafter` (default on) every checkpoint of a TLT run also writes

    <workdir>/drafter_eagle/<step>/model.safetensors + config.json

(`export_eagle`'s layout and convention, tlt_jax/drafter/model.py) for the engine
`train.export_engine` names, next to `<workdir>/checkpoints/<step>/` that holds the same
drafter for resuming. Exports of steps the checkpointer no longer keeps are deleted with them,
so the workdir holds as many exports as checkpoints. `export_run` writes one from a finished
run's checkpoint (scripts/export_drafter.py), e.g. for the other engine.
"""

from __future__ import annotations

import json
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


def export_step(workdir: str, step: int, dparams, cfg: ModelConfig, *, engine: str,
                target_hf_config: dict[str, Any], keep: int | None = None) -> str:
  """Writes step `step`'s export; with `keep` (config.train.keep_checkpoints), deletes all
  but the newest `keep` exports, as the checkpointer does with its steps. Returns the
  export's directory."""
  out = export_path(workdir, step)
  export_eagle(out, dparams, cfg, target_hf_config=target_hf_config, engine=engine)
  if keep is not None:
    root = os.path.join(workdir, EXPORT_DIR)
    steps = sorted(int(n) for n in os.listdir(root) if n.isdigit())
    for s in steps[:-keep]:
      shutil.rmtree(os.path.join(root, str(s)), ignore_errors=True)
  return out


def export_run(workdir: str, *, step: int | None = None, engine: str = "sglang",
               out: str | None = None) -> str:
  """The EAGLE export of a finished run's drafter at checkpoint `step` (default: the latest),
  written to `out` (default: `export_path(workdir, step)`); returns that directory.

  Reads <workdir>/config.json (written by tlt_jax.train) for the target model directory and
  dtype, and the drafter params from <workdir>/checkpoints/<step>. ExportError for a missing
  workdir / config / checkpoint / step, a run without a drafter (TLT off) or an engine without
  an EAGLE class for the target's architecture."""
  from tlt_jax.checkpoint import Checkpointer, CheckpointError
  from tlt_jax.models.hf_io import CheckpointFormatError, load_hf_config, read_hf_config
  if not os.path.isdir(workdir):
    raise ExportError(f"--workdir {workdir!r} does not exist; pass the workdir of a "
                      "tlt_jax.train run")
  cpath = os.path.join(workdir, "config.json")
  if not os.path.isfile(cpath):
    raise ExportError(f"--workdir {workdir}: no config.json; not the workdir of a tlt_jax.train "
                      "run")
  with open(cpath) as f:
    run_cfg = json.load(f)
  m = run_cfg.get("model", {})
  try:
    cfg = load_hf_config(m.get("path", ""), param_dtype=m.get("param_dtype", "float32"))
    target_hf_config = read_hf_config(m.get("path", ""))
  except CheckpointFormatError as e:
    raise ExportError(f"{cpath}: model.path: {e}") from None
  check_engine(cfg, engine)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  steps = Checkpointer(ckpt_dir, max_to_keep=None).all_steps() if os.path.isdir(ckpt_dir) \
      else []
  if not steps:
    raise ExportError(f"--workdir {workdir}: no checkpoints in {ckpt_dir}")
  step = max(steps) if step is None else int(step)
  if step not in steps:
    raise ExportError(f"--step {step}: {ckpt_dir} holds steps {sorted(steps)}")
  try:
    dparams = Checkpointer(ckpt_dir, max_to_keep=None).read_subtree("drafter/params", step)
  except CheckpointError as e:
    raise ExportError(str(e)) from None
  if not dparams:
    raise ExportError(f"--workdir {workdir}: checkpoint {step} holds no drafter (a run with "
                      "tlt.enabled=False trains none)")
  out = out or export_path(workdir, step)
  export_eagle(out, dparams, cfg, target_hf_config=target_hf_config, engine=engine)
  return out
