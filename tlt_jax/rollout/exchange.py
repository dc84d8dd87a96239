"""Executables shared by the processes of a multi-host run, through jax.distributed's store.

A multi-host run's processes (one a host) run the same rollout programs, each on its own
devices. port.py loads one worker's executable onto the other workers of its process; this
module does the same across processes: the first process to claim a program compiles it and
publishes it, serialized, in the coordination service's key-value store (the one
jax.distributed already runs; no shared filesystem assumed); every other process loads it
onto its devices (port.py) instead of compiling it. On a cluster of 8 hosts each program is
compiled once, not 8 times over, and the hosts' compile threads split a step's new arms
between them (a compile thread puts off a program another process is compiling, as it does
one another worker of its process is: sharing.compile_each).

A program is named by a digest of its lowered module (device-free: its shardings name
devices by position) and of what else decides what XLA makes of it (JAX's and the backend's
versions, the kind and count of devices, XLA_FLAGS), so processes agree on a name without
agreeing on anything else; a program whose module differs between processes is simply not
shared. Keys under `tlt_jax/exe/<name>/<round>/`: `claim` (the first process to set it
compiles), `data/<i>` (the serialized executable in chunks of `CHUNK` bytes), `meta` (written
last: JSON with the chunks, the source's device ids and assignment, its compile's seconds and
memory; or `{"none": why}` where there is nothing to load: the compile failed, the backend
cannot serialize it, or the process published its `PUBLISH_CAP`; or `{"cached": true}`: the
claimer took it from JAX's persistent cache, whose executables are not serialized again, and
the others claim it in the next round), `taken` (a count: the last process to load it
deletes the data, so the coordinator holds an executable only until every process has it).
A process that finds the claim taken waits for `meta` (up to `WAIT_S`, then compiles its own).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from typing import Any, Sequence

import jax

from tlt_jax.rollout import port

_log = logging.getLogger(__name__)

PREFIX = "tlt_jax/exe/"
CHUNK = 4 << 20  # bytes a key holds (one gRPC message each)
WAIT_S = 1800.0  # a wait for another process's compile, at most (then compiled here)
PUBLISH_CAP = 1 << 30  # bytes one process publishes over a run, at most

BUSY = object()  # `take(..., wait=False)`: another process is compiling it now


def name_of(lowered: jax.stages.Lowered, devices: Sequence) -> str:
  """The program's name, the same in every process that lowered the same module for devices
  of the same kind and count."""
  from jax._src.lib import version_str as jaxlib_version
  h = hashlib.sha256(lowered.as_text().encode())
  for part in (jax.__version__, jaxlib_version, devices[0].client.platform_version,
               tuple(d.device_kind for d in devices), os.environ.get("XLA_FLAGS", "")):
    h.update(repr(part).encode())
  return h.hexdigest()[:32]


class Exchange:
  """This process's side of the store (`active()`)."""

  def __init__(self, client, me: int, processes: int):
    self._client, self.me, self.processes = client, me, processes
    self._published = 0
    self._lock = threading.Lock()
    self._broken = False
    self._claims: dict[str, str] = {}  # name -> the key prefix this process claimed there
    self._passed: set[str] = set()  # names this process handed to a next round (`cached`)
    # name -> (Portable, compile seconds, memory) this process published or loaded: a program
    # of the process with another key but the same module (a name asked again) loads from it
    self._had: dict[str, tuple] = {}

  def take(self, name: str, lowered: jax.stages.Lowered, *, wait: bool = True):
    """What this process does about program `name`: (Portable, its compile's seconds, its
    memory bytes) loaded from another process's publication; None: compile it here (and
    `publish` if `claimed(name)`); BUSY (only with wait=False): another process is compiling
    it now. A claimer that took it from JAX's persistent cache publishes nothing to load and
    leaves it to the next round (`publish(..., cached=True)`): the processes without it claim
    again, so it is still compiled once for them (a restart, with each host's own cache)."""
    if self._broken:
      return None
    if name in self._had:  # (its arguments' trees may differ: the caller's)
      portable, compile_s, memory = self._had[name]
      return self._portable(portable.data, lowered, portable.ids,
                            portable.assignment), compile_s, memory
    try:
      for r in range(self.processes):
        at = f"{PREFIX}{name}/{r}"
        meta = self._meta(at)
        if meta is None and not self._claim(name, at):
          if not wait:
            return BUSY
          meta = json.loads(self._client.blocking_key_value_get(f"{at}/meta",
                                                                int(WAIT_S * 1000)))
        if meta is None or "none" in meta:
          return None
        if not meta.get("cached"):
          return self._load(name, at, meta, lowered, takers=self.processes - 1 - r)
      return None
    except Exception as e:  # noqa: BLE001 - the store failed us (or the wait ran out)
      self._fail(e)
      return None

  def claimed(self, name: str) -> bool:
    """Whether this process holds a claim on `name` (it compiles and publishes)."""
    return name in self._claims

  def publish(self, name: str, portable: port.Portable | None, compile_s: float,
              memory: int | None, why: str = "", cached: bool = False) -> None:
    """`name`'s executable for the other processes (None: nothing to load, `why`; cached:
    this process took it from JAX's persistent cache, the others claim it again). Never
    raises: a failure leaves them to compile their own."""
    at = self._claims.pop(name)
    meta: dict[str, Any] = {"by": self.me}
    if portable is not None:
      with self._lock:
        fits = self._published + len(portable.data) <= PUBLISH_CAP
        if fits:
          self._published += len(portable.data)
      if not fits:
        portable, why = None, "published its cap"
    try:
      if cached:
        meta["cached"] = True
        self._passed.add(name)
      elif portable is None:
        meta["none"] = why
      else:
        data = portable.data
        chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
        for i, c in enumerate(chunks):
          self._client.key_value_set_bytes(f"{at}/data/{i}", c)
        meta.update(chunks=len(chunks), ids=list(portable.ids),
                    assignment=list(portable.assignment), compile_s=compile_s, memory=memory)
        self._had[name] = (portable, compile_s, memory)
      self._client.key_value_set(f"{at}/meta", json.dumps(meta))
    except Exception as e:  # noqa: BLE001
      self._fail(e)

  def _meta(self, at: str) -> dict | None:
    try:
      return json.loads(self._client.key_value_try_get(f"{at}/meta"))
    except Exception as e:  # noqa: BLE001 - NOT_FOUND: not published (yet)
      if "NOT_FOUND" not in str(e):
        raise
      return None

  def _claim(self, name: str, at: str) -> bool:
    try:
      self._client.key_value_set(f"{at}/claim", str(self.me))
    except Exception as e:  # noqa: BLE001 - ALREADY_EXISTS: another process claimed it
      if "ALREADY_EXISTS" not in str(e):
        raise
      return False
    self._claims[name] = at
    return True

  def _load(self, name: str, at: str, meta: dict, lowered: jax.stages.Lowered, takers: int):
    """The publication at `at` (None where it is gone: every other process took it), and
    its taking counted: the last of `takers` deletes the data."""
    try:
      data = b"".join(self._client.key_value_try_get_bytes(f"{at}/data/{i}")
                      for i in range(meta["chunks"]))
    except Exception as e:  # noqa: BLE001 - NOT_FOUND: every other process took it already
      if "NOT_FOUND" not in str(e):
        raise
      return None
    portable = self._portable(data, lowered, meta["ids"], meta["assignment"])
    # (the publishing process asking for another key of the same module is no taker, nor is
    # one that handed it to this round: the others may still need it)
    if (meta["by"] != self.me and name not in self._passed
        and self._client.key_value_increment(f"{at}/taken", 1) >= takers):
      self._client.key_value_delete(f"{at}/data")
    got = self._had[name] = (portable, float(meta["compile_s"]), meta.get("memory"))
    return got

  @staticmethod
  def _portable(data: bytes, lowered: jax.stages.Lowered, ids, assignment) -> port.Portable:
    return port.Portable(data, jax.tree.structure(lowered.args_info), lowered.out_tree,
                         tuple(ids), tuple(assignment))

  def _fail(self, e: Exception) -> None:
    if not self._broken:
      self._broken = True
      _log.warning("executables are no longer shared between processes (%s: %s); each "
                   "compiles its own", type(e).__name__, str(e)[:200])


_ACTIVE: list = []  # [Exchange | None] once asked
_ACTIVE_LOCK = threading.Lock()


def active() -> Exchange | None:
  """This process's exchange in a multi-process run (jax.distributed initialised), else
  None."""
  with _ACTIVE_LOCK:
    if not _ACTIVE:
      ex = None
      if jax.process_count() > 1:
        from jax._src import distributed as _dist
        client = _dist.global_state.client
        if client is not None:
          ex = Exchange(client, jax.process_index(), jax.process_count())
      _ACTIVE.append(ex)
    return _ACTIVE[0]


def local(devices: Sequence) -> bool:
  """Whether every one of `devices` is this process's (only such programs are exchanged: a
  program over several processes' devices is one SPMD program they all compile)."""
  me = jax.process_index()
  return bool(devices) and all(d.process_index == me for d in devices)
