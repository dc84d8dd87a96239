"""A device that runs out of memory mid-run, said as the memory plan's phase and its knobs.

The memory plan (memory.py) refuses at start-up a run whose phases do not fit. Its
activations are estimates, though, and XLA's allocator needs room the plan does not see
(fragmentation, a compile's scratch), so a phase can still exhaust a device. XLA then raises
a RESOURCE_EXHAUSTED error from deep inside a jitted call, often on a rollout worker's
thread. Here that error becomes one line (`DeviceOutOfMemory`, a ConfigError: exit status 2)
naming the phase of the step, what the plan put it at, and the knobs that shrink it. train.py
adds which checkpoint is on disk once the saves in flight have finished.

`phase(name, run, step)` wraps a phase's work (and names it in a profiler trace: nearly free
when none is under way, tlt_jax/profiling.py). A rollout's error raised inside the drafter's
code (tlt_jax/drafter/) is the spot phase: the idle workers training the drafter.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Any, Iterator

from tlt_jax import watchdog
from tlt_jax.errors import ConfigError
from tlt_jax.memory import GiB, KNOBS

_DRAFTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafter") + os.sep


class DeviceOutOfMemory(ConfigError):
  """A phase of the run ran out of device memory (the message names the phase and the fix)."""


def is_oom(e: BaseException) -> bool:
  """Whether `e` is XLA's failed allocation (jax.errors.JaxRuntimeError, RESOURCE_EXHAUSTED)."""
  return isinstance(e, RuntimeError) and "RESOURCE_EXHAUSTED" in str(e)


def _in_drafter(e: BaseException) -> bool:
  return any(f.filename.startswith(_DRAFTER) for f in traceback.extract_tb(e.__traceback__))


def out_of_memory(name: str, e: BaseException, plan: Any, step: int,
                  max_batch: int | None = None) -> DeviceOutOfMemory:
  """The one-line error for XLA's `e` in phase `name` of `step` (plan: the run's memory.Plan,
  or None)."""
  if name == "rollout" and _in_drafter(e):
    name = "spot"
  xla = str(e).strip().splitlines()[0]
  xla = xla if len(xla) <= 160 else xla[:157] + "..."
  at = ""
  if plan is not None:
    at = f"; the memory plan put this phase at {plan.total(name) / GiB:.2f} GiB per device"
    if plan.capacity is not None:
      at += f" of {plan.capacity / GiB:.1f} GiB usable on {plan.device}"
  ran = f" (it ran with rollout.max_batch={max_batch})" if name == "rollout" and max_batch else ""
  return DeviceOutOfMemory(
      f"memory: the {name} phase of step {step} ran out of device memory ({xla}){at}: "
      f"{KNOBS[name]}{ran} (scripts/plan_memory.py prints the plan)")


@contextlib.contextmanager
def phase(name: str, run: Any, step: int, peaks: dict[str, int] | None = None
          ) -> Iterator[None]:
  """Runs a phase of `run` (its `memory` plan, its engines' max_batch) at `step`; XLA's
  RESOURCE_EXHAUSTED inside becomes `out_of_memory`'s error. With `peaks`, the devices' peak
  bytes in use so far at the phase's end go in as peaks[name] (`peak_bytes`). Its start and
  end are progress for the watchdog (watchdog.py), which names the phase if the run hangs."""
  import jax
  watchdog.beat(name)
  try:
    with jax.profiler.TraceAnnotation(name):
      yield
  except DeviceOutOfMemory:
    raise
  except Exception as e:
    if not is_oom(e):
      raise
    plan = getattr(run, "memory", None)
    raise out_of_memory(name, e, plan, step,
                        plan.max_batch if plan is not None else None) from e
  watchdog.beat()
  if peaks is not None:
    got = peak_bytes()
    if got is not None:
      peaks[name], peaks["limit"] = got


def peak_bytes() -> tuple[int, int] | None:
  """(peak bytes in use since the process started, the allocator's limit) of this process's
  fullest device; None where the backend keeps no statistics (the CPU). XLA keeps no peak per
  interval: a phase's figure is the peak so far at its end."""
  import jax
  got = [(int(s["peak_bytes_in_use"]), int(s.get("bytes_limit", 0)))
         for s in (d.memory_stats() for d in jax.local_devices())
         if s and "peak_bytes_in_use" in s]
  return max(got) if got else None


def measured(peaks: dict[str, int], plan: Any) -> dict[str, Any] | None:
  """A step's `memory` metrics: each phase's peak so far at its end beside what the memory
  plan put that phase at, and the allocator's limit, in GiB (process 0's devices); None
  where nothing was measured."""
  if not peaks:
    return None
  phases = [k for k in peaks if k != "limit"]
  out: dict[str, Any] = {"peak_gib": {k: peaks[k] / GiB for k in phases},
                         "limit_gib": peaks["limit"] / GiB}
  if plan is not None:
    out["plan_gib"] = {k: plan.total(k) / GiB for k in phases}
  return out


def check_device() -> str:
  """On a GPU, one allocation past its allocator's limit: whether XLA's error is the one
  `is_oom` recognises (gpu_check's env stage: `python -m tlt_jax.device_memory`); elsewhere
  nothing is allocated (a CPU's allocation can succeed lazily, or take the machine down)."""
  import jax
  import jax.numpy as jnp
  dev = jax.devices()[0]
  limit = (dev.memory_stats() or {}).get("bytes_limit") if dev.platform == "gpu" else None
  if not limit:
    return f"device memory check: skipped on {dev.platform}"
  try:
    jax.block_until_ready(jnp.zeros((int(limit) // 4 + (1 << 28),), jnp.float32))
  except Exception as e:  # noqa: BLE001 - what XLA raised is the finding
    line = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
    return (f"device memory check: {'recognised' if is_oom(e) else 'NOT recognised'} "
            f"({type(e).__name__}: {line})")
  return "device memory check: an allocation past the allocator's limit succeeded"


if __name__ == "__main__":
  print(check_device())
