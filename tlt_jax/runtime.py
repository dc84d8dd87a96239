"""Shared start-up for the entry points (eval, train): config -> model, data, workers.

Each helper turns a user mistake (missing model dir, unsupported checkpoint, bad data file,
bad value) into one ConfigError line instead of a traceback from deep inside a library.
"""

from __future__ import annotations

import os

import ml_collections

from tlt_jax import config as config_lib
from tlt_jax.config import ConfigError


def validate(cfg: ml_collections.ConfigDict) -> None:
  config_lib.validate(cfg)
  if not os.path.isdir(cfg.model.path):
    raise ConfigError(f"config.model.path={cfg.model.path!r} is not a directory; point it at a "
                      "local Hugging Face model directory (config.json + *.safetensors)")


def load_model(cfg: ml_collections.ConfigDict, mesh=None):
  """-> (ModelConfig, params, tokenizer, stop token ids)."""
  from tlt_jax.models.hf_io import (CheckpointFormatError, load_hf_model, load_tokenizer,
                                    stop_token_ids)
  try:
    model_cfg, params = load_hf_model(cfg.model.path, dtype=cfg.model.dtype,
                                      param_dtype=cfg.model.param_dtype, mesh=mesh)
  except CheckpointFormatError as e:
    raise ConfigError(f"config.model.path: {e}") from None
  tokenizer = load_tokenizer(cfg.model.path)
  if tokenizer is None:
    raise ConfigError(f"config.model.path={cfg.model.path!r} has no tokenizer files "
                      "(tokenizer.json / tokenizer_config.json)")
  return model_cfg, params, tokenizer, stop_token_ids(cfg.model.path, tokenizer)


def engine_config(cfg: ml_collections.ConfigDict, stop: tuple[int, ...], *,
                  max_batch: int | None = None, capture_hidden: bool = False):
  from tlt_jax.rollout.engine import EngineConfig
  r = cfg.rollout
  max_batch = max_batch or r.max_batch
  buckets = tuple(b for b in r.buckets if b < max_batch) + (max_batch,)
  return EngineConfig(max_batch=max_batch, buckets=buckets, chunk_size=r.chunk_size,
                      compaction=r.compaction, max_prompt_len=cfg.data.max_prompt_len,
                      max_new_tokens=r.max_new_tokens, capture_hidden=capture_hidden,
                      stop_tokens=tuple(stop))


def make_worker(cfg, model_cfg, params, stop, *, max_batch=None, worker_id=0, mesh=None):
  from tlt_jax.rollout.engine import RolloutWorker
  return RolloutWorker(params, model_cfg, engine_config(cfg, stop, max_batch=max_batch),
                       worker_id=worker_id, mesh=mesh)


def load_rows(cfg: ml_collections.ConfigDict, path: str):
  from tlt_jax.data.prompts import DataError, load_prompt_rows
  try:
    rows, _ = load_prompt_rows(path, prompt_key=cfg.data.prompt_key,
                               answer_key=cfg.data.answer_key, on_bad_row=cfg.data.on_bad_row)
  except DataError as e:
    raise ConfigError(str(e)) from None
  return rows


def exit_on_user_error(main):
  """Wraps an absl main: a ConfigError/DataError/CheckpointFormatError becomes one line on
  stderr and exit status 2 (a user's mistake is not a crash)."""
  import functools
  import sys

  @functools.wraps(main)
  def wrapped(argv):
    from tlt_jax.data.prompts import DataError
    from tlt_jax.models.hf_io import CheckpointFormatError
    try:
      return main(argv)
    except (ConfigError, DataError, CheckpointFormatError) as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
  return wrapped
