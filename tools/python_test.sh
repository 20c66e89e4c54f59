#!/usr/bin/env bash
# Runs a Python test under the tests' virtual environment (tools/python_env.sh,
# installed by tools/setup.sh).
#   python_test.sh REQUIREMENTS TEST.py ARGS...
# REQUIREMENTS is tools/python-requirements.txt as a data dependency: a change
# to it invalidates Bazel's cached results, and an environment installed from
# another version of it is refused.
set -euo pipefail
venv=${SHARDD_VENV:-/opt/shardd/venv}
requirements=$1
shift
if ! cmp -s "$requirements" "$venv/.shardd-requirements.txt"; then
  echo "FAIL: the Python test environment $venv is missing or was installed" \
       "from another tools/python-requirements.txt: run tools/setup.sh" >&2
  exit 1
fi
export PYTHONDONTWRITEBYTECODE=1
# Nothing may come from a hub at run time.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="${TEST_TMPDIR:-/tmp}/hf"
exec "$venv/bin/python" "$@"
