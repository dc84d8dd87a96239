"""Asynchronous, crash-safe checkpoints of an arbitrary train-state pytree (Orbax underneath).

One helper for the whole project: trainer, RL loop and drafter all checkpoint through
`Checkpointer`, so the on-disk layout, the keep-last-N policy and the error messages are the same
everywhere.

Why async: writing a multi-GB state takes seconds to minutes; an async save only blocks for the
device->host copy and lets the next train steps run while the bytes go to disk. The copy is taken
before `save` returns, so donating/overwriting the saved arrays in the next step is safe.

Why crash-safe matters: jobs are preempted or OOM-killed mid-save. Orbax writes every step into
`<dir>/<step>.orbax-checkpoint-tmp` and renames it to `<dir>/<step>` only once every byte is
written (an atomic rename on a local/POSIX filesystem; a `commit_success.txt` marker on GCS). A
killed save therefore leaves only a tmp dir, which listing ignores and the next writer deletes;
the previous finalized step is never touched until a newer one is committed (keep-last-N deletes
old steps only after the new step is finalized).

Why damage is still possible: the rename (or marker) only says the write finished. A disk fault,
a copy cut short or a hand-edited directory can still leave a finalized step whose files are
truncated or missing, and Orbax finds that out only when it reads them. So `restore()` of the
latest step falls back to the newest step that actually restores, and sets the damaged newer
ones aside (never deletes them) at this writer's first save, see `restore`.

On-disk layout: `<dir>/<step>/state/...` (one Orbax PyTree item named "state", OCDBT format),
`<dir>/<step>/_CHECKPOINT_METADATA`; damaged steps set aside in `<dir>/damaged/<step>-<time>`.

Single writer: like Orbax's CheckpointManager, only one process (one job) may *write* to a
directory; any number may read it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath  # orbax's own path library (local paths and gs:// alike)

from tlt_jax.checkpoint.damage import Damaged, check_array_files, quiet_about, set_aside
from tlt_jax.checkpoint.leaves import (CheckpointError, check_template, match_template, norm_path,
                                       restore_arg, snapshot)
from tlt_jax.checkpoint.writes import (QuietFailedWrites, SaveFailed, check_room, failed,
                                       remove_unfinished)

PyTree = Any


_ITEM = "state"  # name of the single Orbax item inside every step directory
_DAMAGED = "damaged"  # <dir>/damaged/<step>-<time>: steps that failed to restore, set aside
_log = logging.getLogger("tlt_jax.checkpoint")  # (the package's logger)

# Orbax saves an array replicated over several devices "replica-parallel" (each replica
# writes a slice) on every platform but GPUs (there only where JAX_PLATFORMS names one):
# each slice is an eager program compiled once per (shape, device). For small arrays that is
# all cost: the drafter replicated over the rollout workers made TLT on's first checkpoint of
# the default run take 0.58 s against 0.07 s (18 slice compiles, cold), each later one
# ~0.05 s more.
# Replica-parallel only where each replica's slice is at least this large.
_MIN_REPLICA_SLICE_BYTES = 4 << 20


def _register_array_handler() -> None:
  absl_log = logging.getLogger("absl")  # (Orbax warns of the override it was asked for)
  level = absl_log.level
  absl_log.setLevel(logging.ERROR)
  try:
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(
            min_slice_bytes_for_replica_parallel=_MIN_REPLICA_SLICE_BYTES), override=True)
  finally:
    absl_log.setLevel(level)


_register_array_handler()


class Checkpointer:
  """Keep-last-N asynchronous checkpoints of one train-state pytree in `directory`.

  Args:
    directory: local path or gs:// URL; created on the first save (so that a reader with a
      mistyped path gets an error instead of an empty new directory).
    max_to_keep: how many most recent finalized steps to keep (None: keep all). Older steps are
      deleted only after a newer step is committed.
    save_interval_steps: `save(step)` only writes when `step % save_interval_steps == 0`
      (or `force=True`), so the train loop can call `save` every step. Orbax's default policy
      also writes the first save into a directory without checkpoints whatever its step: a
      crash before the first interval still leaves something to resume from, and a bad path
      or full disk shows up at once rather than hours in.
    async_save: write in a background thread (default). False makes `save` block until the
      step is on disk (useful in tests/debugging, or right before exiting).

  Use as a context manager (or call `close()`): a pending async save is lost if the process
  exits before it finishes.
  """

  def __init__(self, directory: str, *, max_to_keep: int | None = 3,
               save_interval_steps: int = 1, async_save: bool = True):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep={max_to_keep}: use >= 1 (or None to keep every step)")
    if save_interval_steps < 1:
      raise ValueError(f"save_interval_steps={save_interval_steps}: use >= 1")
    directory = os.fspath(directory)
    if "://" not in directory:  # tensorstore wants absolute local paths
      directory = os.path.abspath(directory)
    self.directory = directory
    self._path = epath.Path(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        save_interval_steps=save_interval_steps,
        enable_async_checkpointing=async_save,
        # Not at open: a reader (evaluator) opening the directory while the trainer writes would
        # delete the trainer's in-flight tmp dir. We clean up before our own first save instead.
        cleanup_tmp_directories=False,
        create=False,  # created on first save, see class docstring
    )
    registry = ocp.handlers.create_default_handler_registry(
        **{_ITEM: ocp.PyTreeCheckpointHandler()})
    with quiet_about(self._path):  # it lists the steps, see all_steps
      self._mngr = ocp.CheckpointManager(directory, options=options, handler_registry=registry)
    self._inflight: int | None = None  # step of a started async save, until it is settled
    self._prepared = False
    self._quiet: QuietFailedWrites | None = None  # from the first save to close()
    self._failed = False  # a failed save was reported (SaveFailed): close() does not again
    self._damaged: set[int] = set()  # steps restore() skipped; set aside at the first save

  # ------------------------------------------------------------------ queries

  def all_steps(self) -> list[int]:
    """Finalized steps, ascending. A save still in flight is not listed (it is not restorable
    yet, and if the process dies it never will be).

    Until this Checkpointer has saved, every call re-lists the directory, so a reader (e.g. an
    evaluator polling for new checkpoints) sees the writer's new steps; the writer itself uses
    Orbax's in-memory list, which it keeps up to date.
    """
    if not self._prepared:
      with quiet_about(self._path):  # a damaged step's _CHECKPOINT_METADATA: see restore
        self._mngr.reload()
    steps = sorted(int(s) for s in self._mngr.all_steps())
    if self._inflight is not None and self._mngr.is_saving_in_progress():
      steps = [s for s in steps if s != self._inflight]
    return steps

  def latest_step(self) -> int | None:
    """Newest finalized step, or None if there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  # ------------------------------------------------------------------ save

  def save(self, step: int, state: PyTree, *, force: bool = False) -> bool:
    """Start writing `state` as `step`; returns whether a save was started.

    Not started (returns False) when `step` is not a multiple of `save_interval_steps` (unless
    `force`, or this is the directory's first checkpoint) or when `step` already exists (so a
    final `save(step, force=True)` right after the interval save of that step is harmless).
    A step older than the latest checkpoint raises CheckpointError (restarted step counter).
    Returns once `state` is copied to host memory; `wait_until_finished()` blocks until it is
    on disk. SaveFailed: a step its disk cannot hold (sized as the latest), before a byte is
    written; a background write that failed, at the next save call (it polls), wait or close.

    state: any pytree of jax.Array (any sharding, incl. typed PRNG keys), np.ndarray, python
      bool/int/float/str and numpy numbers and bools (a numpy bool is stored as a bool); dicts,
      lists, tuples, namedtuples (optax states), registered dataclasses; None and empty
      containers are kept as structure.
    """
    step = int(step)
    if self._damaged:
      self._set_aside_damaged()
    if self._inflight is not None and not self._mngr.is_saving_in_progress():
      self.wait_until_finished()  # (returns at once; raises SaveFailed for a failed save)
    existing = self._mngr.all_steps()  # includes an in-flight save
    if step in existing:
      _log.info("checkpoint step %d already exists in %s; not saving it again", step,
                self.directory)
      return False
    if existing and step < max(existing):
      # Orbax would silently skip every such save: a run whose step counter restarted would
      # then checkpoint nothing until it passed the old latest step.
      raise CheckpointError(
          f"cannot save step {step}: {self.directory!r} already has a newer checkpoint "
          f"(step {max(existing)}). Resume from it (restore it and continue its step count) "
          "or use a new directory for a new run.")
    if not (force or self._mngr.should_save(step)):
      return False
    state = snapshot(state)
    if not self._prepared:
      self._prepare_for_first_save()
    self.wait_until_finished()  # (as Orbax's save would: the free space is then the disk's)
    if existing:
      check_room(self.directory, step, max(existing))
    self._inflight = step  # (a failure from here on is this step's)
    try:
      started = self._mngr.save(
          step, args=ocp.args.Composite(**{_ITEM: ocp.args.PyTreeSave(state)}), force=force)
    except Exception as e:  # pylint: disable=broad-except - said as this step's, in one line
      self._settle_failed(e)
    if not started:
      self._inflight = None
    return bool(started)

  def _prepare_for_first_save(self) -> None:
    """Create the directory and delete tmp dirs of saves that died mid-write (Orbax removes
    only a re-saved step's: others would accumulate forever); only the (single) writer does."""
    self._path.mkdir(parents=True, exist_ok=True)
    self._quiet = QuietFailedWrites(self.directory).__enter__()
    if jax.process_index() == 0:
      for tmp in remove_unfinished(self._path, None):
        _log.warning("removed unfinished checkpoint %s (a save that was interrupted)", tmp)
    self._prepared = True

  def _set_aside_damaged(self) -> None:
    """Moves the steps `restore` skipped aside (damage.set_aside); every process calls it."""
    set_aside(self._path, sorted(self._damaged), _DAMAGED)
    self._damaged.clear()
    self._mngr.reload()

  # ------------------------------------------------------------------ restore

  def restore(self, state_template: PyTree, step: int | None = None, *,
              optional: tuple[str, ...] = ()) -> PyTree:
    """Read step `step` (default: the newest that restores) into a pytree shaped like
    `state_template`.

    optional: top-level keys of a dict state that a checkpoint may hold or not, whatever the
    template has (e.g. a part of the state that a run may switch on or off between restarts):
    where both have one it is restored as any other; where the checkpoint lacks it, it is left
    out of the result; where the template lacks it, its leaves are not read.

    Why a template: a checkpoint stores values and shapes but not where they should live.
    Each array leaf is read directly onto its template leaf's `.sharding` (any mesh, any
    partitioning, unrelated to how it was saved) in the template's dtype (a differing saved
    dtype is cast), with no full host copy. Pass `jax.ShapeDtypeStruct(shape, dtype,
    sharding=...)` leaves (e.g. from `jax.eval_shape` of the init fn) to avoid allocating the
    state twice; concrete jax.Arrays also work. Non-array leaves (python/numpy scalars, str,
    np.ndarray) come back as the template's type. Typed and raw (uint32) PRNG keys come back
    as whatever the template has.

    Damaged steps (files truncated, empty or missing: anything that fails while Orbax reads
    them): with `step=None`, newer damaged steps are skipped for the newest step that restores,
    with one warning line naming them and why. They are kept on disk, and this Checkpointer's
    first save moves them to `<dir>/damaged/<step>-<time>`: left in place, the resumed run would
    find its own step number taken when it gets there again (Orbax skips such a save, and the
    check against older steps raises), and keep-last-N could delete the damaged copy. Why at
    the first save and not here: like the tmp-dir cleanup, only the single writer changes the
    directory, and a reader must not move what it merely failed to read.

    Waits for in-flight saves first, so `save(n); restore(t)` reads step n.

    Raises CheckpointError if the directory has no checkpoint, `step` does not exist or is
    damaged, no step restores, or the template's key paths/shapes differ from the
    checkpoint's (a user error, not damage: it raises at once instead of falling back).
    """
    self.wait_until_finished()
    steps = self.all_steps()
    if not steps:
      state = "has no finalized checkpoint" if self._path.exists() else "does not exist"
      raise CheckpointError(
          f"cannot restore: {self.directory!r} {state}. Check the path, or start from scratch "
          "(e.g. `if ckpt.latest_step() is None: init...`) instead of restoring.")
    if step is not None:
      step = int(step)
      if step not in steps:
        raise CheckpointError(
            f"no checkpoint for step {step} in {self.directory!r}; available steps: {steps}")
      try:
        return self._restore_step(step, state_template, optional)
      except Damaged as e:
        raise CheckpointError(
            f"checkpoint step {step} in {self.directory!r} is damaged ({e}); restore another "
            f"step (available: {steps})") from None

    # Any read failure counts as damage: Orbax and TensorStore report a truncated, empty or
    # missing file as JSONDecodeError, ValueError, FileNotFoundError or a bare Exception. A
    # failure that is not damage (e.g. out of memory) fails every step alike, and then nothing
    # is skipped or set aside: the error below lists each step's reason.
    damaged: list[tuple[int, Damaged]] = []
    for s in reversed(steps):
      try:
        state = self._restore_step(s, state_template, optional)
      except Damaged as e:
        damaged.append((s, e))
        continue
      if damaged:
        self._damaged.update(d for d, _ in damaged)
        which = ", ".join(str(d) for d, _ in damaged)
        why = "; ".join(f"step {d}: {e}" if len(damaged) > 1 else str(e) for d, e in damaged)
        _log.warning(
            "checkpoint step%s %s in %s %s damaged (%s): skipped; resuming from step %d (the "
            "damaged data stays on disk; the first save moves it to %s)",
            "s" if len(damaged) > 1 else "", which, self.directory,
            "are" if len(damaged) > 1 else "is", why, s, self._path / _DAMAGED)
      return state
    raise CheckpointError(
        f"no checkpoint in {self.directory!r} restores ("
        + "; ".join(f"step {d}: {e}" for d, e in damaged)
        + "); nothing in it was changed: move it aside, or use another directory")

  def _restore_step(self, step: int, state_template: PyTree,
                    optional: tuple[str, ...] = ()) -> PyTree:
    """Restores one step; raises Damaged for anything that fails while reading its files and
    CheckpointError for a template that does not match what it holds."""
    check_array_files(os.path.join(self.directory, str(step), _ITEM))
    try:
      saved = self._saved_leaves(step)
    except Exception as e:  # pylint: disable=broad-except - see restore
      raise Damaged("reading its metadata", e) from e
    partial = False
    if optional:  # (see restore) the template and the saved leaves cut to what both hold
      if not isinstance(state_template, dict):
        raise TypeError(f"optional={optional}: needs a dict state, not "
                        f"{type(state_template).__name__}")
      held = {p[0] for p in saved if p}
      state_template = {k: v for k, v in state_template.items()
                        if k not in optional or k in held}
      unread = {p for p in saved if p and p[0] in optional and p[0] not in state_template}
      saved = {p: m for p, m in saved.items() if p not in unread}
      partial = bool(unread)
    t_leaves, treedef = jax.tree_util.tree_flatten_with_path(state_template)
    check_template(saved, t_leaves, f"checkpoint step {step} in {self.directory!r}")

    restore_args = [restore_arg(path, x) for path, x in t_leaves]
    # Orbax takes the structure from `item` and everything else from `restore_args`.
    item = jax.tree_util.tree_unflatten(treedef, [x for _, x in t_leaves])
    try:
      with quiet_about(self._path):
        result = self._mngr.restore(step, args=ocp.args.Composite(**{
            _ITEM: ocp.args.PyTreeRestore(
                item=item, restore_args=jax.tree_util.tree_unflatten(treedef, restore_args),
            partial_restore=partial)}))[_ITEM]
    except Exception as e:  # pylint: disable=broad-except - see restore
      raise Damaged("reading its arrays", e) from e
    r_leaves = jax.tree_util.tree_leaves(result)
    if len(r_leaves) != len(t_leaves):  # pragma: no cover - guarded by check_template
      raise CheckpointError(f"restored {len(r_leaves)} leaves, template has {len(t_leaves)}")
    return jax.tree_util.tree_unflatten(
        treedef, [match_template(t, r) for (_, t), r in zip(t_leaves, r_leaves)])

  def read(self, step: int | None = None) -> dict[str, Any]:
    """Every leaf of step `step` (default: latest) on the host, keyed by path
    ("actor/layers/q"), read without a template onto this process's first device: for
    inspecting and comparing checkpoints, whatever process count or mesh wrote them."""
    return {"/".join(norm_path(p)): (np.asarray(x) if hasattr(x, "shape") else x)
            for p, x in jax.tree_util.tree_flatten_with_path(self._read(step))[0]}

  def read_subtree(self, prefix: str, step: int | None = None, *,
                   template: PyTree = None) -> dict[str, Any]:
    """The nested dict of the leaves under `prefix` ("drafter/params", "actor") of step
    `step` (default: latest), and only those are read: params back in their own layout ({}
    where the checkpoint holds none). Without `template`, numpy arrays on the host; with it
    (the subtree as jax.ShapeDtypeStruct leaves with shardings), each leaf is read straight
    onto its sharding in its dtype, e.g. a model spread over a mesh's devices, never whole on
    one; CheckpointError where its paths or shapes differ from the checkpoint's."""
    out = self._read(step, prefix, template)
    if out is None:
      return {}
    if template is not None:
      return out
    return jax.tree.map(lambda x: np.asarray(x) if hasattr(x, "shape") else x, out)

  def _read(self, step: int | None, prefix: str = "", template: PyTree = None) -> PyTree:
    """Step `step`'s tree, or its subtree under `prefix` alone (Orbax's partial restore: the
    rest is not read; None where there is none), onto `template`'s shardings or this
    process's first device."""
    self.wait_until_finished()
    step = self.latest_step() if step is None else int(step)
    if step is None or step not in self.all_steps():
      raise CheckpointError(f"no checkpoint for step {step} in {self.directory!r}")
    md = self._mngr.metadata(step).item_metadata[_ITEM]
    parts = [p for p in prefix.split("/") if p]
    sub = md
    for p in parts:
      if not hasattr(sub, "keys") or p not in sub:
        return None
      sub = sub[p]
    if template is None:
      one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      args = jax.tree.map(lambda m: ocp.ArrayRestoreArgs(sharding=one)
                          if getattr(m, "shape", None) is not None else ocp.RestoreArgs(), sub)
    else:
      saved = {tuple(parts) + norm_path(p): m
               for p, m in jax.tree_util.tree_flatten_with_path(sub)[0]}
      t_leaves = [(tuple(parts) + norm_path(p), x)
                  for p, x in jax.tree_util.tree_flatten_with_path(template)[0]]
      check_template(saved, t_leaves, f"checkpoint step {step} in {self.directory!r}")
      args = jax.tree_util.tree_map_with_path(restore_arg, template)
      sub = template
    for p in reversed(parts):
      sub, args = {p: sub}, {p: args}
    out = self._mngr.restore(step, args=ocp.args.Composite(**{_ITEM: ocp.args.PyTreeRestore(
        item=sub, restore_args=args, partial_restore=bool(parts))}))[_ITEM]
    for p in parts:
      out = out[p]
    return out

  def _saved_leaves(self, step: int) -> dict[tuple[str, ...], Any]:
    """{normalized key path: Orbax leaf metadata} of the checkpoint, read from its metadata
    file only (no array data)."""
    with quiet_about(self._path):
      md = self._mngr.metadata(step).item_metadata
    md = md[_ITEM] if md is not None and _ITEM in md else None
    if md is None:  # its item directory or the item's _METADATA is gone
      raise FileNotFoundError(f"no '{_ITEM}' item metadata in {self._path / str(step)}")
    return {norm_path(p): m for p, m in jax.tree_util.tree_flatten_with_path(md)[0]}

  # ------------------------------------------------------------------ lifecycle

  def wait_until_finished(self) -> None:
    """Block until a pending async save is on disk; SaveFailed if it could not be written."""
    try:
      self._mngr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except - said as the step's, in one line
      self._settle_failed(e)
    self._inflight = None

  def _settle_failed(self, error: Exception) -> None:
    """Raises the failed save of step `_inflight` as SaveFailed, its unfinished files removed
    (the partial step is never restorable; on a full disk its bytes are what is missing)."""
    step, self._inflight, self._failed = self._inflight, None, True
    if jax.process_index() == 0:
      remove_unfinished(self._path, step)
    raise failed(step, self.directory, error) from error

  def close(self) -> None:
    """Wait for pending saves (and old-step deletion), then release Orbax's threads. A save
    failed and already reported (SaveFailed) is not raised again."""
    reported = self._failed
    try:
      self.wait_until_finished()
    except SaveFailed:
      if not reported:
        raise
    finally:
      self._mngr.close()  # (Orbax raises a failed save once: above)
      if self._quiet is not None:
        self._quiet.release(lingering=self._failed)
        self._quiet = None

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    return f"Checkpointer({self.directory!r}, steps={self.all_steps()})"
