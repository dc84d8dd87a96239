#!/usr/bin/env python
"""Offline warm-up of an EAGLE drafter on the target model's own generations.

    python scripts/train_drafter.py --model tlt_jax/assets/default/model \
        --out tlt_jax/assets/default/drafter [--data train.jsonl --num_prompts 512 \
        --num_samples 2 --temperature 1.0 --steps 600 --batch 8 --seq_len 512 --unroll 2 \
        --lr 3e-4 --seed 0 --eval_prompts 64]

Steps
  1. Generate: the target samples `--num_samples` responses per prompt at the RL temperature
     through the project's rollout engine (`Engine`, `capture_hidden=True`), which
     returns for every response token the post-norm hidden state that produced it. The prompt
     part's hidden states come from one batched target `forward` over the (short) prompts.
     Training sequences = prompt + response with a hidden state per position and the loss
     mask on the positions whose hidden state produced a response token
     (tlt_jax/drafter/loss.py documents the convention); they are packed into fixed
     [--seq_len] rows (segment ids keep sequences apart). The generations are cached in
     --ckpt_dir, so a re-run (resume) does not regenerate them.
  2. Train `drafter_loss` (EAGLE loss, `--unroll` steps of training-time test) with AdamW
     (b1 0.9, b2 0.95, wd 0.01), global-norm clip 1.0, linear warm-up + cosine decay, by the
     one jitted drafter train step (tlt_jax/drafter/train_step.py, the RL loop's too), state
     donated; tqdm progress; metrics to <out>/metrics.jsonl; Orbax
     checkpoints of {params, opt_state, step} (the drafter's trainable params only; the
     target's embedding / head are never copied) in --ckpt_dir through
     tlt_jax.checkpoint.Checkpointer. Re-running the same command resumes from the newest
     checkpoint.
  3. Evaluate on held-out prompts (the test split next to --data) generated GREEDILY by the
     target: top-1 accuracy of the first draft token against the target's argmax, and the
     expected acceptance length of a greedy chain of depth --chain_depth (mean number of
     consecutive correct drafts when the drafter runs on its own outputs, from every response
     position). Printed and written to <out>/eval.json.
  4. Save the drafter with `save_drafter` (<out>/drafter.safetensors + drafter_config.json,
     reloaded by `tlt_jax.drafter.load_drafter(out, cfg)`) and `export_eagle` (<out>/eagle/:
     EAGLE-1/2 layout for SGLang/vLLM, in their convention: tlt_jax/drafter/model.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tlt_jax.drafter import (LossConfig, accept_lengths, chain_drafts,  # noqa: E402
                             export_eagle, init_drafter, save_drafter)
from tlt_jax.drafter import train_step as dts  # noqa: E402
from tlt_jax.drafter.buffer import Window, align  # noqa: E402
from tlt_jax.drafter.packing import pack  # noqa: E402
from tlt_jax.drafter.model import target_signature  # noqa: E402
from tlt_jax.metrics import keep_steps_upto  # noqa: E402
from tlt_jax.models import compute_logits, sequence_hidden  # noqa: E402
from tlt_jax.optim import lr_schedule, make_optimizer  # noqa: E402
from tlt_jax.rollout.scheduler import buckets_upto  # noqa: E402

CACHE_VERSION = 1


class UserError(ValueError):
  pass


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", required=True, help="target: local HF model directory")
  p.add_argument("--out", required=True, help="output directory (drafter, export, metrics)")
  p.add_argument("--data", default=None,
                 help="JSONL/Parquet prompts (default: <model>/../data/train.jsonl)")
  p.add_argument("--eval_data", default=None,
                 help="held-out prompts (default: test.jsonl next to --data; else the last "
                      "--eval_prompts rows of --data, which are then not trained on)")
  p.add_argument("--prompt_key", default="prompt")
  p.add_argument("--num_prompts", type=int, default=512, help="0 = all rows")
  p.add_argument("--num_samples", type=int, default=2, help="generations per prompt")
  p.add_argument("--temperature", type=float, default=1.0, help="RL sampling temperature")
  p.add_argument("--top_p", type=float, default=1.0)
  p.add_argument("--top_k", type=int, default=0)
  p.add_argument("--max_new_tokens", type=int, default=256)
  p.add_argument("--gen_batch", type=int, default=64, help="rollout engine max batch")
  p.add_argument("--steps", type=int, default=600)
  p.add_argument("--batch", type=int, default=8, help="packed rows per step")
  p.add_argument("--seq_len", type=int, default=512, help="tokens per packed row")
  p.add_argument("--unroll", type=int, default=2, help="training-time-test steps (1 = EAGLE)")
  p.add_argument("--step_decay", type=float, default=0.8)
  p.add_argument("--w_v", type=float, default=1.0)
  p.add_argument("--w_p", type=float, default=0.1)
  p.add_argument("--lr", type=float, default=3e-4)
  p.add_argument("--warmup", type=int, default=None, help="default: 5%% of --steps")
  p.add_argument("--weight_decay", type=float, default=0.01)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--eval_prompts", type=int, default=64)
  p.add_argument("--eval_temperature", type=float, default=0.0,
                 help="held-out generations (0 = greedy: the acceptance estimate is exact)")
  p.add_argument("--chain_depth", type=int, default=4)
  p.add_argument("--ckpt_dir", default=None, help="default: <out>/checkpoints")
  p.add_argument("--save_every", type=int, default=200)
  p.add_argument("--log_every", type=int, default=10)
  p.add_argument("--engine", default="sglang", choices=["sglang", "vllm"],
                 help="serving engine the EAGLE export names its architecture for")
  a = p.parse_args(argv)
  for name in ("num_samples", "steps", "batch", "seq_len", "unroll", "max_new_tokens",
               "gen_batch", "chain_depth", "save_every", "log_every"):
    if getattr(a, name) < 1:
      p.error(f"--{name} must be >= 1")
  if a.num_prompts < 0 or a.eval_prompts < 0:
    p.error("--num_prompts / --eval_prompts must be >= 0")
  if a.temperature < 0 or a.eval_temperature < 0:
    p.error("temperatures must be >= 0 (0 = greedy)")
  return a


# ------------------------------------------------------------------------------------- data
def read_prompts(path, tokenizer, prompt_key):
  from tlt_jax.data.prompts import load_prompt_rows
  rows, stats = load_prompt_rows(path, prompt_key=prompt_key)
  if stats.bad_rows:
    print(f"warning: skipped {stats.bad_rows} malformed rows of {path} ({stats.first_bad})",
          file=sys.stderr)
  if not rows:
    raise UserError(f"{path}: no usable prompts")
  return [list(tokenizer.encode(r.prompt)) for r in rows]


def resolve_data(args):
  data = args.data or os.path.join(os.path.dirname(os.path.abspath(args.model)), "data",
                                   "train.jsonl")
  if not os.path.exists(data):
    raise UserError(f"--data {data}: no such file (pass --data with a JSONL of prompts)")
  eval_data = args.eval_data
  if eval_data is None:
    sibling = os.path.join(os.path.dirname(os.path.abspath(data)), "test.jsonl")
    eval_data = sibling if os.path.exists(sibling) and os.path.abspath(sibling) != \
        os.path.abspath(data) else None
  elif not os.path.exists(eval_data):
    raise UserError(f"--eval_data {eval_data}: no such file")
  return data, eval_data


def make_prompt_hidden_fn(cfg):
  def prompt_hidden(params, prompts, batch=64, bucket=16):
    """[P_i, D] post-norm hidden states of each prompt (one causal forward per batch)."""
    return [np.asarray(h, np.float32)
            for h in sequence_hidden(params, prompts, cfg=cfg, batch=batch, multiple=bucket)]

  return prompt_hidden


def generate_sequences(worker, params, prompt_hidden, prompts, *, num_samples, sp, seed, desc):
  """Target generations -> sequences {tokens [T], hidden [T, D], loss_mask [T]}."""
  from tlt_jax.rollout.records import EngineHooks, Request
  requests = [Request(p, request_id=i, sample_index=s)
              for i, p in enumerate(prompts) for s in range(num_samples)]
  bar = tqdm(total=len(requests), desc=desc, unit="sample", file=sys.stderr)
  t0 = time.perf_counter()
  results = worker.generate(requests, sp, seed=seed,
                            hooks=EngineHooks(on_result=lambda _: bar.update(1)))
  bar.close()
  wall = time.perf_counter() - t0
  results.sort(key=lambda r: (r.request_id, r.sample_index))
  seqs = rollout_sequences(results, prompt_hidden(params, prompts))
  tokens = sum(len(r.response_ids) for r in results)
  print(f"{desc}: {len(results)} samples, {tokens} response tokens in {wall:.1f}s "
        f"({tokens / max(wall, 1e-9):.0f} tokens/s)", file=sys.stderr)
  return seqs


def rollout_sequences(results, ph):
  """Rollout results (hidden captured) + per-prompt hidden states ph[request_id] [P, D] ->
  sequences {tokens [T], hidden [T, D], loss_mask [T], prompt_len}: prompt + response
  aligned by the one alignment of tlt_jax/drafter/buffer.py (f_{T-1} after the last token
  was never computed: 0, and never a target)."""
  seqs = []
  for r in results:
    if r.hidden is None or len(r.hidden) != len(r.response_ids):
      raise RuntimeError("the rollout engine returned no hidden states (capture_hidden)")
    tokens, hidden, mask = align(r.response_ids, np.asarray(r.hidden, np.float32),
                                 r.prompt_ids, ph[r.request_id])
    seqs.append({"tokens": tokens, "hidden": hidden, "loss_mask": mask,
                 "prompt_len": len(r.prompt_ids)})
  return seqs


def _save_seqs(path, seqs, meta):
  lens = np.asarray([len(s["tokens"]) for s in seqs], np.int64)
  np.savez(path + ".tmp.npz", meta=json.dumps(meta), lens=lens,
           prompt_lens=np.asarray([s["prompt_len"] for s in seqs], np.int64),
           tokens=np.concatenate([s["tokens"] for s in seqs]),
           hidden=np.concatenate([s["hidden"] for s in seqs]),
           loss_mask=np.concatenate([s["loss_mask"] for s in seqs]))
  os.replace(path + ".tmp.npz", path)


def _load_seqs(path, meta):
  if not os.path.exists(path):
    return None
  with np.load(path) as z:
    if json.loads(str(z["meta"])) != meta:
      print(f"{path}: generated with other settings; regenerating", file=sys.stderr)
      return None
    ends = np.cumsum(z["lens"])
    starts = ends - z["lens"]
    tok, hid, msk = z["tokens"], z["hidden"], z["loss_mask"]
    return [{"tokens": tok[a:b], "hidden": hid[a:b], "loss_mask": msk[a:b],
             "prompt_len": int(p)} for a, b, p in zip(starts, ends, z["prompt_lens"])]


def pack_sequences(seqs, seq_len, seed):
  """Shuffled sequences packed first-fit into [N, seq_len] rows by tlt_jax/drafter/packing.py
  (segment ids, positions restarting per sequence; longer sequences keep their last seq_len
  tokens)."""
  order = np.random.default_rng([seed, 7]).permutation(len(seqs))
  windows = [Window(0, seqs[i]["tokens"], seqs[i]["hidden"], seqs[i]["loss_mask"], 1.0)
             for i in order]
  return pack(windows, None, seq_len)[0]


def batch_indices(num_rows, batch, step, seed):
  """Rows of step `step`: consecutive slices of per-epoch permutations (resumable)."""
  idx = []
  start = step * batch
  while len(idx) < batch:
    epoch, off = divmod(start + len(idx), num_rows)
    perm = np.random.default_rng([seed, 11, epoch]).permutation(num_rows)
    idx += list(perm[off:off + batch - len(idx)])
  return np.asarray(idx)


# ------------------------------------------------------------------------------- training
def warmup_steps(args):
  warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
  return min(warmup, max(args.steps - 1, 1))


# ----------------------------------------------------------------------------- evaluation
def make_eval_fn(cfg, depth):
  @jax.jit
  def run(dparams, target_params, tokens, hidden, positions):
    drafts, _ = chain_drafts(dparams, target_params, tokens, hidden, positions, cfg=cfg,
                             depth=depth)
    target_top = jnp.argmax(compute_logits(target_params, hidden[:, 1:], cfg), -1)
    return drafts, target_top

  return run


def evaluate(dparams, target_params, seqs, eval_fn, depth, batch=8, bucket=64):
  """Top-1 of draft step 1 vs the target argmax (every position whose target distribution
  sampled a response token) and greedy chain acceptance from every response position."""
  hits = n_top = 0
  accepts = []
  order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]["tokens"]))
  for i in range(0, len(order), batch):
    group = [seqs[j] for j in order[i:i + batch]]
    t = -(-max(len(s["tokens"]) for s in group) // bucket) * bucket
    d = group[0]["hidden"].shape[-1]
    tok = np.zeros((batch, t), np.int32)
    hid = np.zeros((batch, t, d), np.float32)
    msk = np.zeros((batch, t), np.float32)
    lens = np.zeros((batch,), np.int32)
    for j, s in enumerate(group):
      n = len(s["tokens"])
      tok[j, :n], hid[j, :n], msk[j, :n], lens[j] = s["tokens"], s["hidden"], s["loss_mask"], n
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), tok.shape)
    drafts, top = jax.device_get(eval_fn(dparams, target_params, jnp.asarray(tok),
                                         jnp.asarray(hid), jnp.asarray(pos)))
    valid = msk[:, 1:] > 0  # pair t is scored against f_{t+1}, which produced a response token
    hits += int(((drafts[0] == top) & valid).sum())
    n_top += int(valid.sum())
    # a chain starts after the target emitted x_{t+1} (a response token) from f_t
    starts = (msk[:, :-1] > 0) & valid
    acc = np.asarray(accept_lengths(jnp.asarray(drafts), jnp.asarray(tok), jnp.asarray(starts),
                                    jnp.asarray(lens)))
    accepts.append(acc[starts])
  accepts = np.concatenate(accepts) if accepts else np.zeros((0,), np.int32)
  return {"top1_acc": hits / max(n_top, 1), "positions": n_top,
          "chain_depth": depth, "accept_len": float(accepts.mean()) if accepts.size else 0.0,
          "accept_rate_at_depth": [float((accepts >= j).mean()) if accepts.size else 0.0
                                   for j in range(1, depth + 1)],
          "chains": int(accepts.size)}


# ------------------------------------------------------------------------------------ main
def main(argv=None):
  args = parse_args(argv)
  from tlt_jax.checkpoint import Checkpointer
  from tlt_jax.models.hf_io import load_hf_model, read_hf_config
  from tlt_jax.models.tokenizer import load_tokenizer, stop_token_ids
  from tlt_jax.rollout.config import EngineConfig
  from tlt_jax.rollout.engine import Engine
  from tlt_jax.rollout.sampling import SamplingParams

  t_start = time.perf_counter()
  if not os.path.isfile(os.path.join(args.model, "config.json")):  # the model before its data
    raise UserError(f"--model {args.model}: no config.json; pass a local Hugging Face model "
                    "directory")
  data_path, eval_path = resolve_data(args)
  cfg, target = load_hf_model(args.model)
  tokenizer = load_tokenizer(args.model)
  if tokenizer is None:
    raise UserError(f"--model {args.model}: no tokenizer files (tokenizer.json)")
  stop = stop_token_ids(args.model, tokenizer)
  os.makedirs(args.out, exist_ok=True)
  ckpt_dir = os.path.abspath(args.ckpt_dir or os.path.join(args.out, "checkpoints"))
  os.makedirs(ckpt_dir, exist_ok=True)

  prompts = read_prompts(data_path, tokenizer, args.prompt_key)
  if eval_path is not None:
    eval_prompts = read_prompts(eval_path, tokenizer, args.prompt_key)[:args.eval_prompts]
  else:  # hold out the tail of the training file
    if args.eval_prompts >= len(prompts):
      raise UserError(f"--eval_prompts {args.eval_prompts} leaves no training prompts in "
                      f"{data_path} ({len(prompts)} rows); pass --eval_data")
    eval_prompts = prompts[len(prompts) - args.eval_prompts:] if args.eval_prompts else []
    prompts = prompts[:len(prompts) - args.eval_prompts]
  if args.num_prompts:
    prompts = prompts[:args.num_prompts]
  longest = max(len(p) for p in prompts + eval_prompts)
  if longest + args.max_new_tokens > cfg.max_position_embeddings:
    raise UserError(f"a prompt of {longest} tokens + --max_new_tokens {args.max_new_tokens} "
                    f"exceeds the model context ({cfg.max_position_embeddings})")

  # ---- 1. generations (cached for resume)
  model_meta = {"model": os.path.abspath(args.model), "signature": target_signature(cfg),
                "weights_mtime": max(os.path.getmtime(os.path.join(args.model, f))
                                     for f in os.listdir(args.model)
                                     if f.endswith(".safetensors"))}
  gen_meta = {"version": CACHE_VERSION, **json.loads(json.dumps(model_meta)),
              "max_new_tokens": args.max_new_tokens, "seed": args.seed, "stop": list(stop)}
  train_meta = {**gen_meta, "prompts": hashlib.sha1(json.dumps(prompts).encode()).hexdigest(),
                "num_samples": args.num_samples, "temperature": args.temperature,
                "top_p": args.top_p, "top_k": args.top_k}
  eval_meta = {**gen_meta, "prompts": hashlib.sha1(json.dumps(eval_prompts).encode()).hexdigest(),
               "temperature": args.eval_temperature}
  train_cache = os.path.join(ckpt_dir, "generations_train.npz")
  eval_cache = os.path.join(ckpt_dir, "generations_eval.npz")
  train_seqs = _load_seqs(train_cache, train_meta)
  eval_seqs = _load_seqs(eval_cache, eval_meta) if eval_prompts else []
  if train_seqs is None or eval_seqs is None:
    plen = -(-longest // 16) * 16
    ecfg = EngineConfig(max_batch=args.gen_batch, buckets=buckets_upto(args.gen_batch),
                        max_prompt_len=plen, max_new_tokens=args.max_new_tokens,
                        capture_hidden=True, stop_tokens=tuple(stop))
    worker = Engine(target, cfg, ecfg)
    prompt_hidden = make_prompt_hidden_fn(cfg)
    if train_seqs is None:
      sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
      train_seqs = generate_sequences(worker, target, prompt_hidden, prompts,
                                      num_samples=args.num_samples, sp=sp, seed=args.seed,
                                      desc="generate (train)")
      _save_seqs(train_cache, train_seqs, train_meta)
    if eval_seqs is None:
      eval_seqs = generate_sequences(worker, target, prompt_hidden, eval_prompts,
                                     num_samples=1,
                                     sp=SamplingParams(temperature=args.eval_temperature),
                                     seed=args.seed + 1, desc="generate (eval)")
      _save_seqs(eval_cache, eval_seqs, eval_meta)
    del worker
  t_gen = time.perf_counter() - t_start
  data = pack_sequences(train_seqs, args.seq_len, args.seed)
  n_rows = data["tokens"].shape[0]
  resp_tokens = int(sum(s["loss_mask"].sum() for s in train_seqs))
  print(f"data: {len(train_seqs)} sequences ({resp_tokens} response tokens) packed into "
        f"{n_rows} rows of {args.seq_len} ({data['segment_ids'].astype(bool).mean():.0%} "
        f"full); one epoch = {n_rows / args.batch:.1f} steps", file=sys.stderr)

  # ---- 2. training
  loss_cfg = LossConfig(w_v=args.w_v, w_p=args.w_p, unroll_steps=args.unroll,
                        step_decay=args.step_decay)
  schedule = dict(warmup_steps=warmup_steps(args), total_steps=args.steps, schedule="cosine")
  tx = make_optimizer(args.lr, weight_decay=args.weight_decay, **schedule)
  sched = lr_schedule(args.lr, **schedule)
  state = dts.init_state(init_drafter(cfg, jax.random.key(args.seed)), tx)
  ckpt = Checkpointer(os.path.join(ckpt_dir, "train_state"), max_to_keep=2,
                      save_interval_steps=args.save_every)
  start = 0
  if ckpt.latest_step() is not None:
    state = dts.DrafterState(**ckpt.restore(state._asdict()))
    start = int(state.step)
    print(f"resumed from {ckpt.directory} step {start}", file=sys.stderr)
  step_fn = dts.make_train_step(cfg, tx, loss_cfg)
  metrics_path = os.path.join(args.out, "metrics.jsonl")
  # rows logged after the checkpoint we resume from go, and a last line cut short by a kill
  keep_steps_upto(metrics_path, start)
  t_train = time.perf_counter()
  with open(metrics_path, "a") as mf:
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train",
               file=sys.stderr)
    for step in bar:
      idx = batch_indices(n_rows, args.batch, step, args.seed)
      batch = {k: jnp.asarray(v[idx]) for k, v in data.items()}
      state, m = step_fn(state, target, batch)
      done = step + 1
      if done % args.log_every == 0 or done == args.steps:
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        row = {"step": done, "lr": float(sched(step)),
               "elapsed": round(time.perf_counter() - t_train, 2),
               **{k: round(v, 5) for k, v in m.items()}}
        mf.write(json.dumps(row) + "\n")
        mf.flush()
        bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['acc']:.3f}",
                        **({"acc2": f"{m['acc_2']:.3f}"} if "acc_2" in m else {}))
      if done % args.save_every == 0:
        ckpt.save(done, state._asdict())
    bar.close()
  if args.steps > start:
    ckpt.save(args.steps, state._asdict(), force=True)
  ckpt.close()
  t_train = time.perf_counter() - t_train
  params = state.params

  # ---- 3. evaluation
  result = {"args": vars(args), "target": args.model,
            "train_sequences": len(train_seqs), "train_response_tokens": resp_tokens,
            "generation_seconds": round(t_gen, 1), "train_seconds": round(t_train, 1)}
  if eval_seqs:
    ev = evaluate(params, target, eval_seqs, make_eval_fn(cfg, args.chain_depth),
                  args.chain_depth)
    result["eval"] = ev
    curve = " ".join(f"{r:.2f}" for r in ev["accept_rate_at_depth"])
    print(f"held-out ({len(eval_seqs)} greedy generations, {ev['positions']} positions): "
          f"top-1 draft accuracy {ev['top1_acc']:.3f}; greedy chain of depth "
          f"{ev['chain_depth']}: mean accepted drafts {ev['accept_len']:.2f} "
          f"(P(accept >= k) k=1..{ev['chain_depth']}: {curve}; "
          f"{1 + ev['accept_len']:.2f} tokens per target forward incl. the bonus token)")

  # ---- 4. save + export
  save_drafter(args.out, params, cfg)
  export_eagle(os.path.join(args.out, "eagle"), params, cfg,
               target_hf_config=read_hf_config(args.model), engine=args.engine)
  result["total_seconds"] = round(time.perf_counter() - t_start, 1)
  with open(os.path.join(args.out, "eval.json"), "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}/drafter.safetensors, {args.out}/eagle/ and {args.out}/eval.json "
        f"({result['total_seconds']:.0f}s total)")
  return result


def _run():
  from tlt_jax.checkpoint import CheckpointError
  from tlt_jax.data.prompts import DataError
  from tlt_jax.models.hf_io import CheckpointFormatError
  try:
    main()
  except (UserError, DataError, CheckpointFormatError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  _run()
