"""An executable compiled for some devices, loaded onto others of the same kind.

Every rollout worker of a run runs the same programs on its own devices: the same model,
buckets and arms, shardings that differ only in which devices their meshes hold. XLA compiles
a program for a device assignment, but what it compiles does not depend on which devices of
one kind those are (JAX's persistent compilation cache keys GPU programs without their
assignment for that reason). So one worker's executable is serialized once (`portable`) and
loaded with another worker's devices substituted position for position (`port`):
milliseconds where a compile of a 7B target's chunk takes tens of seconds. The workers of a
process load from each other (executables.py's `_compile_once`), the processes of a
multi-host run from each other's (exchange.py).

`placement(leaves)` is the device-free description of arguments' shardings that says which
programs are one: each sharding with its mesh's devices replaced by their positions among
the arguments' devices, and those devices in order. Shardings of other kinds than
NamedSharding and SingleDeviceSharding are not described (None): such a program is not ported.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Portable:
  """A compiled executable without its devices: what `port` loads onto other ones. `data`
  names devices by id (`ids`, the program's devices in `placement`'s order, position by
  position); `assignment`, the executable's device assignment as positions in `ids`. The
  trees are the caller's (a process that lowered the same program has its own)."""
  data: bytes
  in_tree: Any
  out_tree: Any
  ids: tuple[int, ...]
  assignment: tuple[int, ...]


def portable(exe: jax.stages.Compiled, devices: Sequence) -> Portable:
  """`exe`, compiled for arguments on `devices` (`placement`'s order), made portable: once per
  source executable (every worker ports from it). Raises where the backend cannot serialize
  it."""
  data, in_tree, out_tree = _serial.serialize(exe)
  pos = {d.id: i for i, d in enumerate(devices)}
  assignment = tuple(pos[d.id] for d in exe._executable._unloaded_executable.device_list)
  return Portable(data, in_tree, out_tree, tuple(d.id for d in devices), assignment)


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


def port(p: Portable, target: Sequence) -> jax.stages.Compiled:
  """`p` as an executable for the same arguments on `target`, device i of `p.ids` for device
  i of `target`. Raises where the backend cannot load it (the caller compiles instead)."""
  by_id = dict(zip(p.ids, target))
  assignment = [target[i] for i in p.assignment]
  backend = target[0].client
  unloaded, args_info, no_kwargs = _Remapped(io.BytesIO(p.data), backend, by_id,
                                             assignment).load()
  return jax.stages.Compiled(unloaded.load(), [], p.in_tree.unflatten(args_info), p.out_tree,
                             no_kwargs=no_kwargs)
