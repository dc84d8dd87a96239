"""A run's working directory: claimed by one run at a time (`claim`), what a run resumed
from it must share with the one that checkpointed there (`LEARNING_KEYS`, `check_resume`),
its newest checkpoint (`saved_step`) and the config that ran (`write_config`)."""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from typing import Any

import ml_collections

from tlt_jax.data.prompts import split_paths
from tlt_jax.errors import ConfigError

_CLAIM = ".tlt_jax.lock"  # <workdir>/.tlt_jax.lock: who holds the workdir (pid, host, command)
_claimed: dict[str, int] = {}  # realpath -> the open lock file, held to the process's end


def claim(workdir: str) -> None:
  """Holds `workdir` for this process's run until the process ends. A second run given the
  same workdir while the first runs (a job resubmitted, the same command in two terminals)
  stops with one ConfigError naming the first, before it reads or writes anything there:
  without it both restore the same step and write the same steps, and each one's first save
  deletes the other's save in flight. The hold is the kernel's lock (flock) on
  <workdir>/.tlt_jax.lock, released however the process ends (kill -9 included), so it is
  never stale. In a multi-process run process 0 holds it, and every process stops together.
  A filesystem without locks (some network mounts) is said once, and the run goes on."""
  from tlt_jax import distributed
  problem = _hold(workdir) if distributed.is_primary() else None
  problem = next((p for p in distributed.all_gather_objects(problem) if p), None)
  if problem:
    raise ConfigError(problem, "workdir", workdir, in_config=True)


def _hold(workdir: str) -> str | None:
  key = os.path.realpath(workdir)
  if key in _claimed:  # (this process's run again: a notebook's, a test's)
    return None
  path = os.path.join(workdir, _CLAIM)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    try:
      holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
      holder = {}
    os.close(fd)
    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
      print(f"workdir: {workdir} cannot be locked on its filesystem ({e.strerror}): a second "
            "run given it would not be stopped", file=sys.stderr)
      return None
    who = ", ".join(f"{k} {holder[k]}" for k in ("pid", "host", "started") if k in holder)
    return (f"is in use by another run ({who or 'its holder unknown'}"
            + (f": {holder['command']}" if holder.get("command") else "")
            + "): wait for it to end or stop it, or pass another --workdir")
  info = {"pid": os.getpid(), "host": socket.gethostname(),
          "started": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
          "command": " ".join(sys.argv)}
  os.ftruncate(fd, 0)
  os.pwrite(fd, json.dumps(info).encode(), 0)
  _claimed[key] = fd
  return None


# What a run learns. A run resumed from its workdir's checkpoint with one of these changed is
# another experiment on the first one's weights, optimizer and data position: one error, not
# silently (config.train.resume_with_changes=True continues it, the earlier config kept).
# tlt.enabled is not among them: TLT is lossless, so switching it between restarts continues the
# same run (said, check_resume; the drafter is restored where the checkpoint holds one).
LEARNING_KEYS = (
    "seed", "model.path", "model.architecture", "model.dtype", "model.param_dtype",
    "model.lora.rank", "model.lora.alpha", "model.lora.targets", "model.lora.init",
    "data.train_path", "data.train_weights", "data.shuffle", "data.prompt_key", "data.answer_key",
    "data.source_key", "data.max_prompt_len", "data.chat_template", "data.system_prompt",
    "reward.name", "reward.overlong_buffer", "reward.overlong_penalty", "grpo.drop_truncated",
    "grpo.filter_groups", "grpo.gen_prompts", "grpo.max_rollouts",
    "rollout.max_new_tokens", "rollout.temperature", "rollout.top_p", "rollout.top_k",
    "grpo.num_prompts", "grpo.n", "grpo.eps_low", "grpo.eps_high", "grpo.loss_mode",
    "grpo.clip_ratio_c", "grpo.kl_coef", "grpo.kl_loss_type", "grpo.entropy_coef",
    "grpo.rollout_is", "grpo.rollout_is_cap", "grpo.norm_adv_by_std", "grpo.adv_estimator",
    "grpo.loss_agg", "grpo.loss_norm_len", "grpo.minibatches", "grpo.ppo_epochs",
    "optim.lr", "optim.schedule", "optim.warmup_steps", "optim.weight_decay", "optim.b1",
    "optim.b2", "optim.grad_clip")
# Learning keys inert while the setting named is off in both configs (resume continues).
ACTIVE_WHEN = {
    "grpo.max_rollouts": lambda c: c.get("grpo.filter_groups") is True,
    "grpo.loss_norm_len": lambda c: c.get("grpo.loss_agg") == "seq-mean-token-sum-norm",
    "grpo.kl_loss_type": lambda c: (c.get("grpo.kl_coef") or 0) > 0,
    "grpo.rollout_is_cap": lambda c: bool(c.get("grpo.rollout_is")),
    "model.lora.alpha": lambda c: (c.get("model.lora.rank") or 0) > 0,
    "model.lora.targets": lambda c: (c.get("model.lora.rank") or 0) > 0,
    "model.lora.init": lambda c: (c.get("model.lora.rank") or 0) > 0,
}


def saved_step(workdir: str) -> int | None:
  """The newest finished checkpoint step in workdir/checkpoints (Orbax names a save in
  progress with a suffix), or None."""
  d = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(d):
    return None
  return max((int(n) for n in os.listdir(d) if n.isdigit()), default=None)


FILE_LISTS = ("data.train_path", "data.test_path")  # one file, or several comma-separated


def _local_path(key: str, value: Any) -> bool:
  """Whether the config's `key` ("data.train_path") holds a local file or directory it reads."""
  return (isinstance(value, str) and bool(value) and "://" not in value
          and not value.startswith("init:")  # (tlt.drafter.init's other form)
          and (key.endswith("path") or key in ("tlt.drafter.init", "model.lora.init")))


def _absolute(key: str, value: Any, resolve=os.path.abspath) -> Any:
  """`value` with the local file it names made absolute (`resolve`): a path key's (each of
  data.train_path's and test_path's comma-separated files), and reward.name's file form
  'path/to/file.py:function' (relative to the working directory)."""
  if _local_path(key, value):
    if key in FILE_LISTS:
      return ",".join(resolve(p) for p in split_paths(value))
    return resolve(os.path.expanduser(value))
  if key == "reward.name" and isinstance(value, str) and ".py:" in value:
    file, fn = value.rsplit(":", 1)
    return f"{resolve(os.path.expanduser(file))}:{fn}"
  return value


def config_changes(cfg: ml_collections.ConfigDict, keys: tuple[str, ...] = LEARNING_KEYS
                   ) -> list[tuple[str, Any, Any]]:
  """(key, saved, now) for each of `keys` that the run checkpointed in cfg.workdir (its
  config.json) set otherwise, where it acts in either config (ACTIVE_WHEN); [] for a workdir
  with no checkpoint. Paths compare resolved."""
  from tlt_jax.metrics import flatten
  path = os.path.join(cfg.workdir, "config.json")
  if saved_step(cfg.workdir) is None or not os.path.isfile(path):
    return []
  try:
    with open(path, encoding="utf-8") as f:
      saved = flatten(json.load(f), sep=".")
  except (OSError, ValueError) as e:  # (not a run's config: nothing to compare against)
    print(f"{path} is unreadable ({e}); resuming without comparing the configs",
          file=sys.stderr)
    return []
  now = flatten(json.loads(cfg.to_json_best_effort()), sep=".")

  def norm(key, value):
    return _absolute(key, value, os.path.realpath)
  return [(k, saved[k], now.get(k)) for k in keys
          if k in saved and norm(k, saved[k]) != norm(k, now.get(k))
          and (k not in ACTIVE_WHEN or ACTIVE_WHEN[k](saved) or ACTIVE_WHEN[k](now))]


def check_resume(cfg: ml_collections.ConfigDict) -> None:
  """A run that would resume with other LEARNING_KEYS than its checkpoint's: ConfigError,
  unless config.train.resume_with_changes, which says what changed; TLT switched on or off
  (the same learning), said."""
  changes = config_changes(cfg, LEARNING_KEYS + ("tlt.enabled",))
  switched = [c for c in changes if c[0] == "tlt.enabled"]
  changes = [c for c in changes if c[0] != "tlt.enabled"]
  said = "; ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changes)
  if changes and not cfg.train.get("resume_with_changes", False):
    raise ConfigError(
        f"holds a run checkpointed at step {saved_step(cfg.workdir)} that learned with other "
        f"values: {said}; pass a new --workdir (or that run's values), or "
        "--config.train.resume_with_changes=True to continue it with these", "workdir",
        cfg.workdir, in_config=True)
  if changes:
    print(f"resuming with changed values: {said}", file=sys.stderr)
  if switched and cfg.tlt.enabled:
    print("resuming with TLT switched on (lossless: the same learning): the checkpoint holds "
          "no drafter, so it starts as a new run's does (tlt.drafter.init) and learns from "
          "the rollouts that follow; the bandit and the gate learn afresh", file=sys.stderr)
  elif switched:
    print("resuming with TLT switched off (lossless: the same learning): the checkpoint's "
          "drafter is not read (TLT switched back on later starts a new one)", file=sys.stderr)


def write_config(cfg: ml_collections.ConfigDict) -> None:
  """The run's config.json in its workdir; an earlier one that differs (a resumed run given
  other values, more steps included) is kept as config.<step>.json, the step it resumed at
  (config.<step>-<k>.json where that is taken). Its input paths are absolute: the run
  resumed, or exported, from another working directory reads the same files."""
  path = os.path.join(cfg.workdir, "config.json")
  values = json.loads(cfg.to_json_best_effort())

  def absolute(node, prefix=""):
    for k, v in node.items():
      if isinstance(v, dict):
        absolute(v, f"{prefix}{k}.")
      else:
        node[k] = _absolute(prefix + k, v)
  absolute(values)
  text = json.dumps(values, indent=2)
  step = saved_step(cfg.workdir)
  if step is not None and os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      old = f.read()
    if old != text:  # (resumed at one step twice, with two configs: both kept)
      keep = os.path.join(cfg.workdir, f"config.{step}.json")
      k = 1
      while os.path.exists(keep):
        keep, k = os.path.join(cfg.workdir, f"config.{step}-{k}.json"), k + 1
      os.replace(path, keep)
  with open(path + ".tmp", "w", encoding="utf-8") as f:  # (a kill mid-write leaves the old)
    f.write(text)
  os.replace(path + ".tmp", path)
