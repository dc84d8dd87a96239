"""Config plumbing: `--config configs/x.py --config.some.key=value` through absl flags.

absl + ml_collections report a typo'd override key as a deep AttributeError traceback and a
missing config file as an opaque object; `flags_parser` checks both first and exits with one
line naming the input and the fix. `validate` checks values shared by every entry point.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
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


def typed(fn, keys: dict[str, str], default_key: str, **kw):
  """`fn(**kw)` (a typed config: dataclass, selector), its ValueError turned into one
  ConfigError naming the config key. Typed configs validate themselves (once, there) with
  messages that start "field=value: fix"; `keys` maps field -> config key."""
  try:
    return fn(**kw)
  except ValueError as e:
    msg = str(e)
    m = re.match(r"(\w+)=", msg)
    if m and m.group(1) in keys:
      raise ConfigError(f"config.{keys[m.group(1)]}{msg[len(m.group(1)):]}") from None
    raise ConfigError(f"config.{default_key}: {msg}") from None


# -------------------------------------------------------- typed configs built from a ConfigDict
def sampling_params(cfg: ml_collections.ConfigDict):
  from tlt_jax.rollout.sampling import SamplingParams
  r = cfg.rollout
  return typed(SamplingParams, {k: f"rollout.{k}" for k in ("temperature", "top_k", "top_p")},
               "rollout", temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)


def spec_config(cfg: ml_collections.ConfigDict):
  from tlt_jax.rollout.engine import SpecConfig
  s = cfg.tlt.spec
  fields = ("strategy", "bs_threshold", "patience", "max_steps", "background_compile")
  return typed(SpecConfig, {k: f"tlt.spec.{k}" for k in fields}, "tlt.spec",
               **{k: s[k] for k in fields})


def spec_gate(cfg: ml_collections.ConfigDict, verdicts=None):
  """The gate that opens speculation bucket by bucket as it is measured to pay
  (tlt_jax/rollout/gate.py), from config.tlt.spec.gate; None when disabled, and with the
  fixed selector (a pinned strategy runs wherever speculation switches on, deterministically:
  the gate's verdicts depend on measured speed). `verdicts`: a gate.VerdictCache of earlier
  runs' hardware verdicts."""
  from tlt_jax.rollout.gate import GateConfig, SpecGate
  g = cfg.tlt.spec.get("gate")
  if g is None or not g.enabled or cfg.tlt.spec.selector == "fixed":
    return None
  fields = ("min_chunks", "margin", "reprobe_every", "hardware_reprobe_every",
            "follow_traffic")
  names = {k: f"tlt.spec.gate.{k}" for k in fields}
  names["lead"] = "tlt.spec.strategy"  # the probe's first arm: the fixed selector's
  return SpecGate(typed(GateConfig, names, "tlt.spec.gate",
                        lead=cfg.tlt.spec.strategy, **{k: g[k] for k in fields}),
                  verdicts=verdicts)


def engine_config(cfg: ml_collections.ConfigDict, stop: tuple[int, ...] = (), *,
                  max_batch: int | None = None, speculative: bool = False,
                  capture_hidden: bool = False, hidden_keep: int = 0):
  """The rollout engine's config (tlt_jax/rollout/engine.py) from config.rollout."""
  from tlt_jax.rollout.engine import EngineConfig
  r = cfg.rollout
  b = tuple(r.buckets)
  require(len(b) > 0 and list(b) == sorted(set(b)) and b[0] >= 1, "rollout.buckets", b,
          "a strictly increasing tuple of batch sizes, e.g. (1, 2, 4, 8)")
  # max_batch 0 is sized from memory at start-up (memory.resolve); validate the largest bucket
  max_batch = max_batch or r.max_batch or b[-1]
  # Buckets above the worker's batch are never used: cut them, keep max_batch itself.
  buckets = tuple(x for x in b if x < max_batch) + (max_batch,) if max_batch >= 1 else b
  keys = {k: f"rollout.{k}" for k in ("max_batch", "chunk_size", "compaction",
                                      "max_new_tokens")}
  keys.update(buckets="rollout.buckets", max_prompt_len="data.max_prompt_len")
  keys["prompt_bucket"] = "rollout.prompt_bucket"
  return typed(EngineConfig, keys, "rollout", max_batch=max_batch, buckets=buckets,
               chunk_size=r.chunk_size, compaction=r.compaction,
               prompt_bucket=r.get("prompt_bucket", 16),
               max_prompt_len=cfg.data.max_prompt_len, max_new_tokens=r.max_new_tokens,
               capture_hidden=capture_hidden, hidden_keep=hidden_keep, stop_tokens=tuple(stop),
               spec=spec_config(cfg) if speculative else None)


def grpo_config(cfg: ml_collections.ConfigDict):
  from tlt_jax.rl.grpo import GRPOConfig
  g = cfg.grpo
  fields = ("eps_low", "eps_high", "kl_coef", "adv_eps", "norm_adv_by_std", "logit_chunk")
  keys = {k: f"grpo.{k}" for k in fields}
  keys["temperature"] = "rollout.temperature"
  return typed(GRPOConfig, keys, "grpo", temperature=cfg.rollout.temperature,
               **{k: g[k] for k in fields})


def selector(cfg: ml_collections.ConfigDict, seed: int | None = None):
  """The speculative-strategy selector named by config.tlt.spec (BEG-MAB by default)."""
  from tlt_jax.rollout.mab import make_selector
  s = cfg.tlt.spec
  return typed(make_selector, {"kind": "tlt.spec.selector", "arm": "tlt.spec.strategy",
                               "epsilon": "tlt.spec.epsilon", "window": "tlt.spec.window"},
               "tlt.spec.buckets", kind=s.selector, buckets=parse_mab_buckets(s.buckets),
               arm=s.strategy, epsilon=s.epsilon, window=s.window,
               seed=cfg.seed if seed is None else seed)


def parse_mab_buckets(text: str) -> dict[int, list[str]] | None:
  """'1:4_1_5,3_1_4,off 2:...' -> {1: ["4_1_5", "3_1_4", "off"], 2: ...}; '' -> None."""
  if not text.strip():
    return None
  out = {}
  for part in text.split():
    bound, sep, arms = part.partition(":")
    if not sep or not bound.isdigit() or not arms:
      raise ConfigError(f"config.tlt.spec.buckets: {part!r} is not 'LOWER_BOUND:ARM,ARM,...' "
                        "(e.g. '1:4_1_5,3_1_4,off 5:3_1_4,off')")
    out[int(bound)] = arms.split(",")
  return out


def spot_config(cfg: ml_collections.ConfigDict):
  from tlt_jax.coordinator.spot import SpotConfig
  d = cfg.tlt.drafter
  return typed(SpotConfig, {k: f"tlt.drafter.{k}" for k in ("mode", "on_barrier",
                                                            "serial_steps")},
               "tlt.drafter", mode=d.mode, on_barrier=d.on_barrier,
               serial_steps=d.serial_steps)


def buffer_config(cfg: ml_collections.ConfigDict):
  from tlt_jax.drafter.buffer import BufferConfig
  d = cfg.tlt.drafter
  keys = {"max_tokens": "tlt.drafter.buffer_tokens", "window": "tlt.drafter.window",
          "max_windows_per_response": "tlt.drafter.windows_per_response",
          "keep_steps": "tlt.drafter.keep_steps", "tail_weight": "tlt.drafter.tail_weight"}
  return typed(BufferConfig, keys, "tlt.drafter", max_tokens=d.buffer_tokens, window=d.window,
               max_windows_per_response=d.windows_per_response, keep_steps=d.keep_steps,
               tail_weight=d.tail_weight)


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Value checks of a run's config: the typed configs are built (each validates itself,
  errors name the config key); the remaining plain values are checked here."""
  if "model" in cfg:
    m = cfg.model
    require(bool(m.path), "model.path", m.path, "set the local Hugging Face model directory")
    for k in ("dtype", "param_dtype"):
      require(m[k] in ("float32", "bfloat16", "float16"), f"model.{k}", m[k],
              "use float32, bfloat16 or float16")
  if "cpu_devices" in cfg:
    require(isinstance(cfg.cpu_devices, int) and cfg.cpu_devices >= 0, "cpu_devices",
            cfg.cpu_devices, "a number of CPU devices to expose, or 0 for JAX's default")
  if "mesh" in cfg:
    sizes = [cfg.mesh[a] for a in ("data", "fsdp", "tensor")]
    require(all(isinstance(s, int) and (s > 0 or s == -1) for s in sizes), "mesh", dict(cfg.mesh),
            "axis sizes are positive integers, or -1 on one axis for 'all remaining devices'")
    devices = cfg.mesh.get("devices", 0)
    require(isinstance(devices, int) and devices >= 0, "mesh.devices", devices,
            "the number of devices the learner spans (the first ones), or 0 for all")
  if "memory" in cfg:
    mem = cfg.memory
    require(0 < mem.fraction <= 1, "memory.fraction", mem.fraction,
            "the share of device memory the run may use, in (0, 1]")
    require(isinstance(mem.num_devices, int) and mem.num_devices >= 0, "memory.num_devices",
            mem.num_devices, "the devices to plan for, or 0 for the visible ones")
    from tlt_jax.memory import device_bytes
    device_bytes(mem.device)
  if "rollout" in cfg:
    r = cfg.rollout
    require(isinstance(r.max_batch, int) and r.max_batch >= 0, "rollout.max_batch",
            r.max_batch, "sequences per worker, or 0 to size it from memory")
    sampling_params(cfg)
    engine_config(cfg, speculative="tlt" in cfg and cfg.tlt.enabled)
    require(r.get("num_workers", 1) >= 1, "rollout.num_workers", r.get("num_workers"),
            "must be >= 1")
    require(r.get("tensor_parallel", 1) >= 1, "rollout.tensor_parallel",
            r.get("tensor_parallel"), "must be >= 1")
  if "data" in cfg:
    d = cfg.data
    require(d.on_bad_row in ("skip", "error"), "data.on_bad_row", d.on_bad_row,
            "use 'skip' (count and warn) or 'error' (stop with the row number)")
  if "grpo" in cfg:
    g = cfg.grpo
    grpo_config(cfg)
    require(g.num_prompts >= 1, "grpo.num_prompts", g.num_prompts, "must be >= 1")
    require(g.n >= 2, "grpo.n", g.n, "GRPO needs >= 2 responses per prompt to compare")
    require(g.micro_batch >= 1, "grpo.micro_batch", g.micro_batch, "must be >= 1")
    require(g.micro_batch_tokens >= 0, "grpo.micro_batch_tokens", g.micro_batch_tokens,
            "must be >= 0 (0 = fixed micro_batch rows)")
    rows = g.num_prompts * g.n
    most = -(-rows // g.micro_batch) if not g.micro_batch_tokens else rows
    require(1 <= g.minibatches <= most, "grpo.minibatches", g.minibatches,
            f"must be between 1 and the number of micro-batches per step ({most})")
    require(g.pad_multiple >= 1, "grpo.pad_multiple", g.pad_multiple, "must be >= 1")
  if "optim" in cfg:
    o = cfg.optim
    require(o.lr > 0, "optim.lr", o.lr, "must be > 0")
    require(o.schedule in ("constant", "cosine"), "optim.schedule", o.schedule,
            "use 'constant' (after warm-up) or 'cosine'")
    require(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
  if "distributed" in cfg:
    from tlt_jax.distributed import from_config
    from_config(cfg)
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
    spec_config(cfg)
    selector(cfg)
    spec_gate(cfg)
    d = cfg.tlt.drafter
    spot_config(cfg)
    buffer_config(cfg)
    require(d.lr > 0, "tlt.drafter.lr", d.lr,
            "must be > 0 (to keep the drafter fixed set tlt.drafter.mode=off)")
    require(d.warmup_steps >= 0, "tlt.drafter.warmup_steps", d.warmup_steps, "must be >= 0")
    require(d.unroll >= 1, "tlt.drafter.unroll", d.unroll, "must be >= 1 (1 = plain EAGLE)")
    require(d.rows >= 1, "tlt.drafter.rows", d.rows, "must be >= 1")
    require(d.row_len >= d.window, "tlt.drafter.row_len", d.row_len,
            f"must be >= tlt.drafter.window ({d.window}): a packed row holds whole windows")
