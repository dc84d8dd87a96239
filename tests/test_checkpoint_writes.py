"""A checkpoint that cannot be written (tlt_jax/checkpoint/writes.py): a step its disk cannot
hold is refused before a byte is written; a write the kernel fails (a file-size limit, as a
full disk would) is found at the next save call and said in one line, its unfinished files
removed, no third-party tracebacks; the steps before it stay whole. (The whole run's path:
tests/test_train.py.)"""

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.checkpoint import Checkpointer, SaveFailed, writes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def test_a_step_its_disk_cannot_hold_is_refused_before_a_byte_is_written(tmp_path, monkeypatch):
  d = str(tmp_path / "ckpt")
  rng = np.random.default_rng(0)
  state = lambda s: {"w": jnp.asarray(rng.random(200_000, np.float32)), "step": s}  # noqa: E731
  ckpt = Checkpointer(d, max_to_keep=2)
  assert ckpt.save(1, state(1))
  ckpt.wait_until_finished()
  need = _du(os.path.join(d, "1"))
  assert 500_000 < need < 900_000  # (the 800 kB array, as OCDBT compresses it)

  monkeypatch.setattr(writes, "free_bytes", lambda directory: need - 1)
  with pytest.raises(SaveFailed) as e:
    ckpt.save(2, state(2))
  assert str(e.value) == (
      f"checkpoint step 2 needs {need / 2**20:.1f} MiB in {d} (step 1's size) and its disk has "
      f"{(need - 1) / 2**20:.1f} MiB free: free space there, or checkpoint to a disk with room")
  assert sorted(os.listdir(d)) == ["1"]  # nothing of step 2, not even its tmp dir

  monkeypatch.setattr(writes, "free_bytes", lambda directory: need)  # exactly room: it saves
  assert ckpt.save(2, state(2))
  ckpt.close()
  assert Checkpointer(d).all_steps() == [1, 2]


def test_a_bucket_is_not_checked_against_a_disk(monkeypatch):
  monkeypatch.setattr(writes, "free_bytes", lambda directory: pytest.fail("a disk was asked"))
  writes.check_room("gs://bucket/run/checkpoints", 2, 1)


# The kernel fails the write: RLIMIT_FSIZE makes any write past 2 MB fail with EFBIG ("File
# too large"; SIGXFSZ ignored), from inside TensorStore's writer threads, as ENOSPC would on a
# full disk; the free space the check sees is this machine's.
_CHILD = textwrap.dedent("""
    import os, resource, signal, sys, time
    import jax, jax.numpy as jnp, numpy as np
    from tlt_jax.checkpoint import Checkpointer, SaveFailed

    d = sys.argv[1]
    ckpt = Checkpointer(d, max_to_keep=2, save_interval_steps=1000)
    ckpt.save(1, {"w": jnp.arange(1000, dtype=jnp.float32), "step": 1})
    ckpt.wait_until_finished()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
    rng = np.random.default_rng(0)
    big = {f"a{i}": jnp.asarray(rng.random(1_000_000, np.float32)) for i in range(4)}
    assert ckpt.save(2, big | {"step": 2}, force=True)  # 16 MB: its write fails
    for step in range(3, 1000):  # a step whose save is not due polls the one in flight
      try:
        ckpt.save(step, {"w": jnp.zeros(3), "step": step})
      except SaveFailed as e:
        print(f"FAILED at {step}: {e}", flush=True)
        break
      time.sleep(0.05)
    ckpt.close()  # (already reported: not again)
    print("CLOSED", flush=True)
""")


def test_a_write_that_fails_is_one_line_at_the_next_save_its_files_removed(tmp_path):
  d = str(tmp_path / "ckpt")
  script = tmp_path / "child.py"
  script.write_text(_CHILD)
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
             XLA_FLAGS="", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(script), d], capture_output=True, text=True,
                        env=env, timeout=180)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert len(lines) == 2 and lines[1] == "CLOSED", proc.stdout + proc.stderr[-3000:]
  at, msg = lines[0].split(": ", 1)
  assert 3 <= int(at.split()[-1]) < 1000  # found by polling, before any save was due
  assert msg == (f"checkpoint step 2 could not be written to {d} ({os.strerror(27)}; its "
                 "unfinished files are removed)")
  assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr, \
      proc.stderr[-3000:]
  assert sorted(os.listdir(d)) == ["1"]  # step 2's tmp dir removed, step 1 whole
  restored = Checkpointer(d).restore({"w": jnp.zeros(1000), "step": 0})
  assert restored["step"] == 1
  np.testing.assert_array_equal(restored["w"], np.arange(1000, dtype=np.float32))


def test_the_reason_is_the_operating_systems_where_orbax_names_one():
  orbax = ValueError('RESOURCE_EXHAUSTED: Error writing "actor.final_norm/0" in OCDBT database '
                     'at local file "/x/5.orbax-checkpoint-tmp/": Failed to write 321778 bytes '
                     "to file 14: No space left on device [os_error_code='28']")
  assert str(writes.failed(5, "/x", orbax)) == (
      "checkpoint step 5 could not be written to /x (No space left on device; its unfinished "
      "files are removed): free space there, or checkpoint to a disk with room")
  other = RuntimeError("PERMISSION_DENIED: cannot open\n" + "spec " * 400)
  assert str(writes.failed(None, "/x", other)) == (
      "a checkpoint could not be written to /x (RuntimeError: PERMISSION_DENIED: cannot open; "
      "its unfinished files are removed)")


def test_only_the_reports_of_a_failed_write_are_dropped(tmp_path):
  """While a Checkpointer writes: asyncio's / absl's records naming its unfinished steps and
  the unraisable "Event loop is closed" (every other array's write after the first failure,
  on a full disk: ~60 in the default run) are dropped; anything else still reaches the
  handlers and the previous unraisable hook, which is back after."""
  import logging
  import types
  d, seen = str(tmp_path / "ckpt"), []
  previous, mine = sys.unraisablehook, lambda u: seen.append(u.exc_value)
  sys.unraisablehook = mine
  try:
    quiet = writes.QuietFailedWrites(d).__enter__()
    for e in (RuntimeError("Event loop is closed"), ValueError(f"{d}/5{TMP_SUFFIX}/x: full"),
              RuntimeError("a user's own error"), ValueError(f"{d}/5/x: not a tmp dir")):
      sys.unraisablehook(types.SimpleNamespace(exc_value=e))
    record = lambda msg, exc=None: logging.LogRecord(  # noqa: E731
        "asyncio", logging.ERROR, __file__, 1, msg, None, (type(exc), exc, None) if exc else None)
    assert not quiet.filter(record(f"Error writing {d}/5{TMP_SUFFIX}/ocdbt"))
    assert not quiet.filter(record("Task exception was never retrieved",
                                   ValueError(f"at {d}/5{TMP_SUFFIX}/d/1: No space left")))
    assert quiet.filter(record("Task exception was never retrieved", ValueError("elsewhere")))
    assert quiet.filter(record(f"saved {d}/5"))
    quiet.__exit__()
    assert [str(e) for e in seen] == ["a user's own error", f"{d}/5/x: not a tmp dir"]
    assert sys.unraisablehook is mine
    # after a failed write, the hook outlives the Checkpointer: the abandoned writes' loop
    # noise can come after its close; the rest still reaches the hook before it
    seen.clear()
    quiet = writes.QuietFailedWrites(d).__enter__()
    quiet.release(lingering=True)
    assert quiet not in logging.getLogger("asyncio").filters
    for e in (RuntimeError("Event loop is closed"), RuntimeError("a user's own error")):
      sys.unraisablehook(types.SimpleNamespace(exc_value=e))
    assert [str(e) for e in seen] == ["a user's own error"]
  finally:
    sys.unraisablehook = previous
