#!/usr/bin/env bash
# Creates or brings up to date the tests' Python virtual environment:
# exactly the packages and versions of tools/python-requirements.txt
# (torch, transformers, safetensors, kubernetes-validate and their
# dependencies), from PyPI, in $SHARDD_VENV (default /opt/shardd/venv). A copy
# of the requirements file inside it marks it complete: the tests
# (tools/python_test.sh) refuse an environment whose copy differs, and this
# script does nothing while it matches. The main job never needs it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${SHARDD_VENV:-/opt/shardd/venv}
requirements=tools/python-requirements.txt
stamp=$venv/.shardd-requirements.txt

if cmp -s "$requirements" "$stamp"; then
  echo "setup: Python test environment $venv up to date"
  exit 0
fi
# Debian's interpreter (python3-venv): the one a fresh Debian 12 machine has.
python=/usr/bin/python3
if [[ ! -x "$venv/bin/python" ]]; then
  echo "setup: creating the Python test environment $venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
fi
echo "setup: installing $requirements into $venv (about 3.5 GB from PyPI the first time)"
rm -f "$stamp"
start=$SECONDS
# Every dependency is pinned in the file: --no-deps keeps pip from choosing
# any other version, --only-binary from building anything.
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --require-virtualenv -r "$requirements"
if ! report=$("$venv/bin/pip" check --disable-pip-version-check); then
  echo "$report" >&2
  echo "setup: $requirements is not self-consistent" >&2
  exit 1
fi
cp "$requirements" "$stamp"
echo "setup: Python test environment ready in $((SECONDS - start)) s"
