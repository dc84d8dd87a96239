"""Batched generation from a local Hugging Face model directory.

  python -m tlt_jax.generate --model DIR --prompts prompts.jsonl --output out.jsonl \
      [--num_samples 4 --temperature 0.9 --top_p 0.95 --top_k 50 --max_new_tokens 256 \
       --seed 0 --batch_size 64 --chat --drafter DIR --spec 4_1_5]

Prompt lines: {"prompt": "text"} (tokenized with DIR's tokenizer; with --chat, through its chat
template) or {"prompt_ids": [1, 2, 3]}. --temperature 0 is greedy. One output line per sample:
prompt_index, sample_index, response_ids, text (when DIR has a tokenizer), num_tokens,
finish_reason. A summary (tokens/s, batch-size profile over time) goes to stderr.

--spec takes one arm of the engine's grammar (rollout/policies/strategy.py):
"<steps>_<topk>_<verify>", e.g. 4_1_5 (a chain of 4 drafts, 5 tokens verified) or 3_2_6 (a tree
of depth 3, branching 2, 6 nodes verified); "off" decodes plainly. History arms, "hist_<K>" (a
chain of up to K tokens) and "histtree_<K>_<topk>_<N>", draft from what the other samples of
the same prompt (--num_samples) and the row itself have written (rollout/sources/history.py's
index); without --drafter they run with a freshly initialised drafter, whose catch-up alone
runs. The hybrid "hyb_<K>" verifies the index's chain and the drafter's together. By source:
--spec drafter (4_1_5), --spec history (hist_8), --spec hybrid (hyb_4).
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

from tlt_jax.errors import output_dir_problem

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Local Hugging Face model directory.")
flags.DEFINE_string("prompts", None, "JSONL file of prompts.")
flags.DEFINE_string("output", None, "Output JSONL file.")
flags.DEFINE_integer("num_samples", 1, "Samples per prompt.")
flags.DEFINE_float("temperature", 1.0, "Sampling temperature; 0 = greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = off).")
flags.DEFINE_integer("top_k", 0, "Top-k sampling (0 = off).")
flags.DEFINE_integer("max_new_tokens", 256, "Response length cap.")
flags.DEFINE_integer("seed", 0, "Sampling seed (same seed, same outputs).")
flags.DEFINE_integer("batch_size", 64, "Rows decoded at once.")
flags.DEFINE_integer("chunk_size", 16, "Decode steps between compaction checks.")
flags.DEFINE_bool("compaction", True, "Shrink to the smallest batch bucket as rows finish.")
flags.DEFINE_bool("chat", False, "Apply the tokenizer's chat template to text prompts.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute/param dtype.")
flags.DEFINE_string("drafter", None, "Drafter directory (scripts/train_drafter.py output) or "
                    "init:SEED for a freshly initialised drafter.")
flags.DEFINE_string("spec", "off", "Speculative decoding arm '<steps>_<topk>_<verify_tokens>' "
                    "(e.g. 4_1_5: a chain of 4 drafts; 3_2_6: a tree), 'hist_<steps>', "
                    "'histtree_<steps>_<topk>_<verify_tokens>' (history drafts), 'hyb_<steps>' "
                    "(history + drafter), 'off', or a source: drafter, history, hybrid.")
flags.DEFINE_integer("spec_threshold", 0, "Speculate once the live batch is <= this "
                     "(0 = always).")


class InputError(ValueError):
  pass


# --spec's names for a draft source: the arm each stands for
SPEC_NAMES = {"drafter": "4_1_5", "history": "hist_8", "hybrid": "hyb_4"}


def history_index():
  """The host history index for history arms (imported here: only history arms need it)."""
  try:
    from tlt_jax.rollout.sources.history import HistoryIndex
  except ImportError as e:
    raise InputError(f"--spec hist*: the history index is unavailable ({e})") from None
  return HistoryIndex()


def read_prompts(path: str, tokenizer, *, chat: bool) -> list[list[int]]:
  """Token ids per prompt line; errors name the line and the fix."""
  if not os.path.isfile(path):
    raise InputError(f"--prompts {path}: " + ("is a directory; pass a JSONL file"
                                               if os.path.isdir(path) else "no such file"))
  out = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{n}"
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg})") from None
      if not isinstance(row, dict) or ("prompt" not in row and "prompt_ids" not in row):
        raise InputError(f"{where}: each line needs \"prompt\" (text) or \"prompt_ids\" (ints)")
      if "prompt_ids" in row:
        ids = row["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
          raise InputError(f"{where}: \"prompt_ids\" must be a list of integers")
      else:
        text = row["prompt"]
        if not isinstance(text, str):
          raise InputError(f"{where}: \"prompt\" must be a string")
        if tokenizer is None:
          raise InputError(f"{where}: text prompt, but the model directory has no tokenizer; "
                           "give \"prompt_ids\" instead")
        if chat:
          if not getattr(tokenizer, "chat_template", None):
            raise InputError("--chat: the tokenizer has no chat template")
          ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True, tokenize=True)
          ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        else:
          ids = tokenizer.encode(text)
      if not ids:
        raise InputError(f"{where}: empty prompt")
      out.append((where, list(ids)))
  if not out:
    raise InputError(f"--prompts {path}: no prompts in the file")
  return out


def check_output(path: str) -> None:
  """--output can be written: not a directory, its directory made (an existing file there is
  replaced only once the results are in)."""
  if os.path.isdir(path):
    raise InputError(f"--output {path}: is a directory; pass a file path (JSONL)")
  where = os.path.dirname(os.path.abspath(path))
  why = output_dir_problem(where)
  if why:
    raise InputError(f"--output {path}: its directory {where} {why}")


def batch_profile(chunks, start: float = 0.0, points: int = 8) -> str:
  """'t=0.0s:64 t=1.2s:16 ...': the engine's batch bucket over time, for the summary."""
  if not chunks:
    return ""
  step = max(1, len(chunks) // points)
  picks = chunks[::step] + ([chunks[-1]] if (len(chunks) - 1) % step else [])
  return " ".join(f"t={c.t - start:.1f}s:{c.bucket}({c.live} live)" for c in picks)


def main(argv):
  del argv
  for name in ("model", "prompts", "output"):
    if not getattr(FLAGS, name):
      raise InputError(f"--{name} is required")
  from tlt_jax.models.hf_io import load_hf_model
  from tlt_jax.models.tokenizer import load_tokenizer, stop_token_ids
  from tlt_jax.rollout.config import EngineConfig
  from tlt_jax.rollout.engine import Engine, prompt_problem
  from tlt_jax.rollout.records import EngineHooks, Request, tokens_per_verification
  from tlt_jax.rollout.sampling import SamplingParams
  from tlt_jax.rollout.scheduler import buckets_upto
  from tlt_jax.rollout.policies.strategy import Strategy

  check_output(FLAGS.output)  # before the work, not after it
  sp = SamplingParams(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p)
  if FLAGS.num_samples < 1 or FLAGS.batch_size < 1 or FLAGS.max_new_tokens < 1:
    raise InputError("--num_samples, --batch_size and --max_new_tokens must be >= 1")
  try:
    strategy = Strategy(SPEC_NAMES.get(FLAGS.spec, FLAGS.spec))
  except ValueError as e:
    raise InputError(f"--spec: {e}; or a source: {', '.join(SPEC_NAMES)}") from None
  cfg, params = load_hf_model(FLAGS.model, dtype=FLAGS.dtype, param_dtype=FLAGS.dtype)
  tokenizer = load_tokenizer(FLAGS.model)
  prompts = read_prompts(FLAGS.prompts, tokenizer, chat=FLAGS.chat)
  longest = max(len(ids) for _, ids in prompts)
  max_prompt_len = -(-longest // 16) * 16
  for where, ids in prompts:
    if len(ids) + FLAGS.max_new_tokens > cfg.max_position_embeddings:
      raise InputError(
          f"{where}: prompt has {len(ids)} tokens; with --max_new_tokens {FLAGS.max_new_tokens} "
          f"that exceeds the model's context ({cfg.max_position_embeddings})")
    problem = prompt_problem(ids, vocab_size=cfg.vocab_size, max_prompt_len=max_prompt_len)
    if problem:
      raise InputError(f"{where}: {problem}")
  spec, dparams, history = None, None, None
  if strategy.steps:
    from tlt_jax.rollout.config import SpecConfig
    if not FLAGS.drafter and not strategy.history:
      raise InputError("--spec needs --drafter DIR (or --drafter init:SEED)")
    import jax
    from tlt_jax.drafter.model import init_drafter, load_drafter
    if strategy.history:
      history = history_index()
    drafter = FLAGS.drafter or "init:0"  # a history arm runs only the drafter's catch-up
    if drafter.startswith("init:"):
      dparams = init_drafter(cfg, jax.random.key(int(drafter.split(":", 1)[1])))
    else:
      dparams = load_drafter(drafter, cfg)
    # The Pallas verification kernel where it compiles (GPU); elsewhere its jnp reference
    # (same decisions; Pallas interpret mode is a debugging interpreter, not a fast path).
    spec = SpecConfig(strategy=strategy.name,
                      bs_threshold=FLAGS.spec_threshold or FLAGS.batch_size, patience=1,
                      use_kernel=jax.default_backend() == "gpu")
  ecfg = EngineConfig(max_batch=FLAGS.batch_size, buckets=buckets_upto(FLAGS.batch_size),
                      chunk_size=FLAGS.chunk_size, compaction=FLAGS.compaction,
                      max_prompt_len=max_prompt_len, max_new_tokens=FLAGS.max_new_tokens,
                      stop_tokens=stop_token_ids(FLAGS.model, tokenizer), spec=spec)
  engine = Engine(params, cfg, ecfg, drafter_params=dparams, history=history)
  requests = [Request(ids, request_id=i, sample_index=s)
              for i, (_, ids) in enumerate(prompts) for s in range(FLAGS.num_samples)]
  from tqdm import tqdm
  bar = tqdm(total=len(requests), desc="generate", unit="sample", file=sys.stderr)
  t0 = time.perf_counter()
  results = engine.generate(requests, sp, seed=FLAGS.seed,
                            hooks=EngineHooks(on_result=lambda _: bar.update(1)))
  wall = time.perf_counter() - t0
  if history is not None:
    history.close()
  bar.close()
  results.sort(key=lambda r: (r.request_id, r.sample_index))
  with open(FLAGS.output, "w", encoding="utf-8") as f:
    for r in results:
      row = {"prompt_index": r.request_id, "sample_index": r.sample_index,
             "response_ids": r.response_ids.tolist(), "num_tokens": r.num_tokens,
             "finish_reason": r.finish_reason}
      if tokenizer is not None:
        row["text"] = tokenizer.decode(r.response_ids, skip_special_tokens=True)
      f.write(json.dumps(row) + "\n")
  tokens = sum(r.num_tokens for r in results)
  cs = engine.compile_stats()
  print(f"generated {len(results)} samples, {tokens} tokens in {wall:.2f}s "
        f"({tokens / wall:.1f} tokens/s incl. {cs['compile_seconds']:.1f}s compile of "
        f"{cs['executables']} executables)", file=sys.stderr)
  print(f"batch profile: {batch_profile(engine.chunk_log)}", file=sys.stderr)
  sd = [c for c in engine.chunk_log if c.mode != "plain"]
  if sd:
    print(f"speculative ({sd[0].mode}): mean acceptance length "
          f"{tokens_per_verification(sd) or 0:.2f} tokens per verification", file=sys.stderr)
  print(f"wrote {FLAGS.output}", file=sys.stderr)


if __name__ == "__main__":
  from tlt_jax.runtime import exit_on_user_error
  app.run(exit_on_user_error(main, also=(ValueError,)))  # InputError, DrafterLoadError
