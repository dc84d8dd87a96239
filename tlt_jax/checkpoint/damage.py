"""A damaged checkpoint step, met while restoring: its one-line error (`Damaged`: the reason
without TensorStore's kilobytes of spec) and the third-party noise its failed read makes,
dropped while it is read (`quiet_about`). checkpointer.py's `restore` falls back past such a
step and sets it aside."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time
from typing import Any, Iterator

import jax
import orbax.checkpoint as ocp
from etils import epath

_log = logging.getLogger("tlt_jax.checkpoint")


class Damaged(Exception):
  """A step whose files fail to read (restore falls back past it); str() is one short line."""

  def __init__(self, doing: str, error: BaseException):
    super().__init__(f"{type(error).__name__} {doing}: {reason(error)}")


def reason(error: BaseException) -> str:
  """The first line of an Orbax / TensorStore error, short: TensorStore appends its whole spec
  (kilobytes) to every message, and the path and the reason come before it."""
  msg = str(error).splitlines()[0] if str(error) else ""
  for cut in (" [tensorstore_spec=", ". See full TensorStore details"):
    msg = msg.split(cut)[0]
  return msg if len(msg) <= 300 else msg[:300] + "..."


def check_array_files(item_dir: str) -> None:
  """Raises Damaged if the item's array store (OCDBT) holds data but not its root manifest
  (a file lost), or if one of its files (the manifests, the data files under `d/` directories)
  is empty: what a crash leaves of a write whose directory entry landed before its data (e.g.
  ext4's delayed allocation, a power cut). No OCDBT file is empty when whole, and a finalized
  store with data has `manifest.ocdbt` at its root (the per-process stores are merged into
  it). Checked before Orbax reads (its metadata read opens the arrays too), which on such a
  store fails mid-read and leaves its other TensorStore reads running past its closed event
  loop, reporting from TensorStore's threads. Local paths only (a listing of a bucket is
  slow; there Orbax's own read reports the damage)."""
  if "://" in item_dir or not os.path.isdir(item_dir):
    return
  names = os.listdir(item_dir)
  if "manifest.ocdbt" not in names and any(n == "d" or n.startswith("ocdbt.process_")
                                           for n in names):
    raise Damaged("reading its arrays", FileNotFoundError(
        f"{os.path.join(item_dir, 'manifest.ocdbt')} is missing (its array store has data: "
        "a file lost)"))
  for root, _, files in os.walk(item_dir):
    for f in sorted(files):
      if (f == "manifest.ocdbt" or os.path.basename(root) == "d") and \
          os.path.getsize(os.path.join(root, f)) == 0:
        raise Damaged("reading its arrays", OSError(
            f"{os.path.join(root, f)} is empty (0 bytes: a write lost in a crash)"))


@contextlib.contextmanager
def quiet_about(path: epath.Path) -> Iterator[None]:
  """Drops third-party reports that mention `path` while it is read: a damaged step makes
  Orbax log its unparsable files and its abandoned read tasks print dozens of traceback lines
  (absl, asyncio, unraisable coroutine errors), which `restore`'s one line replaces."""
  needle = str(path)

  def mentions(e: BaseException | None) -> bool:
    seen = 0
    while e is not None and seen < 8:
      if needle in str(e):
        return True
      e, seen = e.__cause__ or e.__context__, seen + 1
    return False

  class Filter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
      return needle not in record.getMessage() and not (
          record.exc_info and mentions(record.exc_info[1]))

  def hook(unraisable: Any) -> None:
    if not mentions(unraisable.exc_value):
      previous(unraisable)

  loggers, f, previous = [logging.getLogger(n) for n in ("asyncio", "absl")], Filter(), \
      sys.unraisablehook
  for logger in loggers:
    logger.addFilter(f)
  sys.unraisablehook = hook
  try:
    yield
  except BaseException:
    gc.collect()  # the failed read's abandoned tasks report when collected: now, filtered
    raise
  finally:
    sys.unraisablehook = previous
    for logger in loggers:
      logger.removeFilter(f)


def set_aside(path: epath.Path, steps: list[int], into: str) -> None:
  """Moves checkpoint `steps` (restore skipped them: damaged) to `<path>/<into>/<step>-<time>`,
  never deleting them. Every process of a multi-process job calls this (each restored, and
  found the same damage, from the same files); process 0 moves, the others wait for it."""
  if jax.process_index() == 0:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for step in steps:
      src, dst = path / str(step), path / into / f"{step}-{stamp}"
      if src.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        src.rename(dst)
        _log.warning("moved damaged checkpoint step %d to %s", step, dst)
  if jax.process_count() > 1:
    ocp.multihost.sync_global_processes("tlt_jax_checkpoint_set_aside_damaged")
