"""The code passes ruff's pyflakes checks and the 100-column limit (pyproject.toml [tool.ruff]):
an unused import or variable, an undefined name or an over-long line fails here, not in review."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff() -> list[str]:
  exe = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
  if exe is None:
    pytest.skip("ruff is not installed (requirements-dev.txt has it: scripts/setup.sh --dev)")
  return [exe]


def test_ruff_finds_nothing():
  r = subprocess.run(_ruff() + ["check", "--no-cache", "tlt_jax", "tests", "scripts", "configs"],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_flags_what_it_is_configured_to(tmp_path):
  # the configuration is read and applied: an unused import and a 101-column line are found
  bad = tmp_path / "bad.py"
  bad.write_text("import os\nx = '" + "a" * 95 + "'\n")
  r = subprocess.run(_ruff() + ["check", "--no-cache", "--config",
                                os.path.join(ROOT, "pyproject.toml"), str(bad)],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 1
  assert "F401" in r.stdout and "E501" in r.stdout, r.stdout
