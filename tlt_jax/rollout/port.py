"""An executable compiled for some devices, loaded onto others of the same kind.

Every rollout worker of a process runs the same programs on its own devices: the same model,
buckets and arms, shardings that differ only in which devices their meshes hold. XLA compiles
a program for a device assignment, but what it compiles does not depend on which devices of
one kind those are (JAX's persistent compilation cache keys GPU programs without their
assignment for that reason). So one worker's executable is serialized once and loaded with
the other worker's devices substituted position for position (`port`): milliseconds where a
compile of a 7B target's chunk takes tens of seconds, and the process compiles each program
once instead of once per worker (executables.py's `_compile_once`).

`placement(leaves)` is the device-free description of arguments' shardings that says which
programs are one: each sharding with its mesh's devices replaced by their positions among
the arguments' devices, and those devices in order. Shardings of other kinds than
NamedSharding and SingleDeviceSharding are not described (None): such a program is not ported.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import serialize_executable as _serial
from jax.sharding import NamedSharding, SingleDeviceSharding


def placement(leaves: Sequence[Any]) -> tuple[tuple, tuple] | None:
  """(each leaf's (device-free sharding, weak type), the devices they name in order of first
  appearance), or None where a leaf's sharding is of another kind."""
  order: dict = {}
  pos = lambda d: order.setdefault(d, len(order))  # noqa: E731
  out = []
  for x in leaves:
    # (an uncommitted array goes where the committed ones are: it names no device)
    sh = getattr(x, "sharding", None) if getattr(x, "committed", True) else None
    if isinstance(sh, NamedSharding):
      m = sh.mesh
      desc = ("named", m.axis_names, m.devices.shape, tuple(m.axis_types), sh.spec,
              sh.memory_kind, tuple(pos(d) for d in m.devices.flat))
    elif isinstance(sh, SingleDeviceSharding):
      desc = ("single", sh.memory_kind, pos(next(iter(sh.device_set))))
    elif sh is None:
      desc = None
    else:
      return None
    out.append((desc, bool(getattr(x, "weak_type", False))))
  kinds = tuple(d.device_kind for d in order)  # (one program per kind of device)
  return (tuple(out), kinds), tuple(order)


def serialize(exe: jax.stages.Compiled) -> tuple:
  """What `port` loads from (once per source executable: every worker ports from it)."""
  return _serial.serialize(exe)


class _Remapped(_serial._JaxPjrtUnpickler):
  """Unpickles a serialized executable with each device replaced (by id) and the executable
  loaded for the replacements' assignment."""

  def __init__(self, file, backend, devices: dict, assignment: list):
    super().__init__(file, backend, assignment)
    self._devices, self._assignment = devices, assignment

  def persistent_load(self, pid):
    if pid[0] == "device":
      return self._devices[pid[1]]
    if pid[0] == "exec":
      from jax._src import compiler  # (the options jit compiles with, for this assignment)
      n = len(self._assignment)
      opts = compiler.get_compile_options(
          num_replicas=1, num_partitions=n,
          device_assignment=np.array(self._assignment, dtype=object).reshape(1, n),
          backend=self.backend)
      return self.backend.deserialize_executable(pid[1], self.execution_devices, opts)
    return super().persistent_load(pid)


def port(serialized: tuple, exe: jax.stages.Compiled, source: Sequence, target: Sequence
         ) -> jax.stages.Compiled:
  """`exe` (compiled with arguments on devices `source`, `serialized` its `serialize`) as an
  executable for the same arguments on `target`, device i of one for device i of the other.
  Raises where the backend cannot serialize or load (the caller compiles instead)."""
  data, in_tree, out_tree = serialized
  by_id = {s.id: t for s, t in zip(source, target)}
  assignment = [by_id[d.id] for d in exe._executable._unloaded_executable.device_list]
  backend = target[0].client
  unloaded, args_info, no_kwargs = _Remapped(io.BytesIO(data), backend, by_id,
                                             assignment).load()
  return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info), out_tree,
                             no_kwargs=no_kwargs)
