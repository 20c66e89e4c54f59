#!/usr/bin/env bash
# Runs a Python test with Debian's /usr/bin/python3 (the interpreter
# python3-grpcio, python3-protobuf and python3-torch are installed for; not
# whatever `python3` is first on PATH), with the shardd package (sources and
# Bazel-generated modules) on PYTHONPATH. Runs from the runfiles root.
#
#   run_py_test.sh TEST.py [ARGS...]
set -euo pipefail
python=/usr/bin/python3
if [[ ! -x "$python" ]]; then
  echo "FAIL: $python is missing (apt-get install python3; tools/setup.sh)" >&2
  exit 1
fi
test_file="$1"
shift
export PYTHONPATH="$PWD/client/python:$PWD/$(dirname "$test_file")${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
exec "$python" "$test_file" "$@"
