"""Config plumbing: `--config configs/x.py --config.some.key=value` through absl flags.

absl + ml_collections report a typo'd override key as a deep AttributeError traceback and a
missing config file as an opaque object; `flags_parser` checks both first and exits with one
line naming the input and the fix. `validate` checks values shared by every entry point.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from typing import Any, Iterable

import ml_collections
from absl import flags

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class ConfigError(ValueError):
  """A user-facing configuration mistake."""


def asset_path(*parts: str) -> str:
  """Path of an asset shipped inside the package (e.g. asset_path("default", "model"))."""
  return os.path.join(PACKAGE_DIR, "assets", *parts)


def load_config_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  if not os.path.isfile(path):
    raise ConfigError(f"--config {path}: no such file; pass a file from configs/, e.g. "
                      "--config configs/default.py")
  spec = importlib.util.spec_from_file_location("_tlt_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"--config {path}: the file defines no get_config()")
  return module.get_config(arg) if arg is not None else module.get_config()


def dotted_keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> Iterable[str]:
  for k, v in cfg.items():
    yield prefix + k
    if isinstance(v, ml_collections.ConfigDict):
      yield from dotted_keys(v, prefix + k + ".")


def check_overrides(argv: list[str], flag: str = "config") -> None:
  """Raises ConfigError for a missing config file or an override key the config lacks."""
  path, overrides = None, []
  it = iter(range(len(argv)))
  for i in it:
    a = argv[i]
    if a == f"--{flag}" and i + 1 < len(argv):
      path = argv[i + 1]
    elif a.startswith(f"--{flag}="):
      path = a.split("=", 1)[1]
    elif a.startswith(f"--{flag}."):
      overrides.append(a[len(f"--{flag}."):].split("=", 1)[0])
  if path is None:
    if overrides:
      raise ConfigError(f"--{flag}.* overrides given without --{flag} FILE")
    return
  file_path, _, arg = path.partition(":")
  cfg = load_config_file(file_path, arg or None)
  keys = set(dotted_keys(cfg))
  for key in overrides:
    if key not in keys:
      close = difflib.get_close_matches(key, sorted(keys), n=3)
      hint = f"; did you mean {', '.join('--' + flag + '.' + c for c in close)}?" if close else ""
      raise ConfigError(f"--{flag}.{key}: {file_path} has no key '{key}'{hint}")


def flags_parser(argv: list[str]) -> list[str]:
  """absl `app.run(..., flags_parser=flags_parser)`: clear errors before absl parses."""
  try:
    check_overrides(argv)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def require(cond: bool, key: str, value: Any, fix: str) -> None:
  if not cond:
    raise ConfigError(f"config.{key}={value!r} is invalid: {fix}")


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Value checks for the sections every entry point shares (model, mesh, rollout)."""
  if "model" in cfg:
    m = cfg.model
    require(bool(m.path), "model.path", m.path, "set the local Hugging Face model directory")
    for k in ("dtype", "param_dtype"):
      require(m[k] in ("float32", "bfloat16", "float16"), f"model.{k}", m[k],
              "use float32, bfloat16 or float16")
  if "mesh" in cfg:
    sizes = [cfg.mesh[a] for a in ("data", "fsdp", "tensor")]
    require(all(isinstance(s, int) and (s > 0 or s == -1) for s in sizes), "mesh", dict(cfg.mesh),
            "axis sizes are positive integers, or -1 on one axis for 'all remaining devices'")
  if "rollout" in cfg:
    r = cfg.rollout
    require(r.max_batch >= 1, "rollout.max_batch", r.max_batch,
            "must be >= 1 (concurrent sequences per rollout worker)")
    require(r.max_new_tokens > 0, "rollout.max_new_tokens", r.max_new_tokens, "must be > 0")
    require(r.chunk_size > 0, "rollout.chunk_size", r.chunk_size, "must be > 0")
    require(r.temperature >= 0, "rollout.temperature", r.temperature, "must be >= 0 (0 = greedy)")
    require(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must be in (0, 1]")
    require(r.top_k >= 0, "rollout.top_k", r.top_k, "must be >= 0 (0 = off)")
    b = tuple(r.buckets)
    require(len(b) > 0 and list(b) == sorted(set(b)) and b[0] >= 1, "rollout.buckets", b,
            "a strictly increasing tuple of batch sizes, e.g. (1, 2, 4, 8)")
    require(b[-1] >= r.max_batch, "rollout.buckets", b,
            f"the largest bucket must be >= rollout.max_batch ({r.max_batch})")
  if "data" in cfg:
    d = cfg.data
    require(d.on_bad_row in ("skip", "error"), "data.on_bad_row", d.on_bad_row,
            "use 'skip' (count and warn) or 'error' (stop with the row number)")
  if "grpo" in cfg:
    g = cfg.grpo
    require(g.num_prompts >= 1, "grpo.num_prompts", g.num_prompts, "must be >= 1")
    require(g.n >= 2, "grpo.n", g.n, "GRPO needs >= 2 responses per prompt to compare")
    require(0 <= g.eps_low < 1, "grpo.eps_low", g.eps_low, "must be in [0, 1)")
    require(g.eps_high >= 0, "grpo.eps_high", g.eps_high, "must be >= 0")
    require(g.kl_coef >= 0, "grpo.kl_coef", g.kl_coef, "must be >= 0 (0 = no KL term)")
    require(g.micro_batch >= 1, "grpo.micro_batch", g.micro_batch, "must be >= 1")
    require(g.micro_batch_tokens >= 0, "grpo.micro_batch_tokens", g.micro_batch_tokens,
            "must be >= 0 (0 = fixed micro_batch rows)")
    rows = g.num_prompts * g.n
    most = -(-rows // g.micro_batch) if not g.micro_batch_tokens else rows
    require(1 <= g.minibatches <= most, "grpo.minibatches", g.minibatches,
            f"must be between 1 and the number of micro-batches per step ({most})")
    require(g.pad_multiple >= 1, "grpo.pad_multiple", g.pad_multiple, "must be >= 1")
    require(g.logit_chunk >= 1, "grpo.logit_chunk", g.logit_chunk,
            "must be >= 1 (tokens per LM-head chunk, e.g. 1024)")
    if "rollout" in cfg:
      require(cfg.rollout.temperature > 0, "rollout.temperature", cfg.rollout.temperature,
              "GRPO samples its groups: use a temperature > 0 (e.g. 1.0)")
  if "optim" in cfg:
    o = cfg.optim
    require(o.lr > 0, "optim.lr", o.lr, "must be > 0")
    require(o.schedule in ("constant", "cosine"), "optim.schedule", o.schedule,
            "use 'constant' (after warm-up) or 'cosine'")
    require(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
  if "train" in cfg:
    t = cfg.train
    require(t.steps >= 1, "train.steps", t.steps, "must be >= 1")
    require(t.eval_every >= 0, "train.eval_every", t.eval_every, "must be >= 0 (0 = never)")
    require(t.checkpoint_every >= 1, "train.checkpoint_every", t.checkpoint_every,
            "must be >= 1")
    require(t.keep_checkpoints >= 1, "train.keep_checkpoints", t.keep_checkpoints,
            "must be >= 1")
  if "reward" in cfg and "num_workers" in cfg.reward:
    require(cfg.reward.num_workers >= 1, "reward.num_workers", cfg.reward.num_workers,
            "must be >= 1")
    require(cfg.reward.timeout > 0, "reward.timeout", cfg.reward.timeout, "must be > 0 seconds")
  if "tlt" in cfg:
    s = cfg.tlt.spec
    from tlt_jax.rollout.speculative import Strategy
    try:
      Strategy.parse(s.strategy)
    except (ValueError, NotImplementedError) as e:
      raise ConfigError(f"config.tlt.spec.strategy={s.strategy!r} is invalid: {e}") from None
    require(s.bs_threshold >= 1, "tlt.spec.bs_threshold", s.bs_threshold, "must be >= 1")
    require(s.selector in ("fixed", "beg", "eg", "ucb1", "bucb1"), "tlt.spec.selector",
            s.selector, "use 'beg' (BEG-MAB), 'fixed', 'eg', 'ucb1' or 'bucb1'")
    require(0 <= s.epsilon <= 1, "tlt.spec.epsilon", s.epsilon, "must be in [0, 1]")
    require(s.window >= 1, "tlt.spec.window", s.window, "must be >= 1")
    require(s.patience >= 1, "tlt.spec.patience", s.patience, "must be >= 1")
    require(cfg.tlt.drafter_steps >= 0, "tlt.drafter_steps", cfg.tlt.drafter_steps,
            "must be >= 0 (0 = keep the drafter fixed)")
    require(cfg.tlt.drafter_lr > 0, "tlt.drafter_lr", cfg.tlt.drafter_lr,
            "must be > 0 (to keep the drafter fixed set tlt.drafter_steps=0)")
