#!/usr/bin/env bash
# Sets up (scripts/setup.sh --dev: the test set too) and runs the whole test suite on CPU (8 fake devices).
#
# --max-worker-restart=0: a worker that dies (killed, aborted, or a test past pyproject's
# timeout) ends the run at once, naming the test it was running. Restarting it is worse than
# useless under --dist loadfile: pytest-xdist 3.8 can hang forever handing the dead worker's
# files to its replacement (pytest-dev/pytest-xdist#1378).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
status=0
.venv/bin/python -m pytest -n 2 --dist loadfile --max-worker-restart=0 -q "$@" || status=$?
if [ $status -ne 0 ] && dmesg >/dev/null 2>&1; then
  # a worker killed for memory leaves no traceback; the kernel's log says so
  dmesg | grep -iE "out of memory|oom-kill|killed process" | tail -n 5 || true
fi
exit $status
