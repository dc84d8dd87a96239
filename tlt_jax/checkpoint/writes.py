"""A save that cannot be written, said in one line (`SaveFailed`), before it starts where that
can be known, and the noise a failed write makes, dropped.

Before: a full disk surfaced as Orbax's background error at the *next* save, several steps
later (the steps between unsaved), after a thousand lines of asyncio and absl tracebacks from
every array's abandoned write, and a traceback ending the run. Now `check_room` refuses a
save the directory's disk cannot hold (sized as the step before it) before a byte is written
(no partial step, no noise); a save that fails anyway (the disk filled meanwhile, a quota, an
I/O error) is found at the step after it (checkpointer.py polls it) and said by `failed`,
its unfinished files removed.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import re
import shutil
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from tlt_jax.checkpoint.damage import reason
from tlt_jax.checkpoint.leaves import CheckpointError

_MiB = 1 << 20
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_FIX = "free space there, or checkpoint to a disk with room"


class SaveFailed(CheckpointError):
  """A checkpoint step that could not be written. Every checkpoint written before it is
  whole; `resume` says how the run goes on from them."""
  resume = "the same command resumes from it once there is room"


def step_bytes(step_dir: str) -> int:
  """The bytes of a finalized step's files: what the next save of the same state will need
  (OCDBT compresses, so the arrays' own bytes overstate it: the default run's untrained
  drafter moments are zeros, and its state's 14.5 MiB take 11.6)."""
  return sum(os.path.getsize(os.path.join(root, f))
             for root, _, files in os.walk(step_dir) for f in files)


def free_bytes(directory: str) -> int:
  """Free bytes on the disk that holds `directory` (or would: its nearest existing parent)."""
  path = os.path.abspath(directory)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return shutil.disk_usage(path).free


def check_room(directory: str, step: int, latest: int) -> None:
  """Raises SaveFailed when step `step` will not fit the free space of `directory`'s disk, on
  this process or any other (every process calls it at the same save), sized as step
  `latest` (its files). Keep-last-N deletes the oldest step only once the new one is written,
  so the new step must fit beside every step kept. Local directories only (a bucket's room
  is not a disk's)."""
  if "://" in directory:
    return
  need = step_bytes(os.path.join(directory, str(latest)))
  free = free_bytes(directory)
  if jax.process_count() > 1:  # every process refuses together, or none does
    from jax.experimental import multihost_utils
    # (as MiB and the bytes past them: JAX without x64 would cut an int64 to 32 bits)
    parts = np.array([free >> 20, free & (_MiB - 1)], np.int32)
    got = np.asarray(multihost_utils.process_allgather(parts)).reshape(-1, 2).astype(np.int64)
    every = [int(hi) * _MiB + int(lo) for hi, lo in got]
  else:
    every = [free]
  for p, free in enumerate(every):
    if free < need:
      who = f" (as process {p} sees it)" if len(every) > 1 else ""
      raise SaveFailed(
          f"checkpoint step {step} needs {need / _MiB:.1f} MiB in {directory} (step {latest}'s "
          f"size) and its disk has {free / _MiB:.1f} MiB free{who}: {_FIX}")


def failed(step: int | None, directory: str, error: BaseException) -> SaveFailed:
  """The one-line error of step `step`'s save that failed with `error` (Orbax's, raised in the
  background): the operating system's reason where there is one ("No space left on device")."""
  text = str(error)
  code = re.search(r"os_error_code='?(\d+)", text)
  errno_ = getattr(error, "errno", None) or (int(code.group(1)) if code else None)
  if errno_ is not None:
    why = os.strerror(errno_)
  else:
    why = f"{type(error).__name__}: {reason(error)}"
  fix = f": {_FIX}" if errno_ in _NO_ROOM else ""
  what = f"checkpoint step {step}" if step is not None else "a checkpoint"
  return SaveFailed(f"{what} could not be written to {directory} ({why}; its "
                    f"unfinished files are removed){fix}")


def remove_unfinished(path: epath.Path, step: int | None) -> list[str]:
  """Deletes what a failed or killed save of `step` (None: of any step) left in the checkpoint
  directory `path` (its `<step>.orbax-checkpoint-tmp`): never restorable, and on a full disk
  its bytes are the room that is missing. Returns what it deleted."""
  gone = []
  for tmp in ocp.path.step.all_temporary_paths(path):
    if step is None or tmp.get().name.split(".")[0] == str(step):
      tmp.get().rmtree(missing_ok=True)
      gone.append(str(tmp.get()))
  return gone


def out_of_room(error: BaseException, workdir: str) -> SaveFailed | None:
  """The one line of the operating system's "no space left on device" (or "quota exceeded")
  from a run's own write into `workdir` (a metrics line, an export); None for any other
  error."""
  if not (isinstance(error, OSError) and error.errno in _NO_ROOM):
    return None
  return SaveFailed(f"{error.filename or workdir}: {error.strerror}: free space there, or "
                    "write the run to a disk with room (--workdir)")


class QuietFailedWrites(logging.Filter):
  """Drops the reports a failed write into `directory`'s unfinished steps makes: asyncio's
  and absl's log records that name `<step>.orbax-checkpoint-tmp` (where Orbax writes), and the
  unraisable "Event loop is closed" of every other array's write, whose TensorStore callback
  finds the save's event loop closed by the first failure: one full disk, ~60 tracebacks in
  the default run. The failure itself comes back as `failed`'s one line."""

  def __init__(self, directory: str):
    super().__init__()
    self._needle = os.path.join(directory, "")
    self._previous = None

  def _mentions(self, e: BaseException | None, text: str = "") -> bool:
    seen = 0
    while e is not None and seen < 8:
      text, e, seen = text + str(e), e.__cause__ or e.__context__, seen + 1
    return self._needle in text and ".orbax-checkpoint-tmp" in text

  def filter(self, record: logging.LogRecord) -> bool:
    return not self._mentions(record.exc_info[1] if record.exc_info else None,
                              record.getMessage())

  def _hook(self, unraisable: Any) -> None:
    e = unraisable.exc_value
    if not (self._mentions(e) or (isinstance(e, RuntimeError)
                                  and str(e) == "Event loop is closed")):
      self._previous(unraisable)

  def __enter__(self) -> "QuietFailedWrites":
    for name in ("asyncio", "absl"):
      logging.getLogger(name).addFilter(self)
    self._previous, sys.unraisablehook = sys.unraisablehook, self._hook
    return self

  def __exit__(self, *exc) -> None:
    self.release(lingering=False)

  def release(self, lingering: bool) -> None:
    """Removes the filters. lingering (a write failed): the unraisable hook stays for the rest
    of the process, as the abandoned writes' callbacks can find their loop closed after the
    Checkpointer's close, at any time up to the interpreter's exit (seen once, in a CI run of
    tests/test_checkpoint_writes.py)."""
    gc.collect()  # a failed save's abandoned tasks report when collected: now, filtered
    for name in ("asyncio", "absl"):
      logging.getLogger(name).removeFilter(self)
    if not lingering and sys.unraisablehook == self._hook:  # (not if another one came since)
      sys.unraisablehook = self._previous
