"""Shared start-up for the entry points (eval, train): run spec -> meshes, model, data.

Each helper turns a user mistake (missing model dir, unsupported checkpoint, bad data file,
bad value) into one ConfigError line instead of a traceback from deep inside a library.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from typing import Any, Sequence

import ml_collections

from tlt_jax import memory, workdir
from tlt_jax.config import RunSpec, asset_path
from tlt_jax.errors import ConfigError, output_dir_problem
from tlt_jax.models.config import ModelConfig
from tlt_jax.sharding import make_mesh


def setup_jax(cfg: ml_collections.ConfigDict) -> None:
  """Process-wide JAX settings from the config; must run before JAX initialises its backends.

  cpu_devices: exposes that many CPU devices (XLA's host device count) so each rollout worker
    of a CPU-only run has its own; it changes only the CPU platform, so on an accelerator host
    it is harmless. An explicit device count in XLA_FLAGS wins.
  compilation_cache: a directory for JAX's persistent compilation cache: a second run of the
    same config (or a resumed one) loads its executables instead of compiling them.

  A learner (mesh.devices) or a replica (rollout.tensor_parallel) over several of those CPU
  devices also gets XLA's CPU execution pool doubled (NPROC, unless set): XLA sizes it at one
  thread per device, and the sharded learner's collectives deadlocked in it (one partition
  held two threads: tests/conftest.py, scripts/stress_cpu_collectives.py). Not otherwise:
  the default run's learner is one device, and twice the threads made it 1.9% slower (16
  steps in lockstep, NPROC 4 vs 2, 2026-12-02).
  """
  n = int(cfg.get("cpu_devices", 0) or 0)
  flags = os.environ.get("XLA_FLAGS", "")
  if n > 0 and "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
  learner = int(cfg.get("mesh", {}).get("devices", 1) or n)  # (0: all of them)
  widest = max(min(learner, n), int(cfg.get("rollout", {}).get("tensor_parallel", 1) or 1))
  if n > 1 and widest > 1 and "NPROC" not in os.environ:
    os.environ["NPROC"] = str(max(os.cpu_count() or 1, 2 * n))
  cache = cfg.get("compilation_cache", "")
  if cache:
    import jax
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache))
    # Every executable, not only the slow ones: the engine holds dozens of sub-second ones.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def prepare(spec: RunSpec, *, training: bool = True) -> RunSpec:
  """The run spec checked against this machine: paths and the reward; with `training`, also
  the learner mesh, the rollout workers' devices and the memory plan (evaluation uses one
  device and none of them); then the workdir made. Returns the spec with rollout.max_batch and
  kv_pages as the memory plan sized them. After distributed.initialize: the meshes count every
  process's devices."""
  cfg = spec.cfg
  if not os.path.isdir(cfg.model.path):  # inputs first, then whether this machine fits them
    raise ConfigError("is not a directory; point it at a local Hugging Face model directory "
                      "(config.json + *.safetensors)", "model.path", cfg.model.path,
                      in_config=True)
  if training and not cfg.data.get("train_path"):
    raise ConfigError("is empty; point it at a local JSONL or Parquet file", "data.train_path",
                      "", in_config=True)
  from tlt_jax.data.prompts import split_paths
  files = [(key, path, " (several: comma-separated)") for key in ("train_path", "test_path")
           for path in split_paths(cfg.data.get(key))]
  for key, path, several in files:
    if path and not os.path.isfile(path):
      raise ConfigError(("is a directory" if os.path.isdir(path) else "does not exist")
                        + f"; point it at a local JSONL or Parquet file{several}",
                        f"data.{key}", path, in_config=True)
  init = cfg.tlt.drafter.init  # (checked with TLT off too, as the rest of config.tlt is)
  if not init.startswith("init:") and not os.path.isdir(init):
    raise ConfigError("is not a directory; point it at a drafter saved by "
                      "scripts/train_drafter.py, or use 'init:0' for a fresh drafter",
                      "tlt.drafter.init", init, in_config=True)
  from tlt_jax.rl.reward_pool import RewardError, check_reward
  try:  # in a reward worker, with its start-up deadline, as the run will load it
    check_reward(cfg.reward.name, max(cfg.reward.timeout, 30.0))
  except RewardError as e:
    raise ConfigError(str(e)) from None
  if training:
    resolve_workers(cfg)
    learner_mesh(cfg)
    worker_meshes(cfg)
    plan = resolve(spec, model_config(cfg))
    spec = dataclasses.replace(spec.with_max_batch(plan.max_batch, plan.kv_pages), memory=plan)
  why = output_dir_problem(cfg.workdir)  # last, once the rest holds (made: evaluation's too)
  if why:
    raise ConfigError(f"{why}; pass a directory this user can write (train: --workdir)",
                      "workdir", cfg.workdir, in_config=True)
  if training:
    workdir.claim(cfg.workdir)  # before anything there is read: this check, the restore
    workdir.check_resume(cfg)
  return spec


# ------------------------------------------------------------------- memory at start-up
def local_device() -> str:
  """The memory of this process's first device as a config.memory.device value: the
  allocator's limit on a GPU (XLA_PYTHON_CLIENT_MEM_FRACTION already applied, so the run's
  fraction is 1 of it), or 'cpu' (no fixed limit)."""
  import jax
  dev = jax.local_devices()[0]
  stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  if dev.platform == "cpu" or not stats or "bytes_limit" not in stats:
    return "cpu"
  return f"{stats['bytes_limit'] / memory.GiB:.3f}gib"


def resolve(spec, model_cfg) -> memory.Plan:
  """At start-up: the plan of this run, with rollout.max_batch sized from memory when it is 0
  (Plan.max_batch: the caller runs with it); refuses a plan that does not fit (ConfigError
  naming the knob). The plan is for what this run has: every visible device, and on a GPU its
  allocator's limit (config.memory.device and num_devices are what scripts/plan_memory.py
  plans for elsewhere; on a CPU host config.memory.device still applies, '' = no limit)."""
  device, fraction = local_device(), 1.0  # bytes_limit is already the allocator's share
  if device == "cpu":
    device, fraction = spec.cfg.memory.device or "cpu", spec.cfg.memory.fraction
  kw = dict(device=device, num_devices=memory.visible_devices(), fraction=fraction)
  max_batch, kv_pages = spec.max_batch, None
  if max_batch == 0:
    max_batch, kv_pages = memory.derive_max_batch(spec, model_cfg, **kw)
    print(f"memory: rollout.max_batch={max_batch}, rollout.kv_pages={kv_pages} (sized from "
          f"{device})", file=sys.stderr)
  p = memory.plan(spec, model_cfg, max_batch=max_batch, kv_pages=kv_pages, **kw)
  if spec.cfg.memory.check:
    p.check()
  return p


def learner_mesh(cfg: ml_collections.ConfigDict):
  """The learner's mesh over the visible devices, checked against the values that must
  divide it (a mismatch is a ConfigError naming config.mesh, not an XLA error later)."""
  import jax
  shape = {k: v for k, v in cfg.mesh.items() if k != "devices"}
  n = int(cfg.mesh.get("devices", 0) or 0)
  if n > jax.device_count():
    raise ConfigError(f"only {jax.device_count()} {jax.default_backend()} devices are visible",
                      "mesh.devices", n, in_config=True)
  try:
    mesh = make_mesh(shape, devices=jax.devices()[:n] if n else None)
  except ValueError as e:
    raise ConfigError(f"does not fit the {n or jax.device_count()} {jax.default_backend()} "
                      f"devices it spans: {e}", "mesh", dict(cfg.mesh), in_config=True) from None
  n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
  if cfg.grpo.micro_batch % n_batch:
    raise ConfigError(f"must be a multiple of the mesh's data x fsdp size ({n_batch}, from "
                      f"config.mesh={dict(cfg.mesh)} on {jax.device_count()} devices): rows are "
                      "split over those devices", "grpo.micro_batch", cfg.grpo.micro_batch,
                      in_config=True)
  return mesh


def model_config(cfg: ml_collections.ConfigDict) -> ModelConfig:
  """The ModelConfig of config.model.path's config.json (no weights are read); where that
  directory is not on this machine (planning a cluster run from a laptop), the architecture
  shipped under assets/architectures/ that config.model.architecture names."""
  path = os.path.join(cfg.model.path, "config.json")
  arch = cfg.model.get("architecture", "")
  if not os.path.isfile(path) and arch:
    path = asset_path("architectures", f"{arch}.json")
    if not os.path.isfile(path):
      known = sorted(f[:-5] for f in os.listdir(asset_path("architectures")))
      raise ConfigError(f"is not shipped; use one of {known} or point config.model.path at a "
                        "model directory", "model.architecture", arch, in_config=True)
  if not os.path.isfile(path):
    raise ConfigError("has no config.json; point it at a local Hugging Face model directory "
                      "(or set config.model.architecture)", "model.path", cfg.model.path,
                      in_config=True)
  kw = dict(dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
            remat=bool(cfg.model.get("remat", False)),
            remat_policy=str(cfg.model.get("remat_policy", "full")),
            attention=str(cfg.model.get("attention", "auto")),
            experts=str(cfg.model.get("experts", "auto")))
  if os.path.basename(path) != "config.json":  # a shipped architecture
    with open(path) as f:
      return ModelConfig.from_hf_dict(json.load(f), source=path, **kw)
  from tlt_jax.models.hf_io import CheckpointFormatError, load_hf_config
  try:  # (an unsupported or broken config.json: one line, as the weights' loader says it)
    return load_hf_config(os.path.dirname(path), **kw)
  except CheckpointFormatError as e:
    raise ConfigError(str(e), "model.path", in_config=True) from None


def load_model(cfg: ml_collections.ConfigDict, mesh=None, rows: Sequence[Any] = ()):
  """-> (ModelConfig, params, tokenizer, stop token ids); rows: the prompts it will answer
  (`stop_tokens`)."""
  from tlt_jax.models.hf_io import CheckpointFormatError, load_hf_model
  from tlt_jax.models.tokenizer import load_tokenizer
  # with LoRA the model is frozen and held in the compute dtype (models/lora.py): read it so,
  # never as float32 master weights first
  lora = bool((cfg.model.get("lora") or {}).get("rank", 0))
  try:
    model_cfg, params = load_hf_model(
        cfg.model.path, dtype=cfg.model.dtype,
        param_dtype=cfg.model.dtype if lora else cfg.model.param_dtype, mesh=mesh)
  except CheckpointFormatError as e:
    raise ConfigError(str(e), "model.path", in_config=True) from None
  model_cfg = dataclasses.replace(model_cfg, param_dtype=cfg.model.param_dtype,
                                  remat=bool(cfg.model.get("remat", False)),
                                  remat_policy=str(cfg.model.get("remat_policy", "full")),
                                  attention=str(cfg.model.get("attention", "auto")),
                                  experts=str(cfg.model.get("experts", "auto")))
  if "data" in cfg and "rollout" in cfg:
    longest = int(cfg.data.max_prompt_len) + int(cfg.rollout.max_new_tokens)
    if longest > model_cfg.max_position_embeddings:
      print(f"warning: data.max_prompt_len + rollout.max_new_tokens = {longest} tokens, past "
            f"the {model_cfg.max_position_embeddings} positions of config.model.path's "
            "config.json (max_position_embeddings): the model was not trained that far",
            file=sys.stderr)
  tokenizer = load_tokenizer(cfg.model.path)
  if tokenizer is None:
    raise ConfigError("has no tokenizer files (tokenizer.json / tokenizer_config.json)",
                      "model.path", cfg.model.path, in_config=True)
  return model_cfg, params, tokenizer, stop_tokens(cfg, tokenizer, rows)


def stop_tokens(cfg: ml_collections.ConfigDict, tokenizer, rows: Sequence[Any] = ()
                ) -> tuple[int, ...]:
  """The ids a response stops at: the model's EOS, and the chat template's end-of-turn token
  where prompts are wrapped in the template (data.chat_template, or rows whose prompts are chat
  messages, which always are): a base model's EOS is <|endoftext|>, its turns end with
  <|im_end|>, and a chat response would otherwise run past its turn."""
  from tlt_jax.models.hf_io import CheckpointFormatError
  from tlt_jax.models.tokenizer import stop_token_ids
  chat = bool(cfg.data.get("chat_template", False)) if "data" in cfg else False
  try:
    stop = stop_token_ids(cfg.model.path, tokenizer, chat_template=chat or any(
        isinstance(r.prompt, list) for r in rows))
  except CheckpointFormatError as e:
    raise ConfigError(str(e), "model.path", in_config=True) from None
  if not stop:
    raise ConfigError(
        f"config.model.path={cfg.model.path!r} defines no stop token (no eos_token_id in "
        "generation_config.json, no eos_token in the tokenizer): every response would run to "
        "rollout.max_new_tokens. Set eos_token_id in generation_config.json")
  return stop


def resolve_workers(cfg: ml_collections.ConfigDict) -> int:
  """config.rollout.num_workers = 0 becomes one replica per tensor_parallel visible devices
  (every process's: after distributed.initialize), written back into the config so the run
  records what it used: two on the default's two CPU devices, one on one GPU, eight on eight.
  A pinned count is kept (worker_meshes checks that it fits)."""
  import jax
  r = cfg.rollout
  if r.num_workers == 0:
    n = jax.device_count() // r.tensor_parallel
    if n < 1:
      raise ConfigError(f"needs {r.tensor_parallel} devices per rollout replica; "
                        f"{jax.device_count()} {jax.default_backend()} devices are visible",
                        "rollout.tensor_parallel", r.tensor_parallel, in_config=True)
    r.num_workers = n
  return r.num_workers


def worker_meshes(cfg: ml_collections.ConfigDict):
  """-> (rollout_mesh, [(global worker index, mesh) of this process's workers]).

  The rollout replicas are consecutive groups of rollout.tensor_parallel devices of the global
  device list; `rollout_mesh` (data=replicas, fsdp=1, tensor=tensor_parallel) holds them all,
  so the weight sync is one resharding onto it (params replicated over `data`) and each
  worker's arrays are its rows' shards. A replica must lie within one process (no collective
  crosses processes during rollout): with several processes, each owns the replicas on its
  devices."""
  import jax
  r = cfg.rollout
  devices = jax.devices()
  need, tp = r.num_workers * r.tensor_parallel, r.tensor_parallel
  if need > len(devices):
    raise ConfigError(f"x tensor_parallel={tp} needs {need} devices; {len(devices)} are "
                      "visible", "rollout.num_workers", r.num_workers, in_config=True)
  rollout_mesh = make_mesh({"data": r.num_workers, "tensor": tp}, devices[:need])
  me = jax.process_index()
  local = []
  for i in range(r.num_workers):
    replica = devices[i * tp:(i + 1) * tp]  # row i of rollout_mesh
    owners = {d.process_index for d in replica}
    if len(owners) > 1:
      raise ConfigError(f"rollout replica {i} would span processes; make tensor_parallel "
                        f"divide the devices of one process ({jax.local_device_count()})",
                        "rollout.tensor_parallel", tp, in_config=True)
    if owners == {me}:
      local.append((i, make_mesh({"tensor": tp}, replica)))
  if jax.process_count() > 1 and not local:
    raise ConfigError(f"process {me} owns no rollout replica; use num_workers x "
                      f"tensor_parallel = all {len(devices)} devices", "rollout.num_workers",
                      r.num_workers, in_config=True)
  return rollout_mesh, local


def load_drafter(cfg: ml_collections.ConfigDict, model_cfg):
  """The drafter named by config.tlt.drafter.init (its form checked by config.run_spec, its
  directory by `prepare`): a directory, or 'init:SEED' for a fresh one."""
  import jax

  from tlt_jax.drafter import model as drafter_model
  path = cfg.tlt.drafter.init
  if path.startswith("init:"):
    return drafter_model.init_drafter(model_cfg, jax.random.key(int(path[5:])))
  try:
    return drafter_model.load_drafter(path, model_cfg)
  except drafter_model.DrafterLoadError as e:
    raise ConfigError(str(e), "tlt.drafter.init", in_config=True) from None


def reward_pool(cfg: ml_collections.ConfigDict):
  """The run's RewardPool (the user's reward runs in its worker processes: a call that hangs
  or crashes costs one reward); a reward whose workers cannot start is one ConfigError."""
  from tlt_jax.rl.reward_pool import RewardError, RewardPool
  try:
    return RewardPool(cfg.reward.name, num_workers=cfg.reward.num_workers,
                      timeout=cfg.reward.timeout)
  except RewardError as e:
    raise ConfigError(str(e)) from None


def _data_keys(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
  return dict(prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
              source_key=cfg.data.get("source_key") or None, on_bad_row=cfg.data.on_bad_row)


def load_train_rows(cfg: ml_collections.ConfigDict):
  """The training rows of config.data.train_path: one file, or several comma-separated,
  concatenated in order (each file's rows a source of its own, `data.prompts.load_files`:
  the training accuracy per data set)."""
  return _load_files(cfg, "train_path")


def load_test_rows(cfg: ml_collections.ConfigDict):
  """The held-out rows of config.data.test_path (one file or several, comma-separated: each
  file's rows a source of its own, `data.prompts.load_files`), each file's first
  eval.num_prompts (0: all)."""
  return _load_files(cfg, "test_path", num_prompts=cfg.eval.get("num_prompts", 0))


def _load_files(cfg: ml_collections.ConfigDict, key: str, num_prompts: int = 0):
  from tlt_jax.data.prompts import DataError, load_files, split_paths
  paths = split_paths(cfg.data.get(key))
  if not paths:
    raise ConfigError("is empty; point it at a local JSONL or Parquet file (several: "
                      "comma-separated)", f"data.{key}", cfg.data.get(key, ""), in_config=True)
  try:
    return load_files(paths, num_prompts=num_prompts, key=f"data.{key}", **_data_keys(cfg))
  except DataError as e:
    raise ConfigError(str(e)) from None


def exit_on_user_error(main, also: tuple[type[Exception], ...] = ()):
  """Wraps an absl main (every `python -m tlt_jax.*` command): a ConfigError, DataError,
  CheckpointFormatError, SaveFailed (a full disk), RewardError or the command's own input
  errors (`also`) become one line on stderr and exit status 2 (not a crash; checkpoints
  already written stay); Ctrl-C one line and 130, a stop on SIGTERM (distributed.Stopped) one
  line and 143. absl's INFO lines stay off stderr (JAX's probing, Orbax's every save)."""
  @functools.wraps(main)
  def wrapped(argv):
    from absl import logging as absl_logging

    from tlt_jax.checkpoint import SaveFailed
    from tlt_jax.data.prompts import DataError
    from tlt_jax.models.hf_io import CheckpointFormatError
    from tlt_jax.rl.reward_pool import RewardError
    absl_logging.set_verbosity(absl_logging.WARNING)
    try:
      return main(argv)
    except (ConfigError, DataError, CheckpointFormatError, RewardError, SaveFailed, *also) as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM's stop (distributed.Stopped): no traceback
      print(getattr(e, "verb", "interrupted") + (f" {e}" if e.args else ""), file=sys.stderr)
      sys.exit(getattr(e, "exit_code", 130))
  return wrapped
