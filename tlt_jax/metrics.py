"""What a run writes about itself: metrics.jsonl, timeline.jsonl, TensorBoard (and Weights &
Biases where config.wandb asks: wandb_log.py), compile time, and samples of its responses
(rollouts.jsonl, eval_responses.jsonl).

Host-side I/O only (no jitted code). The trainer writes with `MetricsWriter`; scripts that
plot or compare runs (tlt_jax/curves.py, scripts/plot_timeline.py) read with `read_records`,
without importing the trainer.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from typing import Any, Sequence

import jax

_log = logging.getLogger("tlt_jax.metrics")


def read_records(path: str, *, tolerate_partial: bool = True) -> list[dict[str, Any]]:
  """The JSON records of a JSONL file, one per line.

  A process killed mid-write leaves its last line cut short; with tolerate_partial that line
  is dropped with one line on stderr (the records before it are whole: every writer here
  flushes whole lines). A bad line anywhere else is not a kill's doing: ValueError naming the
  file and the line."""
  with open(path) as f:
    lines = f.read().split("\n")
  # the text after the last "\n": "" for a file of whole lines, the cut-short one otherwise
  lines, tail = lines[:-1], lines[-1]
  out = []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: line {n} is not JSON ({e.msg}); the file is damaged, not "
                       "cut short by a kill: fix or remove that line") from None
  if tail.strip():
    try:
      out.append(json.loads(tail))  # a whole record written without its newline
    except json.JSONDecodeError:
      if not tolerate_partial:
        raise ValueError(f"{path}: its last line ({len(tail)} characters) is cut short") from None
      print(f"{path}: dropped its last line ({len(tail)} characters), cut short by a kill",
            file=sys.stderr)
  return out


def append_jsonl(path: str, records: Sequence[dict[str, Any]], **fields: Any) -> None:
  """Appends `records` to the JSONL file `path`, each with `fields` first, in whole lines."""
  with open(path, "a") as f:
    f.writelines(json.dumps({**fields, **r}) + "\n" for r in records)


def keep_steps_upto(path: str, step: int) -> None:
  """Rewrites a JSONL file without records of steps after `step` (recomputed after a resume)
  and without a last line cut by a kill, so curves have no duplicates and appends start on a
  fresh line."""
  if not os.path.exists(path):
    return
  kept = [rec for rec in read_records(path) if rec.get("step", 0) <= step]
  with open(path + ".tmp", "w") as f:
    f.writelines(json.dumps(rec) + "\n" for rec in kept)
  os.replace(path + ".tmp", path)


RESPONSE_FILES = ("rollouts", "eval_responses")  # <workdir>/<name>.jsonl (`responses`)


class MetricsWriter:
  """metrics.jsonl + timeline.jsonl + TensorBoard, and the responses files; on resume,
  records of steps after the restored checkpoint are dropped (TensorBoard: purged). With
  `board` (a wandb_log.WandbRun, which its caller starts and closes) each step's scalars and
  responses go there too, the responses as tables in the step's row; a resumed run first
  sends the board what the files hold up to its checkpoint (`_backfill`)."""

  def __init__(self, workdir: str, resume_step: int, board=None):
    self.workdir = workdir
    self._board, self._tables = board, []
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.timeline_path = os.path.join(workdir, "timeline.jsonl")
    for p in (self.path, self.timeline_path) + tuple(
        os.path.join(workdir, f"{name}.jsonl") for name in RESPONSE_FILES):
      keep_steps_upto(p, resume_step)
    self._f = open(self.path, "a")
    self._timeline = open(self.timeline_path, "a")
    self._tb = None
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tb"), purge_step=resume_step + 1)
    except ImportError:  # pragma: no cover - tensorboardX is in requirements
      _log.warning("tensorboardX is not installed: TensorBoard logging is off")
    if board is not None and resume_step >= 0:
      self._backfill()

  def _backfill(self) -> None:
    """The steps on disk (up to the restored checkpoint) sent to the board again: it keeps
    only those its wandb run lacks (wandb_log.WandbRun.log), so what a killed run's wandb lost
    (its service buffers what it writes; an offline run killed loses it all) comes back from
    metrics.jsonl and the responses files."""
    tables: dict[int, list] = {}
    for name in RESPONSE_FILES:
      path = os.path.join(self.workdir, f"{name}.jsonl")
      by_step: dict[int, list] = {}
      for rec in read_records(path) if os.path.exists(path) else ():
        by_step.setdefault(rec["step"], []).append(rec)
      for step, recs in by_step.items():
        tables.setdefault(step, []).append((name, recs))
    for rec in read_records(self.path):
      step = rec["step"]
      self._board.log(step, numbers({k: v for k, v in rec.items() if k != "step"}),
                      tables.get(step, ()))

  def write(self, step: int, metrics: dict[str, Any], timeline: dict | None = None) -> None:
    self._f.write(json.dumps({"step": step, **metrics}) + "\n")
    self._f.flush()
    if timeline is not None:
      self._timeline.write(json.dumps({"step": step, **timeline}) + "\n")
      self._timeline.flush()
    scalars = numbers(metrics)
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(k, v, step)
      self._tb.flush()
    if self._board is not None:
      self._board.log(step, scalars, self._tables)
    self._tables = []

  def responses(self, name: str, step: int, records: Sequence[dict[str, Any]]) -> None:
    """Step `step`'s response records (eval.response_record's) appended to
    <workdir>/<name>.jsonl, `name` one of RESPONSE_FILES, and shown in TensorBoard's Text tab
    (`responses_markdown`); the board's table `name` goes with the step's `write`."""
    if not records:
      return
    append_jsonl(os.path.join(self.workdir, f"{name}.jsonl"), records, step=step)
    if self._board is not None:
      self._tables.append((name, [{"step": step, **r} for r in records]))
    if self._tb is not None:
      self._tb.add_text(name, responses_markdown(records), step)
      self._tb.flush()

  def close(self) -> None:
    self._f.close()
    self._timeline.close()
    if self._tb is not None:
      self._tb.close()


def responses_markdown(records: Sequence[dict[str, Any]], max_chars: int = 4000) -> str:
  """Response records as TensorBoard's Text tab shows them (markdown): per response a line of
  its prompt index, sample, source, reward, length and finish reason, then its prompt and its
  text as code blocks (each cut at `max_chars`)."""

  def block(text: Any) -> str:
    text = text if isinstance(text, str) else json.dumps(text)  # (chat messages)
    text = text if len(text) <= max_chars else text[:max_chars] + " [...]"
    return "```\n" + text.replace("```", "` ` `") + "\n```"

  parts = []
  for r in records:
    src = f", {r['source']}" if r.get("source") is not None else ""
    parts.append(f"**prompt {r['prompt_index']}, sample {r['sample']}{src}**: reward "
                 f"{r['reward']:g}, {r['tokens']} tokens ({r['finish_reason']}), answer "
                 f"`{r['answer']}`\n\n{block(r['prompt'])}\n\n{block(r['response'])}")
  return "\n\n".join(parts)


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
  """A step's record's numbers (booleans not), flattened: TensorBoard's scalars, wandb's."""
  return {k: v for k, v in flatten(metrics).items()
          if isinstance(v, (int, float)) and not isinstance(v, bool)}


def flatten(d: dict[str, Any], prefix: str = "", sep: str = "/") -> dict[str, Any]:
  """{"a": {"b": 1}} -> {"a/b": 1} (TensorBoard's tags; sep "." for config keys)."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}{sep}", sep))
    else:
      out[f"{prefix}{k}"] = v
  return out


_BACKGROUND = threading.local()  # set on the threads that compile ahead of need


def mark_background_compiler() -> None:
  """Marks the calling thread as one that compiles ahead of need (rollout/executables.py's
  `background_compiler` threads): a `CompileClock` counts its compiles apart, since no step
  waited on them."""
  _BACKGROUND.on = True


class CompileClock:
  """Seconds XLA spent compiling (every thread, every executable: learner, engine, drafter)
  since this clock was made, read per step with `lap`: `time.compile`, the seconds compiled on
  the threads that do the run's work (a rollout worker, the learner: each stalled while it
  compiled; already inside the phase it happened in; the first step's includes start-up), and
  `time.compile_background`, those of the threads that compile ahead of need at the lowest CPU
  priority (`mark_background_compiler`: the tail's plain executables, speculation's, the
  drafter's), which nothing waited on unless a chunk later found its executable still
  compiling. JAX reports a persistent-cache hit under the same event: there it is the time to
  load the executable (a warm run's first step: ~10 s here).

  One per run (train.build makes it, Run owns it): its own listener and totals, so two runs in
  one process (tests) each count their own compiles; `close` unregisters the listener."""

  EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    self._lock = threading.Lock()  # compiles finish on background threads too
    self._total = {"compile": 0.0, "compile_background": 0.0}
    self._last = dict(self._total)
    jax.monitoring.register_event_duration_secs_listener(self._listen)

  def _listen(self, event: str, seconds: float, **kwargs) -> None:
    if event == self.EVENT:  # reported on the thread that compiled
      kind = "compile_background" if getattr(_BACKGROUND, "on", False) else "compile"
      with self._lock:
        self._total[kind] += seconds

  def lap(self) -> dict[str, float]:
    """{"compile": s, "compile_background": s}: the seconds compiled since the last lap (or
    since the clock was made) on the run's own threads and on its background compilers."""
    with self._lock:
      out = {k: v - self._last[k] for k, v in self._total.items()}
      self._last = dict(self._total)
    return out

  def close(self) -> None:
    jax.monitoring.unregister_event_duration_listener(self._listen)
