#!/usr/bin/env bash
# Runs a Python test with Debian's /usr/bin/python3 (the interpreter
# python3-grpcio and python3-protobuf are installed for; not whatever
# `python3` is first on PATH), with the shardd package (sources and
# Bazel-generated modules) on PYTHONPATH. Runs from the runfiles root.
#
#   run_py_test.sh [--requirements FILE] TEST.py [ARGS...]
#
# With --requirements (tools/python-requirements.txt), the test runs under the
# tests' virtual environment instead (tools/python_test.sh): torch and
# PyPI's grpcio and protobuf at Debian's versions.
set -euo pipefail
requirements=
if [[ "${1:-}" == --requirements ]]; then
  requirements=$2
  shift 2
fi
test_file="$1"
shift
export PYTHONPATH="$PWD/client/python:$PWD/$(dirname "$test_file")${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
if [[ -n "$requirements" ]]; then
  exec tools/python_test.sh "$requirements" "$test_file" "$@"
fi
python=/usr/bin/python3
if [[ ! -x "$python" ]]; then
  echo "FAIL: $python is missing (apt-get install python3; tools/setup.sh)" >&2
  exit 1
fi
exec "$python" "$test_file" "$@"
