"""One run per workdir (tlt_jax/workdir.py `claim`): the main command given a workdir another
run holds stops in one line naming that run, before it reads or writes anything there; the
hold ends with its process however it ends (kill -9 included); a filesystem without locks is
said and the run goes on."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tlt_jax import workdir
from tlt_jax.errors import ConfigError
from user_env import user_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_HOLDER = textwrap.dedent("""
    import sys, time
    from tlt_jax import workdir
    workdir.claim(sys.argv[1])
    print("HELD", flush=True)
    time.sleep(600)
""")


def _env():
  return dict(user_env(), PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")


def test_a_second_run_on_a_held_workdir_stops_in_one_line_until_the_holder_dies(tmp_path):
  d = tmp_path / "run"
  d.mkdir()
  holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(d)], stdout=subprocess.PIPE,
                            text=True, env=_env(), cwd=ROOT)
  try:
    assert holder.stdout.readline().strip() == "HELD"
    held = json.loads((d / ".tlt_jax.lock").read_text())
    assert held["pid"] == holder.pid
    proc = subprocess.run(
        [sys.executable, "-m", "tlt_jax.train", "--config", "configs/default.py",
         "--workdir", str(d)], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        f"error: config.workdir={str(d)!r}: is in use by another run (pid {holder.pid}, host "
        f"{held['host']}, started {held['started']}: {held['command']}): wait for it to end or "
        "stop it, or pass another --workdir")
    assert os.listdir(d) == [".tlt_jax.lock"]  # nothing read or written there
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  # killed, the kernel let go of it: the next run holds it
  again = subprocess.Popen([sys.executable, "-c", _HOLDER, str(d)], stdout=subprocess.PIPE,
                           text=True, env=_env(), cwd=ROOT)
  try:
    assert again.stdout.readline().strip() == "HELD"
  finally:
    again.kill()
    again.wait()


def test_the_same_process_claims_its_workdir_again_and_a_filesystem_without_locks_is_said(
    tmp_path, monkeypatch, capsys):
  workdir.claim(str(tmp_path))
  workdir.claim(str(tmp_path / "."))  # (this process's run again: a notebook's, a test's)

  def no_locks(fd, op):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
  monkeypatch.setattr(workdir.fcntl, "flock", no_locks)
  other = tmp_path / "nfs"
  other.mkdir()
  workdir.claim(str(other))
  assert capsys.readouterr().err == (
      f"workdir: {other} cannot be locked on its filesystem ({os.strerror(errno.ENOLCK)}): a "
      "second run given it would not be stopped\n")


def test_a_held_workdir_is_a_config_error_naming_the_key(tmp_path, monkeypatch):
  def held(fd, op):
    raise BlockingIOError(errno.EWOULDBLOCK, "Resource temporarily unavailable")
  monkeypatch.setattr(workdir.fcntl, "flock", held)
  (tmp_path / ".tlt_jax.lock").write_text("not json")  # (a holder that wrote nothing readable)
  with pytest.raises(ConfigError) as e:
    workdir.claim(str(tmp_path))
  assert e.value.key == "workdir" and str(e.value) == (
      f"config.workdir={str(tmp_path)!r}: is in use by another run (its holder unknown): wait "
      "for it to end or stop it, or pass another --workdir")
