"""GRPO training with TLT's adaptive rollout: `python -m tlt_jax.train --config configs/X.py`.

  python -m tlt_jax.train --config configs/default.py [--workdir DIR] [--config.key=value ...]
  python -m tlt_jax.train --config configs/default.py --config.tlt.enabled=False   # baseline

One RL step (DESIGN.md 7):
  prompts (PromptStream, resumable position) -> rollout workers (continuous batching; plain
  decode while the batch is large, speculative decoding with the drafter in the long tail)
  -> rewards (process pool, fed as each response finishes) -> group advantages
  -> learner: old/ref log-probs recomputed in micro-batches, clipped-ratio update with
  gradient accumulation (FSDP over the mesh, donated state) -> new params resharded into the
  rollout layout on device -> drafter steps on the policy's hidden states (tlt.enabled).

Output in the workdir: metrics.jsonl (one JSON object per step: time breakdown, reward,
accuracy, lengths, tokens/s, eval results), tb/ (TensorBoard, same scalars), checkpoints/
(async Orbax: actor, optimizer, drafter and its optimizer, step, data position and bandit
state). Re-running the same command resumes from the latest checkpoint; a run killed at any
moment loses at most the steps since that checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any

import numpy as np

from tlt_jax.config import ConfigError

_log = logging.getLogger("tlt_jax.train")


def _seed_for(seed: int, step: int) -> int:
  """Rollout seed of a step: a pure function of (seed, step), so resume needs no RNG state."""
  return int(np.random.default_rng([seed, step, 17]).integers(0, 2**31 - 1))


class MetricsWriter:
  """metrics.jsonl + TensorBoard. On resume, drops JSONL lines and TB events of steps after the
  restored checkpoint (they are recomputed), so the curves have no duplicates."""

  def __init__(self, workdir: str, resume_step: int):
    self.path = os.path.join(workdir, "metrics.jsonl")
    kept = []
    if os.path.exists(self.path):
      with open(self.path) as f:
        for line in f:
          try:
            rec = json.loads(line)
          except json.JSONDecodeError:  # a line cut by a kill
            continue
          if rec.get("step", 0) <= resume_step:
            kept.append(line if line.endswith("\n") else line + "\n")
      with open(self.path + ".tmp", "w") as f:
        f.writelines(kept)
      os.replace(self.path + ".tmp", self.path)
    self._f = open(self.path, "a")
    self._tb = None
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tb"), purge_step=resume_step + 1)
    except ImportError:  # pragma: no cover - tensorboardX is in requirements
      _log.warning("tensorboardX is not installed: TensorBoard logging is off")

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    rec = {"step": step, **metrics}
    self._f.write(json.dumps(rec) + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in _flatten(metrics).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(k, v, step)
      self._tb.flush()

  def close(self) -> None:
    self._f.close()
    if self._tb is not None:
      self._tb.close()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


@dataclasses.dataclass
class StepTimer:
  times: dict[str, float] = dataclasses.field(default_factory=dict)

  def add(self, name: str, seconds: float) -> None:
    self.times[name] = self.times.get(name, 0.0) + seconds


class Trainer:
  """Holds everything one run needs; `run()` is the loop. Built from a validated config."""

  def __init__(self, cfg, *, progress: bool = True):
    import jax

    from tlt_jax import runtime
    from tlt_jax.data.dataset import PromptStream
    from tlt_jax.rl import grpo

    self.cfg = cfg
    self.progress = progress
    self.workdir = cfg.workdir
    os.makedirs(self.workdir, exist_ok=True)
    self.mesh = runtime.make_mesh(cfg)
    self.model_cfg, params, self.tokenizer, self.stop = runtime.load_model(cfg, mesh=self.mesh)
    self.stream = PromptStream(runtime.load_rows(cfg, cfg.data.train_path), self.tokenizer,
                               max_prompt_len=cfg.data.max_prompt_len, seed=cfg.seed,
                               chat_template=cfg.data.chat_template,
                               system_prompt=cfg.data.system_prompt, name="config.data.train_path")
    print(f"data: {len(self.stream)} training prompts from {cfg.data.train_path} "
          f"({self.stream.dropped_long} dropped as longer than max_prompt_len="
          f"{cfg.data.max_prompt_len} tokens)", file=sys.stderr)
    self.test_rows = None
    if cfg.data.test_path and cfg.train.eval_every > 0:
      rows = runtime.load_rows(cfg, cfg.data.test_path)
      self.test_rows = rows[:cfg.eval.num_prompts] if cfg.eval.num_prompts else rows

    g = cfg.grpo
    gcfg = grpo.GRPOConfig(eps_low=g.eps_low, eps_high=g.eps_high, kl_coef=g.kl_coef,
                           temperature=cfg.rollout.temperature, norm_adv_by_std=g.norm_adv_by_std,
                           logit_chunk=g.logit_chunk)
    o = cfg.optim
    tx = grpo.make_optimizer(o.lr, warmup_steps=o.warmup_steps,
                             total_steps=cfg.train.steps * g.minibatches,
                             weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
                             grad_clip=o.grad_clip, schedule=o.schedule)
    self.learner = grpo.Learner(params, self.model_cfg, gcfg, tx, self.mesh,
                                micro_batch=g.micro_batch, pad_multiple=g.pad_multiple,
                                micro_batch_tokens=g.micro_batch_tokens,
                                max_len=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
    del params

    # Drafter + selector (TLT on), else the plain engine: the baseline differs in nothing else.
    self.tlt = bool(cfg.tlt.enabled)
    self.drafter = None
    self.selector = self.eval_selector = None
    dparams = None
    if self.tlt:
      dparams = runtime.load_drafter(cfg, self.model_cfg)
      from tlt_jax.drafter.online import OnlineDrafterTrainer
      if cfg.tlt.drafter_steps > 0:
        self.drafter = OnlineDrafterTrainer(dparams, self.model_cfg, lr=cfg.tlt.drafter_lr,
                                            mesh=self.mesh)
      self.selector = runtime.make_selector(cfg)
      # Evaluation decodes through the same workers with its OWN selector (same arms): eval
      # chunks must not move the training bandit's reward windows (or its checkpoint).
      self.eval_selector = runtime.make_selector(cfg)
    self.workers = runtime.make_workers(cfg, self.model_cfg, self.learner.params, self.stop,
                                        drafter_params=dparams, selector=self.selector)
    if self.tlt and cfg.tlt.spec.precompile:
      t = time.perf_counter()
      n = sum(w.precompile(self._sampling()) for w in self.workers)
      print(f"precompiled {n} speculative executables in {time.perf_counter() - t:.0f}s",
            file=sys.stderr)
    self.step = 0
    from tlt_jax.checkpoint import Checkpointer
    self.ckpt = Checkpointer(os.path.join(self.workdir, "checkpoints"),
                             max_to_keep=cfg.train.keep_checkpoints,
                             save_interval_steps=cfg.train.checkpoint_every)
    self._jax = jax

  # ------------------------------------------------------------------------------ state
  def _state(self) -> dict[str, Any]:
    meta = {"data": self.stream.state_dict(),
            "selector": self.selector.state_dict() if hasattr(self.selector, "state_dict")
            else None}
    state = {"actor": self.learner.params, "opt": self.learner.opt_state, "step": self.step,
             "meta": json.dumps(meta)}
    if self.drafter is not None:
      state["drafter"] = self.drafter.params
      state["drafter_opt"] = self.drafter.opt_state
    return state

  def maybe_resume(self) -> int:
    from tlt_jax.checkpoint import CheckpointError
    latest = self.ckpt.latest_step()
    if latest is None:
      return 0
    try:
      st = self.ckpt.restore(self._state())
    except CheckpointError as e:
      raise ConfigError(f"cannot resume from {self.ckpt.directory}: {e} (use a new "
                        "--workdir for a different model or config)") from None
    self.learner.params, self.learner.opt_state = st["actor"], st["opt"]
    self.step = int(st["step"])
    meta = json.loads(st["meta"])
    self.stream.load_state_dict(meta["data"])
    if meta.get("selector") and hasattr(self.selector, "load_state_dict"):
      self.selector.load_state_dict(meta["selector"])
    if self.drafter is not None:
      self.drafter.params, self.drafter.opt_state = st["drafter"], st["drafter_opt"]
      for w in self.workers:
        w.set_drafter_params(self.drafter.params)
    self.learner.sync_to(self.workers)
    print(f"resumed from {self.ckpt.directory} at step {self.step}", file=sys.stderr)
    return self.step

  # ------------------------------------------------------------------------------- pieces
  def _sampling(self):
    from tlt_jax.rollout.sampling import SamplingParams
    r = self.cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)

  def rollout(self, prompts, pool, timer: StepTimer):
    from tlt_jax.rollout.engine import Request, WorkerHooks, run_workers
    n = self.cfg.grpo.n
    sp = self._sampling()
    requests = [Request(p.ids, request_id=i, sample_index=s)
                for i, p in enumerate(prompts) for s in range(n)]
    idle_at: dict[int, float] = {}
    chunks = []

    def on_result(res):  # score while the long tail is still decoding
      text = self.tokenizer.decode(res.response_ids, skip_special_tokens=True)
      pool.submit((res.request_id, res.sample_index), text, prompts[res.request_id].row.answer)

    hooks = WorkerHooks(on_result=on_result, on_chunk=chunks.append,
                        on_idle=lambda wid, t: idle_at.__setitem__(wid, t))
    t0 = time.perf_counter()
    results = run_workers(self.workers, requests, sp, seed=_seed_for(self.cfg.seed, self.step),
                          hooks=hooks)
    wall = time.perf_counter() - t0
    timer.add("rollout", wall)
    # Worker idle time: a worker whose share finished early waits for the slowest one.
    idle = sum(max(wall - t, 0.0) for t in idle_at.values()) / max(len(self.workers), 1)
    timer.add("idle", idle)
    t1 = time.perf_counter()
    rewards = pool.gather([(res.request_id, res.sample_index) for res in results])
    timer.add("reward_wait", time.perf_counter() - t1)
    return results, rewards, chunks, wall

  def train_step(self, pool) -> dict[str, Any]:
    from tlt_jax.eval import length_stats
    from tlt_jax.rl import grpo
    from tlt_jax.rollout.engine import tokens_per_verification
    cfg = self.cfg
    timer = StepTimer()
    t_step = time.perf_counter()
    prompts = self.stream.next_batch(cfg.grpo.num_prompts)
    results, rewards, chunks, wall = self.rollout(prompts, pool, timer)

    n = cfg.grpo.n
    r = np.zeros((len(prompts), n), np.float32)
    for res in results:
      r[res.request_id, res.sample_index] = rewards[(res.request_id, res.sample_index)]
    adv = grpo.group_advantages(r, eps=cfg.grpo.adv_eps, norm_by_std=cfg.grpo.norm_adv_by_std)
    samples = [grpo.Sample(res.prompt_ids, res.response_ids,
                           float(adv[res.request_id, res.sample_index])) for res in results]

    t = time.perf_counter()
    minibatches = self.learner.batches(samples, cfg.grpo.minibatches,
                                       seed=_seed_for(cfg.seed, self.step))
    mbs = [mb for group in minibatches for mb in group]
    self.learner.logprobs(mbs, with_hidden=self.drafter is not None)
    self._jax.block_until_ready([mb["old_logp"] for mb in mbs])
    timer.add("logprobs", time.perf_counter() - t)

    t = time.perf_counter()
    upd = self.learner.update(minibatches)
    timer.add("update", time.perf_counter() - t)

    timer.add("weight_sync", self.learner.sync_to(self.workers))

    drafter_metrics = {}
    if self.drafter is not None:
      t = time.perf_counter()
      drafter_metrics = self.drafter_work(mbs)
      timer.add("drafter", time.perf_counter() - t)

    lengths = [res.num_tokens for res in results]
    tokens = int(sum(lengths))
    spec_chunks = [c for c in chunks if c.mode != "plain"]
    m: dict[str, Any] = {
        "reward": float(r.mean()),
        "accuracy": float((r >= 1.0).mean()),
        "solved_groups": float((r.max(axis=1) >= 1.0).mean()),
        "zero_adv_groups": float((r.std(axis=1) == 0).mean()),
        "response_length": length_stats(lengths),
        "truncated": float(np.mean([res.finish_reason == "length" for res in results])),
        "rollout_tokens_per_s": tokens / max(wall, 1e-9),
        "tokens": tokens,
        "loss": upd,
        "reward_stats": dataclasses.asdict(pool.stats),
        "epoch": self.stream.epoch,
    }
    sources = {p.row.source for p in prompts if p.row.source is not None}
    if sources:
      m["accuracy_by_source"] = {
          str(src): float(np.mean([r[i] >= 1.0 for i, p in enumerate(prompts)
                                   if p.row.source == src])) for src in sorted(sources, key=str)}
    if spec_chunks:
      arms: dict[str, int] = {}
      for c in spec_chunks:
        arms[c.mode] = arms.get(c.mode, 0) + 1
      m["spec"] = {"chunks": len(spec_chunks), "arm_chunks": arms,
                   "tokens_per_verify": tokens_per_verification(spec_chunks) or 0.0,
                   "share_of_tokens": sum(c.tokens for c in spec_chunks) / max(tokens, 1),
                   # Which verification ran ("pallas" kernel or "jnp" reference; a kernel
                   # that failed to compile fell back, see the run's log).
                   "verify_path": sorted({w.verify_path for w in self.workers}),
                   "kernel_fallbacks": sum(w.kernel_error is not None for w in self.workers)}
    if drafter_metrics:
      m["drafter"] = drafter_metrics
    timer.add("total", time.perf_counter() - t_step)
    m["time"] = timer.times
    return m

  def drafter_work(self, mbs) -> dict[str, float]:
    """tlt.drafter_steps drafter updates cycling over this step's micro-batches."""
    steps = self.cfg.tlt.drafter_steps
    out = []
    for i in range(steps):
      mb = mbs[i % len(mbs)]
      out.append(self.drafter.step(self.learner.params, mb["tokens_dev"], mb["hidden"],
                                   mb["loss_mask"]))
    for w in self.workers:
      w.set_drafter_params(self.drafter.params)
    out = self._jax.device_get(out)
    tok = sum(float(o["tokens"]) for o in out)
    return {"loss": float(np.mean([o["loss"] for o in out])),
            "acc": sum(float(o["acc"]) * float(o["tokens"]) for o in out) / max(tok, 1.0),
            "steps": steps}

  def evaluate(self, pool) -> dict[str, Any]:
    from tlt_jax.eval import evaluate

    def score(text, answer):
      key = ("eval", id(text))
      pool.submit(key, text, answer)
      return pool.gather([key])[key]

    d = self.cfg.data
    m = evaluate(self.workers[0], self.tokenizer, self.test_rows, score, seed=self.cfg.seed,
                 progress=False, chat_template=d.chat_template, system_prompt=d.system_prompt,
                 selector=self.eval_selector)
    return {k: v for k, v in m.items() if k in ("accuracy", "accuracy_by_terms",
                                                 "response_length", "tokens_per_second")}

  # --------------------------------------------------------------------------------- loop
  def run(self) -> dict[str, Any]:
    from tlt_jax.rl.reward_pool import RewardError, RewardPool
    cfg = self.cfg
    start = self.maybe_resume()
    if start >= cfg.train.steps:
      print(f"{self.workdir} already holds a finished run ({start} of {cfg.train.steps} steps); "
            "raise --config.train.steps to continue it or pass a new --workdir",
            file=sys.stderr)
    writer = MetricsWriter(self.workdir, start if start > 0 else -1)
    try:
      pool = RewardPool(cfg.reward.name, num_workers=cfg.reward.num_workers,
                        timeout=cfg.reward.timeout)
    except RewardError as e:
      raise ConfigError(str(e)) from None
    bar = None
    if self.progress:
      from tqdm import tqdm
      bar = tqdm(total=cfg.train.steps, initial=start, desc="train", unit="step",
                 file=sys.stderr, dynamic_ncols=True)
    last: dict[str, Any] = {}
    try:
      with pool:
        if start == 0 and self.test_rows is not None:
          t = time.perf_counter()
          ev = self.evaluate(pool)
          writer.write(0, {"eval": ev, "time": {"eval": time.perf_counter() - t}})
          print(f"step 0: held-out accuracy {ev['accuracy']:.3f}", file=sys.stderr)
        while self.step < cfg.train.steps:
          m = self.train_step(pool)
          self.step += 1
          if self.test_rows is not None and (self.step % cfg.train.eval_every == 0
                                             or self.step == cfg.train.steps):
            t = time.perf_counter()
            m["eval"] = self.evaluate(pool)
            m["time"]["eval"] = time.perf_counter() - t
          t = time.perf_counter()
          self.ckpt.save(self.step, self._state(), force=self.step == cfg.train.steps)
          m["time"]["checkpoint"] = time.perf_counter() - t
          writer.write(self.step, m)
          last = m
          if bar is not None:
            post = {"reward": f"{m['reward']:.3f}", "len": f"{m['response_length']['mean']:.0f}",
                    "s/step": f"{m['time']['total']:.1f}"}
            if "eval" in m:
              post["eval_acc"] = f"{m['eval']['accuracy']:.3f}"
            bar.set_postfix(post)
            bar.update(1)
      self.ckpt.wait_until_finished()
    finally:
      if bar is not None:
        bar.close()
      writer.close()
      self.ckpt.close()
    return last


def main(argv):
  del argv
  from absl import logging as absl_logging

  from tlt_jax import runtime
  absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save at INFO
  cfg = _CONFIG.value
  if _WORKDIR.value:
    with cfg.unlocked():
      cfg.workdir = _WORKDIR.value
  runtime.validate(cfg)
  trainer = Trainer(cfg)
  os.makedirs(cfg.workdir, exist_ok=True)
  with open(os.path.join(cfg.workdir, "config.json"), "w") as f:
    f.write(cfg.to_json_best_effort(indent=2))
  last = trainer.run()
  path = os.path.join(cfg.workdir, "metrics.jsonl")
  first_eval = last_eval = None
  with open(path) as f:
    for line in f:
      rec = json.loads(line)
      if "eval" in rec:
        first_eval = first_eval if first_eval is not None else rec["eval"]["accuracy"]
        last_eval = rec["eval"]["accuracy"]
  msg = f"done: {trainer.step} steps"
  if first_eval is not None:
    msg += f"; held-out accuracy {first_eval:.3f} -> {last_eval:.3f}"
  if last:
    msg += f"; last step reward {last['reward']:.3f}"
  print(f"{msg}; metrics in {path}", file=sys.stderr)


if __name__ == "__main__":
  from absl import app, flags
  from ml_collections import config_flags

  from tlt_jax.config import flags_parser
  from tlt_jax.runtime import exit_on_user_error
  _CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
  _WORKDIR = flags.DEFINE_string("workdir", None, "overrides config.workdir")
  app.run(exit_on_user_error(main), flags_parser=flags_parser)
