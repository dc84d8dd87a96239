"""TRL GRPOTrainer baseline for the embedded default task, matched to configs/default.py.

Runs in the separate, jax-free venv made by scripts/bench_trl_setup.sh:

  bash scripts/bench_trl_setup.sh
  .venv-trl/bin/python scripts/bench_trl_grpo.py --out out/trl            # 40 RL steps
  .venv-trl/bin/python scripts/bench_trl_grpo.py --out out/trl_smoke --steps 2 --eval_prompts 16

Writes OUT/trl_metrics.jsonl (one line per RL step, same layout as our trainer's metrics.jsonl:
{"step", "reward", "accuracy", "time": {...}, ...}, with "eval" on the steps that evaluate, and
a {"step": 0, "eval": ...} line before training; "trl_logs" holds TRL's own logged metrics of
the step's optimizer steps: loss, grad_norm, learning_rate, entropy, clip ratios, ...) and
OUT/trl_summary.json (wall/setup time, per-phase totals, the GRPOConfig used, the settings that
differ from ours, versions).

One RL step = one generation batch (32 prompts x 8 completions) = 2 optimizer steps of TRL's
Trainer (each on a random half of the 256 completions).

Per-phase times (per RL step, seconds; perf_counter around TRL's own methods, patched on the
trainer instance, so nothing of TRL's logic changes):
  generate      GRPOTrainer._generate_single_turn: the HF `model.generate` call (sampling of all
                256 completions in one static batch) + EOS masking; ~ our "rollout".
  reward        GRPOTrainer._calculate_rewards (arith.score on 256 decoded completions, in-process).
  logprobs      _get_per_token_logps_and_entropies called inside _generate_and_score_completions:
                the old-policy log-probs of the 256 completions (no grad); = our "logprobs".
  rollout_other rest of _prepare_inputs on generation micro-steps: tokenising, decoding, padding,
                advantages, TRL metric bookkeeping, shuffle/split of the generation batch.
  update_fwd_bwd  Trainer.training_step minus _prepare_inputs: loss forward + backward.
  optimizer     from the end of the last training_step of an optimizer step to on_step_end:
                grad clip + AdamW step + LR-scheduler step + zero_grad + Trainer bookkeeping;
                of which optimizer_grad_clip (Trainer._clip_grad_norm) and optimizer_adamw
                (on_pre_optimizer_step -> on_optimizer_step: the AdamW `step`).
  update        update_fwd_bwd + optimizer; = our "update".
  total         wall time between RL-step boundaries (on_step_end of every 2nd optimizer step),
                excluding held-out evaluation, which is timed separately ("eval"), as ours does.
  other         total - the phases above (data loader, callbacks, TRL's logging).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings

T_START = time.perf_counter()

# No hub access at run time, ever.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# transformers 5.23 renamed gradient_checkpointing -> activation_checkpointing; TRL 1.16 still
# reads the old name internally (harmless, off here).
warnings.filterwarnings("ignore", message=".*is deprecated and will be removed in v6.*",
                        category=FutureWarning)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ASSETS = os.path.join(REPO, "tlt_jax", "assets", "default")

# Our trainer's settings (configs/default.py) that this baseline mirrors.
OURS = {
    "num_prompts": 32, "n": 8, "minibatches": 2, "max_new_tokens": 288, "max_prompt_len": 80,
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "lr": 5e-5, "warmup_steps": 4,
    "schedule": "constant", "b1": 0.9, "b2": 0.99, "adam_eps": 1e-8, "weight_decay": 0.0,
    "grad_clip": 1.0, "eps_low": 0.2, "eps_high": 0.28, "kl_coef": 0.0, "adv_eps": 1e-6,
    "norm_adv_by_std": True, "eval_batch_size": 64,
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default=os.path.join(DEFAULT_ASSETS, "model"))
  p.add_argument("--train", default=os.path.join(DEFAULT_ASSETS, "data", "train.jsonl"))
  p.add_argument("--test", default=os.path.join(DEFAULT_ASSETS, "data", "test.jsonl"))
  p.add_argument("--steps", type=int, default=40, help="RL steps (generation batches)")
  p.add_argument("--out", required=True)
  p.add_argument("--eval_prompts", type=int, default=400, help="first N test prompts; 0 = all")
  p.add_argument("--eval_every", type=int, default=10, help="0 = only before and after")
  p.add_argument("--eval_batch", type=int, default=OURS["eval_batch_size"])
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = all cores")
  p.add_argument("--loss_type", default="bnpo", choices=["bnpo", "dapo"],
                 help="bnpo with one 128-row batch per optimizer step = exact token mean per "
                      "optimizer step (ours); dapo divides by half the generation batch's tokens")
  p.add_argument("--micro_batch", type=int, default=128,
                 help="rows per forward/backward (per_device_train_batch_size); 128 = no "
                      "gradient accumulation, which the exact bnpo match needs")
  return p.parse_args(argv)


def length_stats(lengths):
  import numpy as np
  a = np.asarray(lengths, np.float64)
  if a.size == 0:
    return {}
  return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
          "p90": float(np.percentile(a, 90)), "max": float(a.max())}


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def main(argv=None):
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  threads = args.threads or os.cpu_count() or 1

  import numpy as np
  import torch
  torch.set_num_threads(threads)
  import accelerate
  import datasets
  import tokenizers
  import transformers
  import trl
  from tqdm import tqdm
  from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig,
                            PrinterCallback, TrainerCallback)
  from trl import GRPOConfig, GRPOTrainer

  # numpy only: the TRL venv has tlt_jax installed without its dependencies (no jax)
  from tlt_jax.data import arith
  t_imported = time.perf_counter()

  versions = {"python": platform.python_version(), "torch": torch.__version__,
              "trl": trl.__version__, "transformers": transformers.__version__,
              "accelerate": accelerate.__version__, "datasets": datasets.__version__,
              "tokenizers": tokenizers.__version__, "numpy": np.__version__}

  # ------------------------------------------------------------------ model, tokenizer, data
  tokenizer = AutoTokenizer.from_pretrained(args.model)
  tokenizer.padding_side = "left"
  model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
  eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id

  train_rows = read_jsonl(args.train)
  # TRL 1.16 has no max_prompt_length: drop over-long prompts here, as our PromptStream does.
  kept = [r for r in train_rows if 0 < len(tokenizer.encode(r["prompt"])) <= OURS["max_prompt_len"]]
  dropped_long = len(train_rows) - len(kept)
  # TRL tokenizes text prompts with tokenizer(text=...); ours with tokenizer.encode(prompt).
  for r in kept[:200]:
    assert tokenizer(text=[r["prompt"]])["input_ids"][0] == tokenizer.encode(r["prompt"]), r
  train_ds = datasets.Dataset.from_list(
      [{"prompt": r["prompt"], "answer": str(r["answer"])} for r in kept])
  test_rows = read_jsonl(args.test)
  if args.eval_prompts:
    test_rows = test_rows[:args.eval_prompts]

  opt_steps_per_rl = OURS["minibatches"]
  gen_batch = OURS["num_prompts"] * OURS["n"]
  rows_per_opt = gen_batch // opt_steps_per_rl  # 128
  if rows_per_opt % args.micro_batch:
    raise SystemExit(f"--micro_batch must divide {rows_per_opt}")
  grad_accum = rows_per_opt // args.micro_batch

  cfg_kwargs = dict(
      output_dir=os.path.join(args.out, "trl_trainer"),
      # batch layout: one generation batch of 32 prompts x 8 = 256 completions per RL step,
      # 2 optimizer steps on it (each 128 completions, a random partition), no reuse (mu = 1)
      num_generations=OURS["n"],
      per_device_train_batch_size=args.micro_batch,
      gradient_accumulation_steps=grad_accum,
      steps_per_generation=grad_accum * opt_steps_per_rl,  # => generation_batch_size = 256
      num_iterations=1,
      max_steps=args.steps * opt_steps_per_rl,  # optimizer steps
      # generation
      max_completion_length=OURS["max_new_tokens"],
      temperature=OURS["temperature"], top_p=OURS["top_p"], top_k=OURS["top_k"], min_p=None,
      repetition_penalty=1.0,
      use_vllm=False, use_transformers_continuous_batching=False,
      # loss
      beta=OURS["kl_coef"], epsilon=OURS["eps_low"], epsilon_high=OURS["eps_high"],
      scale_rewards="group", loss_type=args.loss_type, importance_sampling_level="token",
      mask_truncated_completions=False, multi_objective_aggregation="sum_then_normalize",
      # optimizer
      learning_rate=OURS["lr"], lr_scheduler_type="constant_with_warmup",
      warmup_steps=OURS["warmup_steps"], optim="adamw_torch", adam_beta1=OURS["b1"],
      adam_beta2=OURS["b2"], adam_epsilon=OURS["adam_eps"], weight_decay=OURS["weight_decay"],
      max_grad_norm=OURS["grad_clip"],
      # numerics / device
      bf16=False, fp16=False, activation_checkpointing=False, use_cpu=True,
      # data order
      seed=args.seed, data_seed=args.seed, shuffle_dataset=True, remove_unused_columns=False,
      dataloader_num_workers=0,
      # logging / saving
      logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
      log_completions=False,
  )
  config = GRPOConfig(**cfg_kwargs)

  # ------------------------------------------------------------------------------ reward
  gen_stats = []  # one entry per generation batch, filled by the reward function

  def arith_reward(prompts, completions, completion_ids, answer, **kwargs):
    scores = [float(arith.score(c, a)) for c, a in zip(completions, answer)]
    lengths = [len(ids) for ids in completion_ids]
    truncated = [len(ids) >= OURS["max_new_tokens"] and (not ids or ids[-1] != eos_id)
                 for ids in completion_ids]
    r = np.asarray(scores, np.float32).reshape(-1, OURS["n"])
    gen_stats.append({
        "reward": float(r.mean()), "accuracy": float((r >= 1.0).mean()),
        "solved_groups": float((r.max(axis=1) >= 1.0).mean()),
        "zero_adv_groups": float((r.std(axis=1) == 0).mean()),
        "response_length": length_stats(lengths), "truncated": float(np.mean(truncated)),
        "tokens": int(sum(lengths)), "num_completions": len(scores)})
    return scores

  # ------------------------------------------------------------------------------ eval
  def evaluate(m) -> dict:
    was_training = m.training
    m.eval()
    gc = GenerationConfig(do_sample=False, max_new_tokens=OURS["max_new_tokens"],
                          eos_token_id=eos_id, pad_token_id=pad_id, temperature=None,
                          top_p=None, top_k=None)
    scores, lengths, trunc = [], [], 0
    by_terms = {}
    t0 = time.perf_counter()
    with torch.no_grad():
      for s in range(0, len(test_rows), args.eval_batch):
        rows = test_rows[s:s + args.eval_batch]
        ids = [tokenizer.encode(r["prompt"]) for r in rows]
        width = max(len(x) for x in ids)
        inp = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids])
        att = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        out = m.generate(input_ids=inp, attention_mask=att, generation_config=gc)[:, width:]
        for r, row_ids in zip(rows, out.tolist()):
          if eos_id in row_ids:
            row_ids = row_ids[:row_ids.index(eos_id) + 1]
          else:
            trunc += 1
          text = tokenizer.decode(row_ids, skip_special_tokens=True)
          sc = float(arith.score(text, r["answer"]))
          scores.append(sc)
          lengths.append(len(row_ids))
          if "num_terms" in r:
            by_terms.setdefault(int(r["num_terms"]), []).append(sc)
    wall = time.perf_counter() - t0
    if was_training:
      m.train()
    res = {"accuracy": float(np.mean(scores)), "num_prompts": len(scores),
           "response_length": length_stats(lengths), "tokens": int(sum(lengths)),
           "wall_seconds": wall, "tokens_per_second": sum(lengths) / wall if wall > 0 else 0.0,
           "truncated": trunc}
    if by_terms:
      groups = {"2-4 terms": (2, 4), "5-9 terms": (5, 9), "10+ terms": (10, 10**9)}
      res["accuracy_by_terms"] = {
          name: float(np.mean([v for k, vs in by_terms.items() if lo <= k <= hi for v in vs]))
          for name, (lo, hi) in groups.items() if any(lo <= k <= hi for k in by_terms)}
    return res

  # ------------------------------------------------------------------------------ trainer
  trainer = GRPOTrainer(model=model, reward_funcs=arith_reward, args=config,
                        train_dataset=train_ds, processing_class=tokenizer)
  trainer.remove_callback(PrinterCallback)  # TRL's per-log dict printing; we print our own bar
  t_setup_done = time.perf_counter()

  # --- phase timers: wrap TRL's own methods on this instance (behaviour unchanged)
  acc: dict[str, float] = {}
  st = {"in_rollout": False, "last_train_end": None}

  def add(k, v):
    acc[k] = acc.get(k, 0.0) + v

  def timed(name, fn, before=None, after=None):
    def wrapper(*a, **k):
      if before:
        before()
      t = time.perf_counter()
      try:
        return fn(*a, **k)
      finally:
        dt = time.perf_counter() - t
        if after:
          after()
        add(name, dt)
    return wrapper

  trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
  trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
  trainer._generate_and_score_completions = timed(
      "rollout_total", trainer._generate_and_score_completions,
      before=lambda: st.__setitem__("in_rollout", True),
      after=lambda: st.__setitem__("in_rollout", False))
  trainer._prepare_inputs = timed("prepare_inputs", trainer._prepare_inputs)
  _logps = trainer._get_per_token_logps_and_entropies

  def logps(*a, **k):
    if not st["in_rollout"]:
      return _logps(*a, **k)
    t = time.perf_counter()
    try:
      return _logps(*a, **k)
    finally:
      add("logprobs", time.perf_counter() - t)
  trainer._get_per_token_logps_and_entropies = logps
  trainer._clip_grad_norm = timed("grad_clip", trainer._clip_grad_norm)
  trainer.training_step = timed("training_step", trainer.training_step,
                                after=lambda: st.__setitem__("last_train_end",
                                                             time.perf_counter()))

  metrics_path = os.path.join(args.out, "trl_metrics.jsonl")
  mf = open(metrics_path, "w")

  def write(rec):
    mf.write(json.dumps(rec) + "\n")
    mf.flush()

  records = []
  totals: dict[str, float] = {}
  bar = None  # created once the step-0 evaluation has printed

  class StepCallback(TrainerCallback):
    def __init__(self):
      self.t_prev = self.t_begin = self.t_pre_opt = None
      self.logs = []  # TRL's own logs of the current RL step's optimizer steps
      self.pending = None  # RL-step record waiting for TRL's log of its last optimizer step
      self.train_output = None

    def _flush(self):
      if self.pending is not None:
        self.pending["trl_logs"] = self.logs
        self.logs = []
        write(self.pending)
        self.pending = None

    def on_train_begin(self, a, state, control, **kw):
      self.t_prev = self.t_begin = time.perf_counter()

    def on_pre_optimizer_step(self, a, state, control, **kw):
      self.t_pre_opt = time.perf_counter()

    def on_optimizer_step(self, a, state, control, **kw):
      add("adamw", time.perf_counter() - self.t_pre_opt)

    def on_log(self, a, state, control, logs=None, **kw):
      if not logs:
        return
      if "train_runtime" in logs:  # Trainer's end-of-training summary
        self.train_output = dict(logs)
        return
      self.logs.append({"opt_step": state.global_step, **logs})
      if self.pending is not None and state.global_step >= self.pending["step"] * opt_steps_per_rl:
        self._flush()

    def on_train_end(self, a, state, control, **kw):
      self._flush()

    def on_step_end(self, a, state, control, **kw):
      if st["last_train_end"] is not None:
        add("optimizer", time.perf_counter() - st["last_train_end"])
        st["last_train_end"] = None
      if state.global_step % opt_steps_per_rl:
        return
      self._flush()
      now = time.perf_counter()
      step = state.global_step // opt_steps_per_rl
      g = lambda k: acc.get(k, 0.0)  # noqa: E731
      t = {"total": now - self.t_prev, "generate": g("generate"), "reward": g("reward"),
           "logprobs": g("logprobs"),
           "rollout_other": g("prepare_inputs") - g("generate") - g("reward") - g("logprobs"),
           "update_fwd_bwd": g("training_step") - g("prepare_inputs"),
           "optimizer": g("optimizer"), "optimizer_grad_clip": g("grad_clip"),
           "optimizer_adamw": g("adamw")}
      t["update"] = t["update_fwd_bwd"] + t["optimizer"]
      t["other"] = t["total"] - (t["generate"] + t["reward"] + t["logprobs"] + t["rollout_other"]
                                 + t["update"])
      acc.clear()
      gs = gen_stats.pop(0) if gen_stats else {}
      rec = {"step": step, **gs, "time": t}
      if step == args.steps or (args.eval_every and step % args.eval_every == 0):
        te = time.perf_counter()
        rec["eval"] = evaluate(trainer.accelerator.unwrap_model(trainer.model))
        rec["time"]["eval"] = time.perf_counter() - te
      for k, v in t.items():
        totals[k] = totals.get(k, 0.0) + v
      records.append(rec)
      self.pending = rec  # written once TRL has logged this step's last optimizer step
      post = {"reward": f"{gs.get('reward', float('nan')):.3f}",
              "len": f"{gs.get('response_length', {}).get('mean', float('nan')):.0f}",
              "s/step": f"{t['total']:.1f}"}
      if "eval" in rec:
        post["eval_acc"] = f"{rec['eval']['accuracy']:.3f}"
      bar.set_postfix(post)
      bar.update(1)
      self.t_prev = time.perf_counter()  # evaluation is not part of the next step's time

  cb = StepCallback()
  trainer.add_callback(cb)

  # ------------------------------------------------------------------------------ run
  t0 = time.perf_counter()
  ev0 = evaluate(model)
  eval0_time = time.perf_counter() - t0
  write({"step": 0, "eval": ev0, "time": {"eval": eval0_time}})
  print(f"step 0: held-out accuracy {ev0['accuracy']:.3f} on {ev0['num_prompts']} prompts "
        f"({eval0_time:.1f}s)", file=sys.stderr)

  bar = tqdm(total=args.steps, desc="trl grpo", unit="step", file=sys.stderr, dynamic_ncols=True)
  t_train = time.perf_counter()
  trainer.train()
  t_train_done = time.perf_counter()
  bar.close()
  cb._flush()
  mf.close()

  # ------------------------------------------------------------------------------ summary
  step_times = [r["time"]["total"] for r in records]
  evals = [(0, ev0["accuracy"])] + [(r["step"], r["eval"]["accuracy"]) for r in records
                                    if "eval" in r]
  eval_time = eval0_time + sum(r["time"].get("eval", 0.0) for r in records)
  lr_by_opt_step = [(lg["opt_step"], lg.get("learning_rate")) for r in records
                    for lg in r.get("trl_logs", []) if "learning_rate" in lg]
  summary = {
      "steps": len(records),
      "wall_seconds": time.perf_counter() - T_START,
      "setup_seconds": {
          "imports": t_imported - T_START,
          "model_data_trainer": t_setup_done - t_imported,  # model/tokenizer load, data, trainer
          # trainer.train() up to on_train_begin: optimizer/scheduler creation, data loader
          "train_begin": (cb.t_begin - t_train) if cb.t_begin is not None else None,
      },
      "train_seconds": t_train_done - t_train,  # includes in-training evals
      "eval_seconds": eval_time,
      "phase_totals": totals,
      "seconds_per_step": {
          "mean": float(np.mean(step_times)) if step_times else None,
          "mean_after_first": float(np.mean(step_times[1:])) if len(step_times) > 1 else None,
          "first": step_times[0] if step_times else None},
      "eval_accuracy": {"before": ev0["accuracy"], "after": evals[-1][1] if len(evals) > 1
                        else None, "curve": evals, "num_prompts": ev0["num_prompts"]},
      "last_step": {k: records[-1].get(k) for k in ("reward", "accuracy", "response_length")}
      if records else {},
      "learning_rate_by_opt_step": lr_by_opt_step,
      "trl_train_output": cb.train_output,
      "threads": threads,
      "device": "cpu",
      "train_prompts": len(kept), "dropped_long_prompts": dropped_long,
      "grpo_config": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                      for k, v in cfg_kwargs.items()},
      "grpo_config_resolved": {k: getattr(config, k) for k in (
          "generation_batch_size", "steps_per_generation", "gradient_accumulation_steps",
          "per_device_train_batch_size", "scale_rewards", "loss_type", "optim",
          "lr_scheduler_type", "warmup_steps", "bf16", "gradient_checkpointing",
          "pad_to_multiple_of")},
      "ours": OURS,
      "differences": differences(args),
      "versions": versions,
      "model": args.model, "train": args.train, "test": args.test, "seed": args.seed,
  }
  summary["setup_seconds"]["total"] = t_setup_done - T_START
  with open(os.path.join(args.out, "trl_summary.json"), "w") as f:
    json.dump(summary, f, indent=2, default=str)
  sps = summary["seconds_per_step"]
  print(f"done: TRL {trl.__version__} GRPO {len(records)} steps; held-out accuracy "
        f"{ev0['accuracy']:.3f} -> {evals[-1][1]:.3f}; last step reward "
        f"{records[-1]['reward'] if records else float('nan'):.3f}; "
        f"{sps['mean']:.1f} s/step (generate {totals.get('generate', 0) / max(len(records), 1):.1f}"
        f", update {totals.get('update', 0) / max(len(records), 1):.1f}); setup "
        f"{summary['setup_seconds']['total']:.1f}s; wall {summary['wall_seconds']:.0f}s; "
        f"metrics in {metrics_path}", file=sys.stderr)


def differences(args) -> list[str]:
  d = [
      "Rollout engine: HF `model.generate` on all 256 completions as one static batch (finished "
      "rows keep their slot until every row stops or hits 288 tokens; no compaction, buckets or "
      "speculative decoding) vs our JAX rollout engine (compaction, length buckets; TLT drafter "
      "when on).",
      "Advantage eps: TRL hardcodes (r - mean) / (std + 1e-4) (Bessel std, as ours); ours uses "
      "1e-6. With binary rewards and n=8 the smallest non-zero group std is 0.354, so advantages "
      "differ by < 0.03%.",
      "max_prompt_length: not a GRPOConfig field in TRL 1.16; prompts over 80 tokens are dropped "
      "by this script before training (as our PromptStream does; the default data has none).",
      "Data order: TRL's RepeatSampler permutation (torch, seed 0) vs our PromptStream order; same "
      "prompt pool, different sequence of prompts. Sampling RNG (torch vs JAX) differs too.",
      "Mini-batch partition: TRL shuffles the 256 completions (torch RNG) and splits them in two "
      "halves; ours a numpy permutation split in two. Same semantics.",
      "Reward: computed in-process after generation finishes (TRL is synchronous); ours scores in "
      "2 worker processes while the long tail is still decoding.",
      "Micro-batching: TRL runs each 128-row optimizer step as one forward/backward padded to the "
      "longest completion of the generation batch (per_device_train_batch_size=%d, gradient "
      "accumulation %d); ours length-sorted micro-batches of <= 8192 tokens padded to "
      "multiples of 64. Numerically the same loss; different speed."
      % (args.micro_batch, 128 // args.micro_batch),
      "Checkpointing: none in the TRL run (save_strategy='no'); ours saves every 5 steps (timed "
      "outside its per-step 'total').",
      "TRL computes per-token entropy in every loss forward (metric only; ours computes it too).",
      "Held-out eval: HF greedy `generate`, batches of %d left-padded prompts, vs our rollout "
      "worker's greedy decode; same prompts, 288 new tokens, stop at EOS, arith.score."
      % args.eval_batch,
      "Kernels/precision: float32 on both, but torch eager CPU kernels (SDPA attention) vs XLA.",
  ]
  if args.loss_type == "bnpo":
    d.append("Loss aggregation: loss_type='bnpo' with one 128-row batch per optimizer step "
             "(no gradient accumulation) = sum of per-token losses / number of response tokens of "
             "that optimizer step's 128 completions, exactly our token-mean. (TRL's 'dapo', its "
             "DAPO token-mean, divides by half the token count of the whole 256-completion "
             "generation batch instead; run with --loss_type dapo to use it.)")
    if args.micro_batch != 128:
      d.append("With --micro_batch < 128, bnpo normalises each micro-batch by its own token count "
               "and averages micro-batches: no longer the exact token mean.")
  else:
    d.append("Loss aggregation: loss_type='dapo' divides the summed per-token loss of an "
             "optimizer step by half the response tokens of the whole generation batch (an "
             "estimate of that step's count), not by that step's exact count as ours does.")
  return d


if __name__ == "__main__":
  main()
