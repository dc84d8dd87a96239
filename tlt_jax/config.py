"""Config plumbing: `--config configs/x.py --config.some.key=value` through absl flags, and
the run spec: every typed config of a run, built (so validated) once.

absl + ml_collections report a typo'd override key as a deep AttributeError traceback and a
missing config file as an opaque object; `flags_parser` checks both first and exits with one
line naming the input and the fix.

`run_spec(cfg)` builds each typed config from the section of the same name: a dataclass
field IS the config key (`errors.section_values`), and each dataclass checks its own values
in __post_init__, so a mistake is found in one place and reported under its config key
(errors.build). The entry points (train, eval, scripts) read typed configs from the
RunSpec only; the plain values (paths, learning rates) from `spec.cfg`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import os
import sys
from typing import Any, Callable, Iterable

import ml_collections
from absl import flags

from tlt_jax import export, optim
from tlt_jax.coordinator.spot import SpotConfig
from tlt_jax.launch import DistributedConfig
from tlt_jax.profiling import ProfileConfig
from tlt_jax.drafter.buffer import BufferConfig
from tlt_jax.drafter.model import ENGINES
from tlt_jax.errors import (ConfigError, build, check, check_finite, config_file_mistake,
                            section_values)
from tlt_jax.data.prompts import train_weights
from tlt_jax.memory import device_bytes
from tlt_jax.models.config import ATTENTION_IMPLS, EXPERTS_IMPLS, REMAT_POLICIES
from tlt_jax.models.lora import LoraConfig
from tlt_jax.models.lora import from_settings as lora_settings
from tlt_jax.rl.batching import ROW_LAYOUTS
from tlt_jax.rl.advantages import ADV_ESTIMATORS
from tlt_jax.rl.grpo import GRPOConfig
from tlt_jax.rollout.config import EngineConfig, SpecConfig
from tlt_jax.rollout.policies.cells import Policies
from tlt_jax.rollout.policies.gate import GateConfig, GateState
from tlt_jax.rollout.policies.mab import (BanditState, bandit_config, default_mab_buckets,
                                          parse_buckets)
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.scheduler import buckets_upto
from tlt_jax.rollout.policies.strategy import Strategy
from tlt_jax.sharding import AXES
from tlt_jax.wandb_log import WandbConfig

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# rollout.attention -> EngineConfig.paged_attention (None: paged where the kernel serves the
# replica, EngineConfig.resolve_attention)
ROLLOUT_ATTENTION = {"auto": None, "paged": True, "windows": False}


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
  try:
    return module.get_config(arg) if arg is not None else module.get_config()
  except TypeError as e:  # (a value of another type than the field's: one line)
    mistake = config_file_mistake(e, path)
    if mistake is None:
      raise
    raise mistake from None


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
  except SystemExit as e:  # absl's --help printed the usage and exits 1: asked for, not failed
    helped = {"--help", "-h", "-?", "--helpshort", "--helpfull"} & set(argv[1:])
    sys.exit(0 if helped and e.code == 1 else e.code)



# ---------------------------------------------------------------------------------- run spec
@dataclasses.dataclass(frozen=True, eq=False)
class RunSpec:
  """Every typed config of a run, built once from the locked config (`run_spec`).

  engine: the rollout engine's config for training, without the model's stop tokens (the
    tokenizer's: `engine_config` adds them). Its max_batch is config.rollout.max_batch, or
    while that is 0 (sized from memory at start-up, runtime.prepare) the largest bucket.
  max_batch: config.rollout.max_batch as resolved: 0 until sized from memory.
  speculation, gate, spot, buffer, mab_buckets: None where TLT (or that part of it) is off.
  """
  cfg: ml_collections.ConfigDict  # plain values: paths, learning rates, step counts
  sampling: SamplingParams
  engine: EngineConfig
  grpo: GRPOConfig
  distributed: DistributedConfig
  profile: ProfileConfig
  wandb: WandbConfig
  speculation: SpecConfig | None
  gate: GateConfig | None  # None: disabled, or the fixed selector (pinned, deterministic)
  spot: SpotConfig | None
  buffer: BufferConfig | None  # None: the drafter is not trained
  mab_buckets: dict[int, list[Strategy]] | None  # config.tlt.spec.buckets ({}: the defaults)
  max_batch: int
  _bandit: Callable[..., Any] | None = None
  history: bool = False  # each rollout worker keeps a history index (history arms can draft)
  lora: LoraConfig | None = None  # config.model.lora (None: rank 0, the whole model trained)
  memory: Any = None  # the memory plan runtime.prepare resolved (memory.Plan; None: none yet)

  @property
  def tlt(self) -> bool:
    return self.speculation is not None

  def bandit(self, seed: int | None = None) -> BanditState | None:
    """The fresh state of the speculative-strategy bandit (BEG-MAB by default); None with TLT
    off. Training and evaluation each start from one and keep their own reward windows."""
    if self._bandit is None:
      return None
    return BanditState.fresh(self._bandit(seed=self.cfg.seed if seed is None else seed))

  def policies(self) -> Policies:
    """The rollout policies' states at step 0: a fresh bandit and gate (None where off)."""
    return Policies(self.bandit(), None if self.gate is None else GateState(self.gate))

  def engine_config(self, stop: tuple[int, ...], *, max_batch: int | None = None,
                    speculative: bool = True) -> EngineConfig:
    """`engine` with the model's stop tokens; `max_batch` (e.g. evaluation's batch) cuts the
    buckets again; speculative=False: plain decoding, no hidden states captured."""
    e = self.engine
    if max_batch is not None:
      e = dataclasses.replace(e, max_batch=max_batch,
                              buckets=buckets_upto(max_batch, self.cfg.rollout.buckets))
    if not speculative:
      e = dataclasses.replace(e, spec=None, capture_hidden=False, hidden_keep=0)
    return dataclasses.replace(e, stop_tokens=tuple(stop))

  def with_max_batch(self, max_batch: int, kv_pages: int | None = None) -> RunSpec:
    """This spec with rollout.max_batch (and the KV pool's pages) resolved
    (memory.derive_max_batch's answer)."""
    engine = dataclasses.replace(self.engine, max_batch=max_batch,
                                 buckets=buckets_upto(max_batch, self.cfg.rollout.buckets),
                                 kv_pages=self.engine.kv_pages if kv_pages is None else kv_pages)
    return dataclasses.replace(self, engine=engine, max_batch=max_batch)


def distributed_config(cfg: ml_collections.ConfigDict) -> DistributedConfig:
  """config.distributed (absent: the defaults, "from the environment")."""
  return build(DistributedConfig, "distributed",
               section_values(DistributedConfig, cfg.get("distributed", None) or {}))


def _speculation(cfg: ml_collections.ConfigDict):
  """-> (SpecConfig, GateConfig | None, bandit config factory, mab buckets) of
  config.tlt.spec."""
  s = cfg.tlt.spec
  spec = build(SpecConfig, "tlt.spec", section_values(SpecConfig, s))
  buckets = parse_buckets(s.buckets)
  bandit = functools.partial(bandit_config, s.selector, buckets, strategy=s.strategy,
                             epsilon=s.epsilon, window=s.window, min_pulls=s.min_pulls)
  build(bandit, "tlt.spec", {"seed": cfg.seed})  # validates its arguments, once
  check(isinstance(s.get("history", False), bool), "tlt.spec.history", s.get("history"),
        "True or False")
  # the arms the selector can choose: the named buckets', else the bandit's default grid
  groups = buckets or (default_mab_buckets() if s.selector != "fixed" else {})
  arms = {a for group in groups.values() for a in group} | {spec.strategy}
  hist = sorted(a for a in arms if a.history)
  check(not hist or s.get("history", False), "tlt.spec.history", s.get("history"),
        f"history arms {hist} draft from a history index: set tlt.spec.history=True")
  gate = None
  g = s.get("gate")
  if g is not None and s.selector != "fixed":
    # the probe's first arm is the fixed selector's: its key is tlt.spec.strategy; what a
    # compile must repay is counted in the run's rollouts, one per step and worker (with
    # grpo.filter_groups up to grpo.max_rollouts a step: the gate's clock counts each, so the
    # horizon is the most the run can roll out, not train.steps); disabled, the gate still
    # prices compiles (narrower attention windows) but opens every bucket
    gr = cfg.grpo
    per_step = max(int(gr.get("max_rollouts", 1)), 1) if gr.get("filter_groups") is True else 1
    gate = build(GateConfig, "tlt.spec.gate",
                 {k: v for k, v in section_values(GateConfig, g).items() if k != "gating"},
                 lead=("tlt.spec.strategy", s.strategy),
                 horizon=("train.steps", cfg.train.steps * per_step),
                 gating=("tlt.spec.gate.enabled", bool(g.get("enabled", True))))
  return spec, gate, bandit, buckets


def run_spec(cfg: ml_collections.ConfigDict) -> RunSpec:
  """Every typed config of `cfg`, and the plain values checked, in one pass: the first
  mistake is a ConfigError naming its key. Needs no devices and reads no files (beyond the
  memory.device name); runtime.prepare checks those against this machine."""
  check_finite(cfg)
  check(isinstance(cfg.seed, int) and 0 <= cfg.seed < 2**31, "seed", cfg.seed, "use 0 to 2^31-1")
  m = cfg.model
  check(bool(m.path), "model.path", m.path, "set the local Hugging Face model directory")
  for k in ("dtype", "param_dtype"):
    check(m[k] in ("float32", "bfloat16", "float16"), f"model.{k}", m[k],
          "use float32, bfloat16 or float16")
  check(m.get("remat_policy", "full") in REMAT_POLICIES, "model.remat_policy",
        m.get("remat_policy"), f"use one of {REMAT_POLICIES} (dots: keep the projections' "
        "outputs, recompute the rest)")
  check(m.get("attention", "auto") in ATTENTION_IMPLS, "model.attention", m.get("attention"),
        f"use one of {ATTENTION_IMPLS} (auto: a fused kernel where the backend has one)")
  check(m.get("experts", "auto") in EXPERTS_IMPLS, "model.experts", m.get("experts"),
        f"use one of {EXPERTS_IMPLS} (auto: the grouped-matmul kernel on a GPU, after its "
        "start-up check)")
  check(isinstance(cfg.cpu_devices, int) and cfg.cpu_devices >= 0, "cpu_devices",
        cfg.cpu_devices, "a number of CPU devices to expose, or 0 for JAX's default")
  sizes = [cfg.mesh[a] for a in AXES]
  check(all(isinstance(s, int) and (s > 0 or s == -1) for s in sizes), "mesh", dict(cfg.mesh),
        "axis sizes are positive integers, or -1 on one axis for 'all remaining devices'")
  devices = cfg.mesh.get("devices", 0)
  check(isinstance(devices, int) and devices >= 0, "mesh.devices", devices,
        "the number of devices the learner spans (the first ones), or 0 for all")
  mem = cfg.memory
  check(0 < mem.fraction <= 1, "memory.fraction", mem.fraction,
        "the share of device memory the run may use, in (0, 1]")
  check(isinstance(mem.num_devices, int) and mem.num_devices >= 0, "memory.num_devices",
        mem.num_devices, "the devices to plan for, or 0 for the visible ones")
  device_bytes(mem.device)
  d = cfg.data
  check(d.on_bad_row in ("skip", "error"), "data.on_bad_row", d.on_bad_row,
        "use 'skip' (count and warn) or 'error' (stop with the row number)")
  for k in ("prompt_key", "answer_key", "source_key"):  # source_key "": no sources
    key = d.get(k, "")
    check((k == "source_key" and key == "") or (isinstance(key, str) and all(key.split("."))),
          f"data.{k}", key, "a column name, or a dotted path into nested fields (e.g. "
          "reward_model.ground_truth)")
  _, why = train_weights(d.get("train_weights", ""), d.train_path)
  check(not why, "data.train_weights", d.get("train_weights"), why)

  r = cfg.rollout
  check(isinstance(r.max_batch, int) and r.max_batch >= 0, "rollout.max_batch", r.max_batch,
        "sequences per worker, or 0 to size it from memory")
  check(isinstance(r.num_workers, int) and r.num_workers >= 0, "rollout.num_workers",
        r.num_workers, "rollout replicas, or 0 for one per tensor_parallel visible devices")
  check(isinstance(r.get("mean_live_tokens", 0), int) and r.get("mean_live_tokens", 0) >= 0,
        "rollout.mean_live_tokens", r.get("mean_live_tokens"),
        "the mean row length (prompt + response) to size max_batch = 0 by; 0: the max length")
  check(r.tensor_parallel >= 1, "rollout.tensor_parallel", r.tensor_parallel, "must be >= 1")
  sampling = build(SamplingParams, "rollout", section_values(SamplingParams, r))
  # config.tlt is checked with TLT off too (as the baseline of a TLT run is run): switching it
  # on later must not bring up a mistake made earlier.
  speculation, gate, bandit, mab_buckets = _speculation(cfg)
  dr = cfg.tlt.drafter
  spot = build(SpotConfig, "tlt.drafter", section_values(SpotConfig, dr))
  buffer = build(BufferConfig, "tlt.drafter", section_values(BufferConfig, dr))
  check(not dr.init.startswith("init:") or dr.init[5:].lstrip("-").isdigit(), "tlt.drafter.init",
        dr.init, "use 'init:<integer seed>' for a fresh drafter, or a drafter's directory")
  check(dr.lr > 0, "tlt.drafter.lr", dr.lr,
        "must be > 0 (to keep the drafter fixed set tlt.drafter.mode=off)")
  check(dr.warmup_steps >= 0, "tlt.drafter.warmup_steps", dr.warmup_steps, "must be >= 0")
  check(dr.unroll >= 1, "tlt.drafter.unroll", dr.unroll, "must be >= 1 (1 = plain EAGLE)")
  check(dr.rows >= 1, "tlt.drafter.rows", dr.rows, "must be >= 1")
  check(dr.acceptance_sample >= 0, "tlt.drafter.acceptance_sample", dr.acceptance_sample,
        "must be >= 0 (0: no acceptance metric)")
  check(dr.acceptance_depth >= 1, "tlt.drafter.acceptance_depth", dr.acceptance_depth,
        "must be >= 1")
  if dr.acceptance_sample:
    check(dr.acceptance_response_len >= 1, "tlt.drafter.acceptance_response_len",
          dr.acceptance_response_len, "must be >= 1: the metric reads each sampled sequence "
          "up to data.max_prompt_len + this many tokens")
  check(dr.row_len >= dr.window + dr.context, "tlt.drafter.row_len", dr.row_len,
        f"must be >= tlt.drafter.window + context ({dr.window} + {dr.context}): a packed row "
        "holds whole windows with their context")
  if not cfg.tlt.enabled:
    speculation = gate = bandit = mab_buckets = spot = None
  if spot is None or spot.mode == "off":
    buffer = None
  trained = buffer is not None
  # max_batch 0 is sized from memory at start-up; until then the largest bucket stands in
  max_batch = r.max_batch or max(r.buckets, default=1)
  values = section_values(EngineConfig, r)
  attention = r.get("attention", "auto")
  check(attention in ROLLOUT_ATTENTION, "rollout.attention", attention,
        "must be 'auto' (paged; on a GPU where the kernel passes its start-up check), "
        "'paged' (each row's live pages read in place) or 'windows' (the window's pages gathered)")
  values.update(paged_attention=ROLLOUT_ATTENTION[attention])
  values.update(max_batch=max_batch, spec=speculation, capture_hidden=trained,
                hidden_keep=dr.window * dr.windows_per_response if trained else 0)
  engine = build(EngineConfig, "rollout", values,
                 buckets=("rollout.buckets", buckets_upto(max_batch, r.buckets)),
                 max_prompt_len=("data.max_prompt_len", d.max_prompt_len))

  g = cfg.grpo
  values = section_values(GRPOConfig, g)
  if not values.get("loss_norm_len"):  # 0: the generation budget
    values["loss_norm_len"] = r.max_new_tokens
  grpo = build(GRPOConfig, "grpo", values, temperature=("rollout.temperature", r.temperature))
  check(g.num_prompts >= 1, "grpo.num_prompts", g.num_prompts, "must be >= 1")
  check(g.n >= 2, "grpo.n", g.n, "GRPO needs >= 2 responses per prompt to compare")
  check(g.micro_batch >= 1, "grpo.micro_batch", g.micro_batch, "must be >= 1")
  check(g.micro_batch_tokens >= 0, "grpo.micro_batch_tokens", g.micro_batch_tokens,
        "must be >= 0 (0 = fixed micro_batch rows)")
  check(g.adv_estimator in ADV_ESTIMATORS, "grpo.adv_estimator", g.adv_estimator,
        f"use one of {', '.join(ADV_ESTIMATORS)}")
  check(g.adv_estimator == "grpo" or g.norm_adv_by_std, "grpo.norm_adv_by_std",
        g.norm_adv_by_std, f"False applies to grpo.adv_estimator='grpo' only (Dr. GRPO); "
        f"{g.adv_estimator!r} does not divide by the group's std")
  check(isinstance(g.filter_groups, bool), "grpo.filter_groups", g.filter_groups, "True or False")
  check(g.max_rollouts >= 1, "grpo.max_rollouts", g.max_rollouts,
        "must be >= 1 (rollouts a step at most with grpo.filter_groups; 1: one, filtered)")
  check(g.gen_prompts >= 0, "grpo.gen_prompts", g.gen_prompts,
        "must be >= 0 (prompts a rollout draws with grpo.filter_groups; 0: grpo.num_prompts)")
  check(not g.gen_prompts or g.filter_groups, "grpo.gen_prompts", g.gen_prompts,
        "applies with grpo.filter_groups=True only (without it a step trains on every group "
        "it draws: grpo.num_prompts sets how many); set it to 0 or turn filter_groups on")
  rows = g.num_prompts * g.n
  most = -(-rows // g.micro_batch) if not g.micro_batch_tokens else rows
  check(1 <= g.minibatches <= most, "grpo.minibatches", g.minibatches,
        f"must be between 1 and the number of micro-batches per step ({most})")
  check(g.pad_multiple >= 1, "grpo.pad_multiple", g.pad_multiple, "must be >= 1")
  check(g.row_layout in ROW_LAYOUTS, "grpo.row_layout", g.row_layout,
        f"use one of {', '.join(ROW_LAYOUTS)}")
  check(cfg.model.get("attention", "auto") != "fused" or g.pad_multiple % 16 == 0,
        "grpo.pad_multiple", g.pad_multiple, "must be a multiple of 16 with "
        "model.attention='fused' (the kernel's blocks; rows are pad_multiple x 2^k long)")
  optim.check_config(cfg.optim)
  distributed = distributed_config(cfg)
  profile = build(ProfileConfig, "profile", section_values(ProfileConfig, cfg.get("profile") or {}))
  wandb = build(WandbConfig, "wandb", section_values(WandbConfig, cfg.get("wandb") or {}))
  t = cfg.train
  check(t.steps >= 1, "train.steps", t.steps, "must be >= 1")
  check(t.eval_every >= 0, "train.eval_every", t.eval_every, "must be >= 0 (0 = never)")
  check(t.checkpoint_every >= 1, "train.checkpoint_every", t.checkpoint_every, "must be >= 1")
  check(t.keep_checkpoints >= 1, "train.keep_checkpoints", t.keep_checkpoints, "must be >= 1")
  check(isinstance(t.export_drafter, bool), "train.export_drafter", t.export_drafter,
        "True or False")
  check(t.export_engine in ENGINES, "train.export_engine", t.export_engine,
        f"use one of {list(ENGINES)}")
  check(t.export_policy in export.POLICIES, "train.export_policy", t.export_policy,
        f"use one of {list(export.POLICIES)}: the policy as a Hugging Face folder at the last "
        "checkpoint only, at every checkpoint, or never")
  check(t.export_dtype in ("",) + export.DTYPES, "train.export_dtype", t.export_dtype,
        f"use one of {list(export.DTYPES)}, or '' for the starting model's dtype")
  best = t.export_best
  check(best in ("", "accuracy") or (best.startswith("accuracy:") and len(best) > 9),
        "train.export_best", best, "use 'accuracy' (every held-out prompt's), "
        "'accuracy:<source>' (one test file's, e.g. accuracy:aime24) or '' (none)")
  check(not best or (cfg.data.test_path and t.eval_every > 0), "train.export_best", best,
        "the best policy is chosen by held-out evaluation: set data.test_path and "
        "train.eval_every > 0, or train.export_best=''")
  check(cfg.eval.batch_size >= 1, "eval.batch_size", cfg.eval.batch_size, "must be >= 1")
  check(t.hang_timeout_s >= 0, "train.hang_timeout_s", t.hang_timeout_s,
        "must be >= 0 (seconds without progress before a hung process exits; 0: never)")
  check(t.log_rollouts >= 0, "train.log_rollouts", t.log_rollouts,
        "must be >= 0 (groups of each step's rollout logged; 0: none)")
  check(cfg.eval.log_responses >= 0, "eval.log_responses", cfg.eval.log_responses,
        "must be >= 0 (each source's prompts whose responses are logged; 0: none)")
  e = cfg.eval
  check(e.get("num_prompts", 0) >= 0, "eval.num_prompts", e.get("num_prompts"),
        "must be >= 0 (the first held-out prompts evaluated; 0: all)")
  check(e.n >= 1, "eval.n", e.n, "must be >= 1 (responses per held-out prompt)")
  check(e.temperature >= 0, "eval.temperature", e.temperature, "must be >= 0 (0: greedy)")
  check(0 < e.top_p <= 1, "eval.top_p", e.top_p, "must be in (0, 1] (1: off)")
  check(e.n == 1 or e.temperature > 0, "eval.n", e.n,
        "greedy responses to a prompt are all one: set eval.temperature > 0 to sample them "
        "(e.g. 1.0), or eval.n=1")
  check(cfg.reward.num_workers >= 1, "reward.num_workers", cfg.reward.num_workers, "must be >= 1")
  check(cfg.reward.timeout > 0, "reward.timeout", cfg.reward.timeout, "must be > 0 seconds")
  check(0 <= cfg.reward.overlong_buffer < r.max_new_tokens, "reward.overlong_buffer",
        cfg.reward.overlong_buffer, f"must be in [0, rollout.max_new_tokens={r.max_new_tokens}):"
        " the last tokens of the budget over which the penalty grows (0: off)")
  check(cfg.reward.overlong_penalty >= 0, "reward.overlong_penalty",
        cfg.reward.overlong_penalty, "must be >= 0 (the penalty at the budget)")
  return RunSpec(cfg=cfg, sampling=sampling, engine=engine, grpo=grpo, distributed=distributed,
                 profile=profile, wandb=wandb, speculation=speculation, gate=gate, spot=spot,
                 buffer=buffer, mab_buckets=mab_buckets, max_batch=r.max_batch, _bandit=bandit,
                 history=speculation is not None and bool(cfg.tlt.spec.get("history", False)),
                 lora=lora_config(cfg))


def lora_config(cfg: ml_collections.ConfigDict) -> LoraConfig | None:
  """config.model.lora (absent or rank 0: None, the whole model trained)."""
  lo = cfg.model.get("lora") or {}
  rank, alpha = lo.get("rank", 0), lo.get("alpha", 32.0)
  check(isinstance(rank, int) and rank >= 0, "model.lora.rank", rank,
        "LoRA's rank: a positive integer (8-64 is usual), or 0 to train the whole model")
  if not rank:
    check(not lo.get("init"), "model.lora.init", lo.get("init"),
          "an adapter to start from needs LoRA: set model.lora.rank (the adapter's r)")
    return None
  check(isinstance(alpha, (int, float)) and alpha > 0, "model.lora.alpha", alpha,
        "must be > 0 (the update is scaled by alpha / rank)")
  try:
    return lora_settings(lo)
  except ValueError as e:
    raise ConfigError(str(e), "model.lora.targets", lo.get("targets"), in_config=True) from None
