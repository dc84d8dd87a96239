#!/usr/bin/env bash
# Sets up (scripts/setup.sh --dev: the test set too) and runs the whole test suite on CPU (8 fake devices).
#
# --max-worker-restart=0: a worker that dies (killed, aborted, or a test past pyproject's
# timeout) ends the run at once, naming the test it was running. Restarting it is worse than
# useless under --dist loadfile: pytest-xdist 3.8 can hang forever handing the dead worker's
# files to its replacement (pytest-dev/pytest-xdist#1378).
# --no-loadscope-reorder: files go to the workers in the order tests/conftest.py sorts them
# (heaviest first), not xdist's (most tests first).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
status=0
# stderr joins stdout: what a dying worker prints (faulthandler's stacks, XLA's last log line,
# tests/conftest.py's exit status of its process) lands in the log beside the test it names
# each worker's memory after every test file (tests/conftest.py), printed if the run fails
export TLT_TEST_MEMORY_LOG=${TLT_TEST_MEMORY_LOG:-$(mktemp -t tlt_jax_test_memory.XXXXXX)}
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart=0 -q "$@" 2>&1 || status=$?
if [ $status -ne 0 ]; then
  # a worker killed for memory leaves no traceback: what each worker held after its last files,
  # and the kernel's log where it can be read
  echo "memory after the last test files (rss: the worker's; peak: its highest so far):"
  for w in gw0 gw1; do grep "^$w " "$TLT_TEST_MEMORY_LOG" | tail -n 2 || true; done
  if dmesg >/dev/null 2>&1; then
    dmesg | grep -iE "out of memory|oom-kill|killed process" | tail -n 5 || true
  fi
fi
exit $status
