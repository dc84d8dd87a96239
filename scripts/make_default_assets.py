#!/usr/bin/env python
"""Reproduces the task assets in tlt_jax/assets/<task>/ (CPU, no downloads).

    python scripts/make_default_assets.py                  # the default: ~5-10 min, 2-core CPU
    python scripts/make_default_assets.py --task longtail  # the long-tail variant

--task picks the chain-length distribution (tlt_jax/data/arith.py TASKS): `default`, the
embedded task of configs/default.py, or `longtail`, the same task with reasoning RL's length
shape at a 512-token cap (configs/longtail.py; its packed SFT rows and evaluation cap are
longer). The drafter beside the model is scripts/train_drafter.py's (--model <task>/model).

Writes
  data/train.jsonl   RL prompts (+ `response`, the reference trace, for SFT / analysis)
  data/test.jsonl    held-out evaluation prompts
  model/             tokenizer + cold-start Qwen2 model, loadable as-is by
                     transformers.AutoModelForCausalLM / AutoTokenizer and tlt_jax.models.hf_io
  manifest.json      task parameters, seeds, length quantiles, model size, accuracy

Steps
  1. generate train/test splits of the multi-step arithmetic task (tlt_jax.data.arith);
  2. train a tiny BPE tokenizer (digits split individually, ~25 tokens) and check its round trip;
  3. cold-start SFT of a ~1M-parameter Qwen2 model (tlt_jax.models) on prompt + reference trace
     + EOS, loss on response tokens only, with sequences packed into fixed-size rows; every
     `--eval_every` steps greedy accuracy is measured on a validation set (its own seed, not
     the test split) and training stops once it reaches `--target_acc`, so the checkpoint is
     deliberately MIDDLING (short chains mostly right, long chains mostly wrong): room for RL;
  4. save via tlt_jax.models.hf_io, reload with transformers, compare logits against ours, and
     print the report (test accuracy overall and by chain length, length quantiles, sizes).

Everything is seeded; on the same software stack the run reproduces the same assets (the
stopping rule is step-based; `--time_budget` is only a safety net that would make the result
machine-dependent if it ever triggers).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tlt_jax.config import asset_path  # noqa: E402
from tlt_jax.data import arith  # noqa: E402
from tlt_jax.drafter.buffer import Window  # noqa: E402
from tlt_jax.drafter.packing import fill_batch  # noqa: E402
from tlt_jax.models import (ModelConfig, forward, init_params,  # noqa: E402
                            num_params, segment_causal_mask)
from tlt_jax.models.hf_io import load_hf_model, save_hf_model  # noqa: E402
from tlt_jax.optim import lr_schedule, make_optimizer  # noqa: E402
from tlt_jax.rollout.config import EngineConfig  # noqa: E402
from tlt_jax.rollout.engine import Engine
from tlt_jax.rollout.records import Request  # noqa: E402
from tlt_jax.rollout.sampling import SamplingParams  # noqa: E402

# Fixed seeds of every random stream (distinct so splits never share a generator).
TRAIN_SEED, TEST_SEED, SFT_SEED, VAL_SEED, INIT_SEED = 1, 2, 3, 4, 0
BUCKETS = {"default": ((2, 3), (4, 6), (7, 11), (12, 18), (19, arith.K_MAX)),
           "longtail": ((2, 3), (4, 6), (7, 11), (12, 18), (19, 40),
                        (41, arith.LONGTAIL.k_max))}
# per task: packed SFT row length (examples longer than it are not drawn), evaluation cap
TASK_DEFAULTS = {"default": {"seq_len": 512, "max_new_tokens": 256},
                 "longtail": {"seq_len": 640, "max_new_tokens": 512}}
CONTEXT = {"default": 512, "longtail": 1024}  # the model's and tokenizer's stated max length


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--task", default="default", choices=sorted(arith.TASKS))
  p.add_argument("--out", default=None, help="default: tlt_jax/assets/<task>")
  p.add_argument("--n_train", type=int, default=4000)
  p.add_argument("--n_test", type=int, default=400)
  p.add_argument("--n_val", type=int, default=256)
  # model
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv_heads", type=int, default=2)
  p.add_argument("--vocab_size", type=int, default=32, help="model vocab (>= tokenizer's)")
  # SFT
  p.add_argument("--rows", type=int, default=8, help="packed rows per batch")
  p.add_argument("--seq_len", type=int, default=0, help="tokens per packed row (0: the "
                 "task's, TASK_DEFAULTS)")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--warmup", type=int, default=50)
  p.add_argument("--max_steps", type=int, default=800, help="cosine schedule length and cap")
  p.add_argument("--time_budget", type=float, default=3600.0, help="seconds; safety net")
  p.add_argument("--eval_every", type=int, default=25)
  p.add_argument("--min_steps", type=int, default=150)
  p.add_argument("--target_acc", type=float, default=0.40,
                 help="stop SFT once greedy validation accuracy reaches this")
  p.add_argument("--log_every", type=int, default=10)
  p.add_argument("--max_new_tokens", type=int, default=0, help="evaluation cap (0: the task's)")
  args = p.parse_args(argv)
  args.out = args.out or asset_path(args.task)
  for k, v in TASK_DEFAULTS[args.task].items():
    if not getattr(args, k):
      setattr(args, k, v)
  return args


# ------------------------------------------------------------------------------------- data
def write_jsonl(path, rows, fields):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps({k: r[k] for k in fields}) + "\n")


def quantiles(lengths):
  a = np.asarray(lengths)
  return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
          "p99": float(np.percentile(a, 99)), "max": int(a.max()), "mean": float(a.mean())}


def sft_examples(tok, eos_id, rng, n, seq_len, lengths=arith.DEFAULT):
  """n fresh SFT examples as packable sequences (tlt_jax/drafter/packing.py packs them, the
  same segment-id layout the drafter trains on): prompt + response + EOS, the loss mask on
  the positions whose NEXT token is a response token (incl. EOS). Examples longer than
  seq_len are drawn again."""
  out = []
  while len(out) < n:
    prob = arith.make_problem(rng, lengths=lengths)
    p = tok.encode(prob["prompt"]).ids
    ids = np.asarray(p + tok.encode(prob["response"]).ids + [eos_id], np.int32)
    if len(ids) > seq_len:  # (the long-tail task's longest ~1%: SFT never shows them)
      continue
    mask = np.zeros(len(ids), np.float32)
    mask[len(p) - 1:len(ids) - 1] = 1.0  # logits at t predict token t+1
    out.append(Window(step=0, tokens=ids, hidden=None, loss_mask=mask, weight=1.0))
  return out


def sft_batch(tok, eos_id, rng, rows, seq_len, lengths=arith.DEFAULT):
  """[rows, seq_len] tokens, positions, segment ids, loss mask of freshly drawn examples
  (the data is an endless synthetic stream: an example that does not fit is simply not used)."""
  b, _ = fill_batch(lambda n: sft_examples(tok, eos_id, rng, n, seq_len, lengths), rows,
                    seq_len)
  return b["tokens"], b["positions"], b["segment_ids"], b["loss_mask"]


# ------------------------------------------------------------------------------------- SFT
def make_train_step(cfg, optimizer):
  def loss_fn(params, tokens, positions, segs, loss_mask):
    mask = segment_causal_mask(segs)
    logits = forward(params, tokens, positions, cfg=cfg, attn_mask=mask).logits
    targets = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * loss_mask) / jnp.maximum(jnp.sum(loss_mask), 1.0)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, tokens, positions, segs, loss_mask):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, positions, segs, loss_mask)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads)

  return step


# --------------------------------------------------------------- the script's own eval helper
def make_greedy_decode(cfg, eos_id, max_new, k_max=arith.K_MAX):
  """Greedy decoding through the project's rollout engine. One worker is reused across the
  periodic evaluations (new params each time), so each batch bucket compiles once."""
  ecfg = EngineConfig(max_batch=256, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), chunk_size=32,
                      max_prompt_len=2 * k_max + 8, max_new_tokens=max_new,
                      stop_tokens=(eos_id,))
  holder = {}

  def decode(params, requests):
    if "worker" not in holder:
      holder["worker"] = Engine(params, cfg, ecfg)
    else:
      holder["worker"].set_params(params)
    return holder["worker"].generate(requests, SamplingParams(temperature=0.0))

  return decode


def greedy_responses(decode, params, tok, problems):
  """Greedy response text (cut at EOS, EOS excluded) for each problem."""
  reqs = [Request(tok.encode(p["prompt"]).ids, request_id=i) for i, p in enumerate(problems)]
  out = [""] * len(problems)
  for r in decode(params, reqs):
    ids = r.response_ids.tolist()
    out[r.request_id] = tok.decode(ids[:-1] if r.finish_reason == "stop" else ids)
  return out


def accuracy_report(problems, responses, buckets=BUCKETS["default"]):
  scores = np.array([arith.score(r, p["answer"]) for p, r in zip(problems, responses)])
  ks = np.array([p["num_terms"] for p in problems])
  by_bucket = {}
  for lo, hi in buckets:
    sel = (ks >= lo) & (ks <= hi)
    if sel.any():
      by_bucket[f"{lo}-{hi}"] = {"n": int(sel.sum()), "acc": float(scores[sel].mean())}
  return float(scores.mean()), by_bucket


# ------------------------------------------------------------------------------------- main
def dir_size(path):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None):
  args = parse_args(argv)
  t_start = time.time()
  out_dir = os.path.abspath(args.out)
  data_dir, model_dir = os.path.join(out_dir, "data"), os.path.join(out_dir, "model")
  os.makedirs(data_dir, exist_ok=True)

  # 1. data ---------------------------------------------------------------------------------
  lengths, buckets = arith.TASKS[args.task], BUCKETS[args.task]
  train = arith.generate_dataset(args.n_train, TRAIN_SEED, lengths)
  test = arith.generate_dataset(args.n_test, TEST_SEED, lengths)
  val = arith.generate_dataset(args.n_val, VAL_SEED, lengths)
  for p in train + test:
    assert arith.check_trace(p["prompt"], p["response"]), p
  write_jsonl(os.path.join(data_dir, "train.jsonl"), train,
              ("prompt", "answer", "num_terms", "response"))
  write_jsonl(os.path.join(data_dir, "test.jsonl"), test, ("prompt", "answer", "num_terms"))

  # 2. tokenizer ----------------------------------------------------------------------------
  tok = arith.train_tokenizer(p["prompt"] + p["response"] for p in train)
  hf_tok = arith.wrap_tokenizer(tok, CONTEXT[args.task])
  eos_id, pad_id = hf_tok.eos_token_id, hf_tok.pad_token_id
  if tok.get_vocab_size() > args.vocab_size:
    raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens > --vocab_size")
  for p in train + test:
    text = p["prompt"] + p["response"]
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text, text
    assert tok.encode(p["prompt"]).ids + tok.encode(p["response"]).ids == ids, text
  resp_len = [len(tok.encode(p["response"]).ids) + 1 for p in train]  # + EOS
  prompt_len = [len(tok.encode(p["prompt"]).ids) for p in train]
  len_q = quantiles(resp_len)
  print(f"tokenizer: {tok.get_vocab_size()} tokens {sorted(tok.get_vocab(), key=tok.token_to_id)}")
  print(f"example: {train[0]['prompt']!r} -> {train[0]['response']!r}")
  print("train response length (tokens incl. EOS): "
        + " ".join(f"{k}={v:.0f}" for k, v in len_q.items())
        + f"; prompt p50={np.median(prompt_len):.0f} max={max(prompt_len)}")

  # 3. SFT ----------------------------------------------------------------------------------
  cfg = ModelConfig(arch="qwen2", vocab_size=args.vocab_size, hidden_size=args.hidden,
                    intermediate_size=4 * args.hidden, num_layers=args.layers,
                    num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=None,
                    rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True,
                    tie_word_embeddings=True, max_position_embeddings=CONTEXT[args.task],
                    dtype="float32", param_dtype="float32")
  n_params = num_params(cfg)
  print(f"model: qwen2 {args.layers}L d={args.hidden} heads={args.heads}/{args.kv_heads} "
        f"vocab={args.vocab_size}: {n_params / 1e6:.2f}M params")
  params = init_params(cfg, jax.random.key(INIT_SEED))
  opt = dict(warmup_steps=args.warmup, total_steps=args.max_steps, schedule="cosine")
  sched = lr_schedule(args.lr, **opt)
  optimizer = make_optimizer(args.lr, b2=0.98, **opt)
  opt_state = optimizer.init(params)
  step_fn = make_train_step(cfg, optimizer)
  decode = make_greedy_decode(cfg, eos_id, args.max_new_tokens, lengths.k_max)
  sft_rng = np.random.default_rng(SFT_SEED)

  history = []
  t0 = time.time()
  val_acc, step = 0.0, 0
  bar = tqdm(range(1, args.max_steps + 1), desc="SFT", dynamic_ncols=True)
  losses = []
  for step in bar:
    batch = sft_batch(tok, eos_id, sft_rng, args.rows, args.seq_len, lengths)
    params, opt_state, loss, gnorm = step_fn(params, opt_state, *map(jnp.asarray, batch))
    losses.append(float(loss))
    bar.set_postfix(loss=f"{losses[-1]:.3f}", val_acc=f"{val_acc:.2f}")
    if step % args.log_every == 0:
      tqdm.write(f"step {step:5d} loss {np.mean(losses[-args.log_every:]):.4f} "
                 f"gnorm {float(gnorm):.3f} lr {float(sched(step)):.2e} "
                 f"{time.time() - t0:.0f}s")
    if step >= args.min_steps and step % args.eval_every == 0:
      val_acc, by_bucket = accuracy_report(val, greedy_responses(decode, params, tok, val),
                                           buckets)
      history.append({"step": step, "loss": float(np.mean(losses[-args.eval_every:])),
                      "val_acc": val_acc})
      tqdm.write(f"step {step:5d} val greedy acc {val_acc:.3f} "
                 + " ".join(f"k{b}:{v['acc']:.2f}" for b, v in by_bucket.items()))
      if val_acc >= args.target_acc:
        tqdm.write(f"reached target accuracy {args.target_acc} at step {step}: stopping")
        break
    if time.time() - t0 > args.time_budget:
      tqdm.write(f"time budget {args.time_budget}s exhausted at step {step}: stopping")
      break
  bar.close()
  sft_seconds = time.time() - t0

  # 4. save + verify ------------------------------------------------------------------------
  if os.path.exists(model_dir):
    shutil.rmtree(model_dir)
  gen_cfg = {"eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False,
             "max_new_tokens": args.max_new_tokens}
  save_hf_model(params, cfg, model_dir,
                extra_config={"eos_token_id": eos_id, "pad_token_id": pad_id,
                              "bos_token_id": None},
                generation_config=gen_cfg)
  hf_tok.save_pretrained(model_dir)
  logits_diff, hf_text = verify_checkpoint(model_dir, cfg, params, tok, test + train, eos_id,
                                          pad_id)

  responses = greedy_responses(decode, params, tok, test)
  hf_agree = sum(a == b for a, b in zip(hf_text, responses))
  test_acc, test_buckets = accuracy_report(test, responses, buckets)
  correct_traces = float(np.mean([arith.check_trace(p["prompt"], r)
                                  for p, r in zip(test, responses)]))
  gen_len = quantiles([len(tok.encode(r).ids) + 1 for r in responses])

  manifest = {
      "task": {"name": "arith", "variant": args.task, "module": "tlt_jax.data.arith",
               "k_min": arith.K_MIN, "k_max": lengths.k_max, "lognormal_mu": lengths.mu,
               "lognormal_sigma": lengths.sigma,
               "example": {"prompt": train[0]["prompt"], "response": train[0]["response"],
                           "answer": train[0]["answer"]}},
      "seeds": {"train": TRAIN_SEED, "test": TEST_SEED, "sft": SFT_SEED, "val": VAL_SEED,
                "init": INIT_SEED},
      "data": {"n_train": len(train), "n_test": len(test),
               "train_response_tokens": len_q,
               "train_prompt_tokens": quantiles(prompt_len)},
      "tokenizer": {"vocab_size": tok.get_vocab_size(), "eos_token_id": eos_id,
                    "pad_token_id": pad_id},
      "model": {"num_params": n_params, **cfg.to_hf_dict()},
      "sft": {"steps": step, "rows": args.rows, "seq_len": args.seq_len, "lr": args.lr,
              "warmup": args.warmup, "max_steps": args.max_steps,
              "target_acc": args.target_acc, "history": history},
      "eval": {"split": "test", "decoding": "greedy", "accuracy": test_acc,
               "by_num_terms": test_buckets, "fully_correct_traces": correct_traces,
               "generated_tokens": gen_len},
  }
  with open(os.path.join(out_dir, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=2)

  # 5. report -------------------------------------------------------------------------------
  sizes = {name: dir_size(os.path.join(out_dir, name)) if os.path.isdir(
      os.path.join(out_dir, name)) else os.path.getsize(os.path.join(out_dir, name))
      for name in sorted(os.listdir(out_dir))}
  print("\n" + "=" * 72)
  print(f"task      : {train[0]['prompt']!r} -> {train[0]['response']!r}")
  print("resp len  : " + " ".join(f"{k}={v:.0f}" for k, v in len_q.items())
        + " tokens (train, incl. EOS)")
  print(f"model     : {n_params / 1e6:.2f}M params, SFT {step} steps in {sft_seconds:.0f}s "
        f"(total script {time.time() - t_start:.0f}s)")
  print(f"test acc  : {test_acc:.3f} greedy on {len(test)} prompts "
        f"(fully correct traces {correct_traces:.3f})")
  for b, v in test_buckets.items():
    print(f"  k={b:>6}: acc {v['acc']:.3f}  (n={v['n']})")
  print("gen len   : " + " ".join(f"{k}={v:.0f}" for k, v in gen_len.items()))
  print(f"verify    : transformers loads model/ as is; max |logits diff| vs tlt_jax "
        f"{logits_diff:.2e}; HF greedy generate == ours on {hf_agree}/{len(hf_text)} prompts")
  for name, size in sizes.items():
    print(f"size      : {name:<14} {size / 1e6:7.3f} MB")
  print(f"size      : total          {dir_size(out_dir) / 1e6:7.3f} MB")
  return manifest


def verify_checkpoint(model_dir, cfg, params, tok, problems, eos_id, pad_id):
  """Reloads the saved model with tlt_jax and transformers; compares params and logits."""
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  cfg2, params2 = load_hf_model(model_dir)
  assert cfg2.to_hf_dict() == cfg.to_hf_dict(), (cfg2, cfg)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  hf_tok = AutoTokenizer.from_pretrained(model_dir)
  for p in problems:  # transformers' tokenizer == ours, and round-trips
    t = p["prompt"] + p["response"]
    ids = hf_tok(t)["input_ids"]
    assert ids == tok.encode(t).ids and hf_tok.decode(ids) == t, t
  texts = [p["prompt"] + p["response"] for p in problems[:16]]
  assert hf_tok.eos_token_id == eos_id and hf_tok.pad_token_id == pad_id
  enc = hf_tok(texts, padding=True, return_tensors="np")
  ids, am = enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(bool)

  model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  with torch.no_grad():
    ref = model(input_ids=torch.tensor(ids, dtype=torch.long),
                attention_mask=torch.tensor(am, dtype=torch.long)).logits.numpy()
  positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
  ours = np.asarray(forward(params, jnp.asarray(ids), jnp.asarray(positions), cfg=cfg).logits)
  diff = float(np.abs(ref - ours)[am].max())
  assert diff < 1e-3, f"transformers vs tlt_jax logits differ by {diff}"

  # transformers' own greedy generate, one prompt at a time (no padding), for comparison
  # with the script's decoder.
  hf_text = []
  for p in problems[:8]:
    penc = hf_tok(p["prompt"], return_tensors="pt")
    with torch.no_grad():
      gen = model.generate(**penc, do_sample=False, max_new_tokens=256,
                           eos_token_id=eos_id, pad_token_id=pad_id)
    hf_text.append(hf_tok.decode(gen[0, penc["input_ids"].shape[1]:], skip_special_tokens=True))
  return diff, hf_text


if __name__ == "__main__":
  main()
