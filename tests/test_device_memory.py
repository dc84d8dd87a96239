"""A device out of memory mid-run (tlt_jax/device_memory.py): XLA's RESOURCE_EXHAUSTED inside a
phase becomes one line naming the phase, the memory plan's figure and the knobs; anything else
passes through unchanged. (The whole run's path, checkpoint kept and exit status 2:
tests/test_train.py.)"""

import os
import types

import jax
import pytest

from tlt_jax import device_memory, memory
from tlt_jax.errors import ConfigError

OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes."


class _Plan:  # a memory.Plan's interface: per-phase totals, capacity, device, max_batch
  capacity, device, max_batch = 70 * memory.GiB, "h100", 96
  total = staticmethod(lambda phase: {"rollout": 60, "spot": 9, "update": 66}[phase]
                       * memory.GiB)


def _raised_in(path: str) -> BaseException:
  """XLA's error raised by code whose file is `path` (a frame of that module)."""
  try:
    exec(compile(f"raise jax.errors.JaxRuntimeError({OOM!r})", path, "exec"), {"jax": jax})
  except RuntimeError as e:
    return e
  raise AssertionError("nothing raised")


def test_an_oom_in_a_phase_is_one_line_naming_it_the_plan_and_the_knobs():
  run = types.SimpleNamespace(memory=_Plan())
  with pytest.raises(device_memory.DeviceOutOfMemory) as e:
    with device_memory.phase("rollout", run, 7):
      raise jax.errors.JaxRuntimeError(OOM + "\n" + "buffer assignment dump\n" * 50)
  assert isinstance(e.value, ConfigError) and "\n" not in str(e.value)
  assert str(e.value) == (
      f"memory: the rollout phase of step 7 ran out of device memory ({OOM}); the memory plan "
      f"put this phase at 60.00 GiB per device of 70.0 GiB usable on h100: "
      f"{memory.KNOBS['rollout']} (it ran with rollout.max_batch=96) (scripts/plan_memory.py "
      "prints the plan)")
  assert e.value.__cause__ is not None  # (XLA's whole error kept for a traceback's reader)


def test_an_oom_raised_in_the_drafters_code_during_a_rollout_is_the_spot_phase():
  drafter = os.path.join(os.path.dirname(device_memory.__file__), "drafter", "train_step.py")
  err = device_memory.out_of_memory("rollout", _raised_in(drafter), _Plan(), 3, 96)
  assert str(err).startswith("memory: the spot phase of step 3")
  assert memory.KNOBS["spot"] in str(err) and "max_batch" not in str(err)
  rollout = os.path.join(os.path.dirname(device_memory.__file__), "rollout", "engine.py")
  err = device_memory.out_of_memory("rollout", _raised_in(rollout), None, 3)
  assert str(err).startswith("memory: the rollout phase of step 3") and "plan put" not in str(err)


@pytest.mark.parametrize("error", [RuntimeError("INTERNAL: a failed kernel launch"),
                                   ValueError("RESOURCE_EXHAUSTED in a user's message"),
                                   KeyboardInterrupt()])
def test_anything_but_xlas_failed_allocation_passes_through(error):
  with pytest.raises(type(error)) as e:
    with device_memory.phase("update", types.SimpleNamespace(memory=_Plan()), 1):
      raise error
  assert e.value is error


def test_the_device_check_allocates_nothing_on_a_cpu():
  """gpu_check's env stage provokes a real failed allocation on a GPU only: on a CPU XLA's
  allocation can succeed lazily or take the machine down."""
  assert device_memory.check_device() == "device memory check: skipped on cpu"


def test_the_fullest_devices_peak_is_read_and_set_beside_the_plan(monkeypatch):
  """peak_bytes: the largest peak of this process's devices (one with no statistics, as a
  CPU's, skipped); measured: per phase in GiB beside the plan's figure for it."""
  stats = [None, {"peak_bytes_in_use": 3 << 30, "bytes_limit": 70 << 30},
           {"peak_bytes_in_use": 5 << 30, "bytes_limit": 70 << 30, "bytes_in_use": 1}]
  monkeypatch.setattr(jax, "local_devices", lambda: [types.SimpleNamespace(
      memory_stats=lambda s=s: s) for s in stats])
  assert device_memory.peak_bytes() == (5 << 30, 70 << 30)
  peaks = {}
  with device_memory.phase("rollout", types.SimpleNamespace(memory=_Plan()), 1, peaks):
    pass
  assert peaks == {"rollout": 5 << 30, "limit": 70 << 30}
  assert device_memory.measured(peaks, _Plan()) == {
      "peak_gib": {"rollout": 5.0}, "limit_gib": 70.0, "plan_gib": {"rollout": 60.0}}
  assert device_memory.measured({}, _Plan()) is None
