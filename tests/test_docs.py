"""Every relative link, anchor and quoted repo path in README.md and docs/ resolves
(docs/check_links.py), so moving a section or renaming a module cannot leave a dead pointer."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_and_docs_links_resolve():
  r = subprocess.run([sys.executable, os.path.join(ROOT, "docs", "check_links.py")],
                     capture_output=True, text=True, cwd=ROOT)
  assert r.returncode == 0, r.stdout + r.stderr
  assert " 0 broken" in r.stdout, r.stdout
