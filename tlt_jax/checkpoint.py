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

On-disk layout: `<dir>/<step>/state/...` (one Orbax PyTree item named "state", OCDBT format),
`<dir>/<step>/_CHECKPOINT_METADATA`.

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

PyTree = Any

__all__ = ["Checkpointer", "CheckpointError"]

_ITEM = "state"  # name of the single Orbax item inside every step directory
_SCALAR_TYPES = (bool, int, float, str, np.generic)
_log = logging.getLogger(__name__)


class CheckpointError(ValueError):
  """A user-fixable checkpoint problem (missing checkpoint/step, template mismatch, bad leaf).

  Raised *instead of* the Orbax error, whose traceback is deep and rarely names the input at
  fault; the message names the directory / key path and says what to change.
  """


def _is_key(x: Any) -> bool:
  """True for new-style typed PRNG key arrays (`jax.random.key`), whose dtype is key<impl>."""
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _key_name(k: Any) -> str:
  """One pytree key as Orbax stores it: dict keys, attribute names (namedtuples, dataclasses)
  and sequence indices all become plain strings, so template and checkpoint paths compare."""
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _norm_path(path: tuple) -> tuple[str, ...]:
  return tuple(_key_name(k) for k in path)


def _fmt_path(path: tuple[str, ...]) -> str:
  return "state" + "".join(f"[{p!r}]" for p in path) if path else "state (the root)"


def _stored_shape(leaf: Any) -> tuple[int, ...] | None:
  """Shape the leaf has on disk; None for non-array leaves (python/numpy scalars, str).

  Typed keys are stored as their uint32 key data, shape `leaf.shape + impl.key_shape`
  (e.g. () -> (2,) for threefry), so that is what is compared against the checkpoint.
  """
  if _is_key(leaf):
    return tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape,
                                                                          leaf.dtype)).shape)
  if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)):
    return tuple(leaf.shape)
  return None


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
    self._mngr = ocp.CheckpointManager(directory, options=options, handler_registry=registry)
    self._inflight: int | None = None  # step of a started, not yet finalized, async save
    self._prepared = False

  # ------------------------------------------------------------------ queries

  def all_steps(self) -> list[int]:
    """Finalized steps, ascending. A save still in flight is not listed (it is not restorable
    yet, and if the process dies it never will be).

    Until this Checkpointer has saved, every call re-lists the directory, so a reader (e.g. an
    evaluator polling for new checkpoints) sees the writer's new steps; the writer itself uses
    Orbax's in-memory list, which it keeps up to date.
    """
    if not self._prepared:
      self._mngr.reload()
    steps = sorted(int(s) for s in self._mngr.all_steps())
    if self._inflight is not None:
      if self._mngr.is_saving_in_progress():
        steps = [s for s in steps if s != self._inflight]
      else:
        self._inflight = None
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
    Returns once `state` is copied to host memory; call `wait_until_finished()` to block until
    it is on disk. Errors from a background write surface on the next save/wait/close.

    state: any pytree of jax.Array (any sharding, incl. typed PRNG keys), np.ndarray, python
      bool/int/float/str and numpy scalars; dicts, lists, tuples, namedtuples (optax states),
      registered dataclasses; None and empty containers are kept as structure.
    """
    step = int(step)
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
    state = self._check_and_snapshot(state)
    if not self._prepared:
      self._prepare_for_first_save()
    started = self._mngr.save(
        step, args=ocp.args.Composite(**{_ITEM: ocp.args.PyTreeSave(state)}), force=force)
    if started:
      self._inflight = step
    return bool(started)

  def _check_and_snapshot(self, state: PyTree) -> PyTree:
    """Reject leaf types Orbax cannot store (with the key path, before any write starts), and
    copy numpy arrays: the caller may mutate them in place while the async write runs."""
    def leaf(path, x):
      if isinstance(x, np.ndarray):
        return np.array(x, copy=True)
      if isinstance(x, (jax.Array,) + _SCALAR_TYPES):
        return x
      raise CheckpointError(
          f"cannot checkpoint {_fmt_path(_norm_path(path))} of type {type(x).__name__}: leaves "
          "must be jax/numpy arrays, python bool/int/float/str or numpy scalars. Convert it "
          "(e.g. to a dict of arrays) or register its class as a pytree node.")
    return jax.tree_util.tree_map_with_path(leaf, state)

  def _prepare_for_first_save(self) -> None:
    """Create the directory and delete tmp dirs of saves that died mid-write.

    Orbax already removes a leftover tmp dir of the *same* step before re-saving it; this also
    removes those of other steps, which would otherwise accumulate (disk space) forever.
    Only the (single) writer does this, see `__init__`.
    """
    self._path.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
      for tmp in ocp.path.step.all_temporary_paths(self._path):
        _log.warning("removing unfinished checkpoint %s (a save that was interrupted)",
                     tmp.get())
        tmp.get().rmtree()
    self._prepared = True

  # ------------------------------------------------------------------ restore

  def restore(self, state_template: PyTree, step: int | None = None) -> PyTree:
    """Read step `step` (default: latest) into a pytree shaped like `state_template`.

    Why a template: a checkpoint stores values and shapes but not where they should live.
    Each array leaf is read directly onto its template leaf's `.sharding` (any mesh, any
    partitioning, unrelated to how it was saved) in the template's dtype (a differing saved
    dtype is cast), with no full host copy. Pass `jax.ShapeDtypeStruct(shape, dtype,
    sharding=...)` leaves (e.g. from `jax.eval_shape` of the init fn) to avoid allocating the
    state twice; concrete jax.Arrays also work. Non-array leaves (python/numpy scalars, str,
    np.ndarray) come back as the template's type. Typed and raw (uint32) PRNG keys come back
    as whatever the template has.

    Waits for in-flight saves first, so `save(n); restore(t)` reads step n.

    Raises CheckpointError if the directory has no checkpoint, `step` does not exist, or the
    template's key paths/shapes differ from the checkpoint's.
    """
    self.wait_until_finished()
    steps = self.all_steps()
    if not steps:
      state = "has no finalized checkpoint" if self._path.exists() else "does not exist"
      raise CheckpointError(
          f"cannot restore: {self.directory!r} {state}. Check the path, or start from scratch "
          "(e.g. `if ckpt.latest_step() is None: init...`) instead of restoring.")
    if step is None:
      step = steps[-1]
    step = int(step)
    if step not in steps:
      raise CheckpointError(
          f"no checkpoint for step {step} in {self.directory!r}; available steps: {steps}")

    saved = self._saved_leaves(step)
    t_leaves, treedef = jax.tree_util.tree_flatten_with_path(state_template)
    self._check_template(step, saved, t_leaves)

    restore_args = [self._restore_arg(path, x) for path, x in t_leaves]
    # Orbax takes the structure from `item` and everything else from `restore_args`.
    item = jax.tree_util.tree_unflatten(treedef, [x for _, x in t_leaves])
    result = self._mngr.restore(step, args=ocp.args.Composite(**{_ITEM: ocp.args.PyTreeRestore(
        item=item, restore_args=jax.tree_util.tree_unflatten(treedef, restore_args))}))[_ITEM]
    r_leaves = jax.tree_util.tree_leaves(result)
    if len(r_leaves) != len(t_leaves):  # pragma: no cover - guarded by _check_template
      raise CheckpointError(f"restored {len(r_leaves)} leaves, template has {len(t_leaves)}")
    return jax.tree_util.tree_unflatten(
        treedef, [_match_template(t, r) for (_, t), r in zip(t_leaves, r_leaves)])

  def read(self, step: int | None = None) -> dict[str, Any]:
    """Every leaf of step `step` (default: latest) on the host, keyed by path
    ("actor/layers/q"), read without a template onto this process's first device: for
    inspecting and comparing checkpoints, whatever process count or mesh wrote them."""
    self.wait_until_finished()
    step = self.latest_step() if step is None else int(step)
    if step is None or step not in self.all_steps():
      raise CheckpointError(f"no checkpoint for step {step} in {self.directory!r}")
    md = self._mngr.metadata(step).item_metadata[_ITEM]
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    args = jax.tree.map(lambda m: ocp.ArrayRestoreArgs(sharding=one)
                        if getattr(m, "shape", None) is not None else ocp.RestoreArgs(), md)
    out = self._mngr.restore(step, args=ocp.args.Composite(**{_ITEM: ocp.args.PyTreeRestore(
        item=md, restore_args=args)}))[_ITEM]
    return {"/".join(_norm_path(p)): (np.asarray(x) if hasattr(x, "shape") else x)
            for p, x in jax.tree_util.tree_flatten_with_path(out)[0]}

  def _saved_leaves(self, step: int) -> dict[tuple[str, ...], Any]:
    """{normalized key path: Orbax leaf metadata} of the checkpoint, read from its metadata
    file only (no array data)."""
    md = self._mngr.metadata(step).item_metadata
    md = md[_ITEM] if md is not None and _ITEM in md else None
    if md is None:
      raise CheckpointError(
          f"step {step} in {self.directory!r} has no '{_ITEM}' item: it was not written by "
          "tlt_jax.checkpoint.Checkpointer (or is damaged).")
    return {_norm_path(p): m for p, m in jax.tree_util.tree_flatten_with_path(md)[0]}

  def _check_template(self, step: int, saved: dict, t_leaves: list) -> None:
    hint = ("Checkpoint from a different model config (or from code with a different "
            "train-state layout)?")
    where = f"checkpoint step {step} in {self.directory!r}"
    t_paths = [_norm_path(p) for p, _ in t_leaves]
    t_set = set(t_paths)
    for path, (_, x) in zip(t_paths, t_leaves):
      if path not in saved:
        raise CheckpointError(
            f"{_fmt_path(path)} is in the template but not in the {where} (template has "
            f"{len(t_paths)} leaves, checkpoint {len(saved)}). {hint}")
      want, have = _stored_shape(x), getattr(saved[path], "shape", None)
      if want is not None and have is not None and tuple(have) != want:
        what = f"typed PRNG key {tuple(x.shape)} -> data " if _is_key(x) else ""
        raise CheckpointError(
            f"shape mismatch at {_fmt_path(path)}: template {what}{want}, {where} has "
            f"{tuple(have)}. {hint}")
    extra = [p for p in saved if p not in t_set]
    if extra:
      raise CheckpointError(
          f"{_fmt_path(extra[0])} is in the {where} but not in the template "
          f"({len(extra)} such leaves). {hint}")

  @staticmethod
  def _restore_arg(path: tuple, x: Any) -> ocp.RestoreArgs:
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
      sharding = getattr(x, "sharding", None)
      if sharding is None:
        raise CheckpointError(
            f"template leaf {_fmt_path(_norm_path(path))} is a ShapeDtypeStruct without a "
            "sharding, so there is no device to restore it onto: build it as "
            "jax.ShapeDtypeStruct(shape, dtype, sharding=...) or pass a concrete array.")
      return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=tuple(x.shape), dtype=x.dtype)
    if isinstance(x, np.ndarray):
      return ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype)
    if isinstance(x, str):
      return ocp.RestoreArgs()
    if isinstance(x, _SCALAR_TYPES):  # host-side, whether it was saved as scalar or jax.Array
      return ocp.RestoreArgs(restore_type=np.ndarray)
    raise CheckpointError(
        f"template leaf {_fmt_path(_norm_path(path))} has type {type(x).__name__}; use "
        "jax.Array / jax.ShapeDtypeStruct (with sharding) / np.ndarray or a python/numpy "
        "scalar of the type you want back.")

  # ------------------------------------------------------------------ lifecycle

  def wait_until_finished(self) -> None:
    """Block until a pending async save is on disk; re-raises its error, if any."""
    try:
      self._mngr.wait_until_finished()
    finally:
      self._inflight = None

  def close(self) -> None:
    """Wait for pending saves (and old-step deletion), then release Orbax's threads."""
    self._inflight = None
    self._mngr.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    return f"Checkpointer({self.directory!r}, steps={self.all_steps()})"


def _match_template(t: Any, r: Any) -> Any:
  """Give a restored leaf the template leaf's type: typed vs raw PRNG key, numpy scalar types,
  python bool (Orbax returns saved scalars as python int/float and keys as they were saved)."""
  if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)):
    if _is_key(t) and not _is_key(r):
      r = jax.device_put(jax.random.wrap_key_data(r, impl=_key_impl(t)), t.sharding)
    elif not _is_key(t) and _is_key(r):
      r = jax.random.key_data(r)
    if r.sharding != t.sharding:  # e.g. key arrays come back as P(None,) for a P() template
      r = jax.device_put(r, t.sharding)
    return r
  if isinstance(t, np.ndarray):
    return np.asarray(r, dtype=t.dtype)
  if isinstance(t, np.generic):
    return type(t)(np.asarray(r).item())
  if isinstance(t, (bool, int, float)) and not isinstance(r, str):
    return type(t)(np.asarray(r).item())
  return r


def _key_impl(t: Any) -> Any:
  """PRNG impl of a typed-key template leaf (jax.random.key_impl rejects ShapeDtypeStruct)."""
  if isinstance(t, jax.Array):
    return jax.random.key_impl(t)
  return t.dtype._impl  # pylint: disable=protected-access
