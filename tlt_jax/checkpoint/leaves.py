"""How a train-state pytree's leaves meet Orbax's (checkpointer.py): the leaves a save
accepts (`snapshot`), key paths as Orbax stores them, each leaf's shape on disk (typed PRNG
keys as their key data), the restore argument for a template leaf, the type a restored leaf
is given back, and the template check whose one-line `CheckpointError`s name the key path at
fault."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

SCALAR_TYPES = (bool, int, float, str, np.generic)


class CheckpointError(ValueError):
  """A user-fixable checkpoint problem (missing checkpoint/step, template mismatch, bad leaf).

  Raised *instead of* the Orbax error, whose traceback is deep and rarely names the input at
  fault; the message names the directory / key path and says what to change.
  """

def is_key(x: Any) -> bool:
  """True for new-style typed PRNG key arrays (`jax.random.key`), whose dtype is key<impl>."""
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def key_name(k: Any) -> str:
  """One pytree key as Orbax stores it: dict keys, attribute names (namedtuples, dataclasses)
  and sequence indices all become plain strings, so template and checkpoint paths compare."""
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def norm_path(path: tuple) -> tuple[str, ...]:
  return tuple(key_name(k) for k in path)


def fmt_path(path: tuple[str, ...]) -> str:
  return "state" + "".join(f"[{p!r}]" for p in path) if path else "state (the root)"


def stored_shape(leaf: Any) -> tuple[int, ...] | None:
  """Shape the leaf has on disk; None for non-array leaves (python/numpy scalars, str).

  Typed keys are stored as their uint32 key data, shape `leaf.shape + impl.key_shape`
  (e.g. () -> (2,) for threefry), so that is what is compared against the checkpoint.
  """
  if is_key(leaf):
    return tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape,
                                                                          leaf.dtype)).shape)
  if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)):
    return tuple(leaf.shape)
  return None

def check_template(saved: dict, t_leaves: list, where: str) -> None:
  """CheckpointError, one line, for the first template leaf (key path, leaf) the saved
  leaves {key path: Orbax metadata} lack or hold in another shape, or a saved leaf the
  template lacks; where: the checkpoint ("checkpoint step S in DIR")."""
  hint = ("Checkpoint from a different model config (or from code with a different "
          "train-state layout)? Restore it with that config, or use a new directory.")
  t_paths = [norm_path(p) for p, _ in t_leaves]
  t_set = set(t_paths)
  for path, (_, x) in zip(t_paths, t_leaves):
    if path not in saved:
      raise CheckpointError(
          f"{fmt_path(path)} is in the template but not in the {where} (template has "
          f"{len(t_paths)} leaves, checkpoint {len(saved)}). {hint}")
    want, have = stored_shape(x), getattr(saved[path], "shape", None)
    if want is not None and have is not None and tuple(have) != want:
      what = f"typed PRNG key {tuple(x.shape)} -> data " if is_key(x) else ""
      raise CheckpointError(
          f"shape mismatch at {fmt_path(path)}: template {what}{want}, {where} has "
          f"{tuple(have)}. {hint}")
  extra = [p for p in saved if p not in t_set]
  if extra:
    raise CheckpointError(
        f"{fmt_path(extra[0])} is in the {where} but not in the template "
        f"({len(extra)} such leaves). {hint}")

def restore_arg(path: tuple, x: Any) -> ocp.RestoreArgs:
  """How Orbax restores the saved leaf at `path` for the template leaf `x`: arrays onto its
  sharding and dtype, numpy arrays and scalars on the host."""
  if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
    sharding = getattr(x, "sharding", None)
    if sharding is None:
      raise CheckpointError(
          f"template leaf {fmt_path(norm_path(path))} is a ShapeDtypeStruct without a "
          "sharding, so there is no device to restore it onto: build it as "
          "jax.ShapeDtypeStruct(shape, dtype, sharding=...) or pass a concrete array.")
    return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=tuple(x.shape), dtype=x.dtype)
  if isinstance(x, np.ndarray):
    return ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype)
  if isinstance(x, str):
    return ocp.RestoreArgs()
  if isinstance(x, SCALAR_TYPES):  # host-side, whether it was saved as scalar or jax.Array
    return ocp.RestoreArgs(restore_type=np.ndarray)
  raise CheckpointError(
      f"template leaf {fmt_path(norm_path(path))} has type {type(x).__name__}; use "
      "jax.Array / jax.ShapeDtypeStruct (with sharding) / np.ndarray or a python/numpy "
      "scalar of the type you want back.")

def match_template(t: Any, r: Any) -> Any:
  """Give a restored leaf the template leaf's type: typed vs raw PRNG key, numpy scalar types,
  python bool (Orbax returns saved scalars as python int/float and keys as they were saved)."""
  if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)):
    if is_key(t) and not is_key(r):
      r = jax.device_put(jax.random.wrap_key_data(r, impl=key_impl(t)), t.sharding)
    elif not is_key(t) and is_key(r):
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


def key_impl(t: Any) -> Any:
  """PRNG impl of a typed-key template leaf (jax.random.key_impl rejects ShapeDtypeStruct)."""
  if isinstance(t, jax.Array):
    return jax.random.key_impl(t)
  return t.dtype._impl  # pylint: disable=protected-access


def snapshot(state: Any) -> Any:
  """What `Checkpointer.save` hands Orbax: leaf types Orbax cannot store rejected with their
  key path before any write starts, numpy arrays copied (the caller may mutate them in place
  while the async write runs), a numpy bool stored as a bool (Orbax has no handler for it; it
  is restored as the template's type)."""
  def leaf(path, x):
    if isinstance(x, np.ndarray):
      return np.array(x, copy=True)
    if isinstance(x, np.bool_):
      return bool(x)
    # what Orbax stores: numpy numbers and strings, not datetime64, bytes_ and the like
    if isinstance(x, (jax.Array, bool, int, float, str, np.number, np.str_)):
      return x
    raise CheckpointError(
        f"cannot checkpoint {fmt_path(norm_path(path))} of type {type(x).__name__}: leaves "
        "must be jax/numpy arrays, python bool/int/float/str or numpy numbers/bools. "
        "Convert it (e.g. to a dict of arrays) or register its class as a pytree node.")
  return jax.tree_util.tree_map_with_path(leaf, state)
