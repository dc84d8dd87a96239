"""A model directory's tokenizer and the token ids that end a response.

`transformers` is used only for its tokenizers here (the main job's install has no torch),
imported quietly; the ids that stop a response come from generation_config.json, the
tokenizer's EOS and, with a chat template, the token the template closes a turn with.
"""

from __future__ import annotations

import json
import os
import sys

from tlt_jax.models.safetensors_io import CheckpointFormatError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "added_tokens.json")


def transformers_module():
  """`transformers`, imported without the advice it prints when torch is absent ("PyTorch
  was not found. Models won't be available"): the project takes only its tokenizers, and the
  main job's install has no torch (scripts/setup.sh without --dev)."""
  if "transformers" not in sys.modules:
    quiet = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    before = os.environ.get(quiet)
    os.environ[quiet] = "1"
    try:
      import transformers  # noqa: F401
    finally:
      if before is None:
        os.environ.pop(quiet, None)
      else:
        os.environ[quiet] = before
  return sys.modules["transformers"]


def load_tokenizer(model_dir: str):
  """`transformers.AutoTokenizer` from the model directory, or None when it has none."""
  if not any(os.path.exists(os.path.join(model_dir, f)) for f in TOKENIZER_FILES[:2]):
    return None
  return transformers_module().AutoTokenizer.from_pretrained(model_dir)


def stop_token_ids(model_dir: str, tokenizer=None, *, chat_template: bool = False
                   ) -> tuple[int, ...]:
  """EOS ids: generation_config.json's eos_token_id (int or list) first, then the
  tokenizer's eos token; with `chat_template`, also the template's end-of-turn token (a base
  Qwen2.5's EOS is <|endoftext|> but its chat template ends a turn with <|im_end|>: without
  it every chat response would run to max_new_tokens)."""
  path = os.path.join(model_dir, "generation_config.json")
  ids: list[int] = []
  if os.path.exists(path):
    try:
      with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
      raise CheckpointFormatError(f"{path} is not a JSON object ({e}); fix or delete it") from None
    ids = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
  if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
    ids = [tokenizer.eos_token_id]
  if chat_template and tokenizer is not None:
    ids += [i for i in chat_end_of_turn_ids(tokenizer) if i not in ids]
  return tuple(int(i) for i in ids)


def chat_end_of_turn_ids(tokenizer) -> tuple[int, ...]:
  """The special token the tokenizer's chat template closes an assistant turn with
  (<|im_end|> for Qwen, <|eot_id|> for Llama-3), read off a rendered turn; () when the
  template closes turns with ordinary text or there is no template."""
  if not getattr(tokenizer, "chat_template", None):
    return ()
  mark = "tltmarker"
  try:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": mark}],
        tokenize=False)
  except Exception:  # noqa: BLE001 - a template that cannot render a turn has no answer here
    return ()
  if not isinstance(text, str) or mark not in text:
    return ()
  tail = text[text.rindex(mark) + len(mark):]
  ids = tokenizer.encode(tail, add_special_tokens=False) if tail else []
  special = set(getattr(tokenizer, "all_special_ids", []) or [])
  special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
  return (int(ids[0]),) if ids and ids[0] in special else ()
