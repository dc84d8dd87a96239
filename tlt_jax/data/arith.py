"""The default task: multi-step arithmetic with step-by-step reasoning traces.

A problem is a chain of `k` single-digit terms joined by `+` / `-`; the reference response
computes the running value one step at a time and ends with a verifiable final answer:

    prompt:    "Q: 7+3-5+8\\nA:"
    response:  " 7+3=10 10-5=5 5+8=13 #### 13"      (followed by the EOS token)

Every step restates the running value, so each step is a local computation (copy the last
result, fetch the next operand from the prompt, add one digit); running values may go
negative ("3-8=-5 -5+2=-3").

Design choices, all for a task that a ~1M-parameter model can half-learn on a laptop CPU and
that still behaves like RL on reasoning traces:

* Verifiable answer. `score` is exact integer match of the number after the final `####`
  (GSM8K's convention), so the RL reward is a deterministic rule, never a judge.
* Single-digit terms. The per-step arithmetic is trivial (running value +/- one digit), so
  difficulty comes from the LENGTH of the chain - keeping track of the position in the prompt
  and not dropping a carry over many steps - exactly like long reasoning traces where one slip
  anywhere ruins the answer. It also keeps the vocabulary tiny (digits, `+-=#`, a few
  characters) and lets the tokenizer split numbers into individual digits.
* Heavy-tailed length. `k - 1` (the number of steps) is a discretised log-normal truncated to
  [1, K_MAX - 1]: most responses are short (median ~24 tokens) while ~1% are 7-10x longer
  (up to ~240 tokens). This is the long-tailed response-length distribution that makes
  synchronous RL rollouts wait on a few stragglers (the problem TLT addresses), and it is what
  an adaptive speculative-decoding drafter is trained against. Short chains are learned well by
  cold-start SFT, long ones fail more often, so GRPO has room to improve.

Everything is deterministic given a seed (`numpy.random.Generator`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Iterable

import numpy as np

K_MIN = 2  # fewest terms (one step)
K_MAX = 30  # most terms (29 steps: ~200-240 response tokens)
LOGNORMAL_MU = math.log(3.0)  # median number of steps ~3
LOGNORMAL_SIGMA = 1.0  # tail width: ~11% of problems have >= 10 steps, ~2% >= 20


@dataclasses.dataclass(frozen=True)
class Lengths:
  """A task variant's chain lengths: k - 1 steps ~ round(LogNormal(mu, sigma)) in
  [K_MIN - 1, k_max - 1]."""
  k_max: int
  mu: float
  sigma: float


# The embedded default (tlt_jax/assets/default): response p50 24, p90 74, p99 186 tokens.
DEFAULT = Lengths(K_MAX, LOGNORMAL_MU, LOGNORMAL_SIGMA)
# The long-tail variant (tlt_jax/assets/longtail, configs/longtail.py): the shape of reasoning
# RL's lengths at a 512-token cap (reference traces: p50 ~30, p90 ~150 tokens, p99 near the
# cap, 1-3% longer than it), up to 120 steps (~900 tokens).
LONGTAIL = Lengths(121, math.log(3.5), 1.35)
TASKS = {"default": DEFAULT, "longtail": LONGTAIL}

PROMPT_PREFIX = "Q: "
PROMPT_SUFFIX = "\nA:"
ANSWER_MARKER = "####"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

_ANSWER_RE = re.compile(r"\s*(-?\d+)")


def sample_num_terms(rng: np.random.Generator, lengths: Lengths = DEFAULT) -> int:
  """k in [K_MIN, lengths.k_max] with k - 1 ~ round(LogNormal(mu, sigma)), truncated by
  rejection (rejection, not clipping, so the tail has no spike at k_max)."""
  while True:
    steps = int(round(math.exp(rng.normal(lengths.mu, lengths.sigma))))
    if K_MIN - 1 <= steps <= lengths.k_max - 1:
      return steps + 1


def format_prompt(expression: str) -> str:
  return f"{PROMPT_PREFIX}{expression}{PROMPT_SUFFIX}"


def reference_trace(digits: list[int], ops: list[str]) -> tuple[str, int]:
  """(" a+b=c c-d=e ... #### e", final value) for terms digits[0] ops[0] digits[1] ..."""
  value = digits[0]
  steps = []
  for op, d in zip(ops, digits[1:]):
    new = value + d if op == "+" else value - d
    steps.append(f"{value}{op}{d}={new}")
    value = new
  return " " + " ".join(steps) + f" {ANSWER_MARKER} {value}", value


def make_problem(rng: np.random.Generator, num_terms: int | None = None,
                 lengths: Lengths = DEFAULT) -> dict[str, Any]:
  """One problem: dict(prompt, answer, num_terms, response) with `response` the reference
  trace (without EOS; append the tokenizer's EOS when training on it)."""
  k = sample_num_terms(rng, lengths) if num_terms is None else int(num_terms)
  if not K_MIN <= k:
    raise ValueError(f"num_terms={k} must be >= {K_MIN}")
  digits = [int(x) for x in rng.integers(0, 10, size=k)]
  ops = ["+" if b else "-" for b in rng.integers(0, 2, size=k - 1)]
  expression = str(digits[0]) + "".join(f"{op}{d}" for op, d in zip(ops, digits[1:]))
  response, value = reference_trace(digits, ops)
  return dict(prompt=format_prompt(expression), answer=str(value), num_terms=k,
              response=response)


def generate_dataset(n: int, seed: int, lengths: Lengths = DEFAULT) -> list[dict[str, Any]]:
  """n problems, deterministic given seed (same seed -> identical list)."""
  rng = np.random.default_rng(seed)
  return [make_problem(rng, lengths=lengths) for _ in range(n)]


def expression_of(prompt: str) -> str:
  """The arithmetic expression inside a prompt ("Q: 7+3\\nA:" -> "7+3")."""
  if not (prompt.startswith(PROMPT_PREFIX) and prompt.endswith(PROMPT_SUFFIX)):
    raise ValueError(f"not an arithmetic prompt: {prompt!r}")
  return prompt[len(PROMPT_PREFIX):-len(PROMPT_SUFFIX)]


def extract_answer(text: str) -> str | None:
  """The integer right after the LAST `####` (normalised, e.g. "-07" -> "-7"), or None.

  Whatever follows the number (EOS text, padding, a runaway continuation) is ignored; a
  final `####` without a number after it gives None even if an earlier one had one.
  """
  if text is None:
    return None
  idx = text.rfind(ANSWER_MARKER)
  if idx < 0:
    return None
  m = _ANSWER_RE.match(text, idx + len(ANSWER_MARKER))
  if m is None:
    return None
  return str(int(m.group(1)))


def score(response_text: str, answer: str | int) -> float:
  """Reward: 1.0 if the extracted final answer equals `answer` as integers, else 0.0."""
  got = extract_answer(response_text)
  if got is None:
    return 0.0
  try:
    return 1.0 if int(got) == int(str(answer).strip()) else 0.0
  except ValueError:
    return 0.0


def check_trace(prompt: str, response: str) -> bool:
  """True iff every step of `response` is arithmetically right, the steps walk the prompt's
  terms in order, and the final answer is the last running value (used by tests and to audit
  model outputs)."""
  expr = expression_of(prompt)
  terms = re.findall(r"[+-]?\d", expr)
  body, sep, _ = response.rpartition(ANSWER_MARKER)
  if not sep:
    return False
  steps = body.split()
  if len(steps) != len(terms) - 1:
    return False
  value = int(terms[0])
  for step, term in zip(steps, terms[1:]):
    m = re.fullmatch(r"(-?\d+)([+-])(\d)=(-?\d+)", step)
    if m is None:
      return False
    a, op, d, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
    if a != value or op + str(d) != term or c != (a + d if op == "+" else a - d):
      return False
    value = c
  return score(response, value) == 1.0


# ------------------------------------------------------------------------------ tokenizer
# The pre-tokenization regex of Qwen2 (transformers' Qwen2Tokenizer). `AutoTokenizer` always
# loads a checkpoint whose config.json says model_type=qwen2 as a Qwen2Tokenizer, which keeps only
# vocab + merges from tokenizer.json and rebuilds the rest of the pipeline (NFC, this regex,
# byte-level); our tokenizer therefore uses exactly that pipeline, so `tokenizers` and
# `transformers` produce identical ids. `\p{N}` matches ONE digit: numbers are spelled digit by
# digit.
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 32):
  """A tiny byte-level BPE tokenizer over the task's text (returns a `tokenizers.Tokenizer`).

  The pipeline is Qwen2's (see QWEN2_PRETOKENIZE_REGEX): every digit is its own pre-token, so
  numbers are always spelled digit by digit, and the ByteLevel decoder makes
  decode(encode(x)) == x for all task text. The alphabet is just the task's characters
  (digits, `+-=#`, `QA:`, space, newline); BPE may merge only inside punctuation runs (e.g.
  " ####", "=-"), so the whole vocabulary is ~26 tokens including `<|pad|>` (id 0) and
  `<|endoftext|>` (id 1, EOS).
  """
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
  from tokenizers import trainers

  tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])
  tok.decoder = decoders.ByteLevel()
  # byte-level spelling of the task's characters: space -> "\u0120", newline -> "\u010a"
  alphabet = list("0123456789+-=#QA:") + ["\u0120", "\u010a"]
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                special_tokens=[PAD_TOKEN, EOS_TOKEN], initial_alphabet=alphabet)
  tok.train_from_iterator(texts, trainer=trainer)
  return tok


def wrap_tokenizer(tok, model_max_length: int = 512):
  """`transformers.PreTrainedTokenizerFast` around a trained tokenizer (EOS/PAD set)."""
  from tlt_jax.models.tokenizer import transformers_module

  fast = transformers_module().PreTrainedTokenizerFast
  return fast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
              clean_up_tokenization_spaces=False, padding_side="right",
              model_max_length=model_max_length)


# ----------------------------------------------------------------------------- committed splits
def load_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
