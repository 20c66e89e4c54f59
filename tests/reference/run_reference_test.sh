#!/usr/bin/env bash
# Runs a reference test with Debian's /usr/bin/python3 (the interpreter
# python3-torch is installed for).
#   run_reference_test.sh TEST.py ARGS...
set -euo pipefail
if [[ ! -x /usr/bin/python3 ]] || ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "FAIL: /usr/bin/python3 with python3-torch is needed (tools/setup.sh)" >&2
  exit 1
fi
export PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3 "$@"
