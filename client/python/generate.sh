#!/usr/bin/env bash
# Generates the protobuf and gRPC modules of the shardd Python package from
# proto/*.proto with Debian's protoc and grpc_python_plugin, for using the
# package outside Bazel (Bazel runs this same script from a genrule).
#
#   client/python/generate.sh [--out DIR] [PROTO...]
#
# DIR defaults to client/python/shardd/proto (git-ignored); PROTO defaults to
# every proto/*.proto. protoc writes `from proto import x_pb2` (the imports
# mirror the .proto paths); those lines are rewritten to
# `from shardd.proto import x_pb2` so the modules live inside the package.
set -euo pipefail

out=""
if [[ "${1:-}" == "--out" ]]; then
  [[ $# -ge 2 ]] || { echo "generate.sh: --out needs a directory" >&2; exit 2; }
  out="$2"
  shift 2
fi
# Relative paths are taken from the caller's directory, before the cd below.
[[ -z "$out" || "$out" == /* ]] || out="$PWD/$out"

root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
[[ -n "$out" ]] || out="$root/client/python/shardd/proto"

protoc="${PROTOC:-/usr/bin/protoc}"
plugin="${GRPC_PYTHON_PLUGIN:-/usr/bin/grpc_python_plugin}"
for tool in "$protoc" "$plugin"; do
  if [[ ! -x "$tool" ]]; then
    echo "generate.sh: $tool not found (apt-get install protobuf-compiler protobuf-compiler-grpc)" >&2
    exit 1
  fi
done

if [[ $# -eq 0 ]]; then
  set -- proto/*.proto
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$protoc" -I. --python_out="$tmp" --pyi_out="$tmp" --grpc_out="$tmp" \
  --plugin=protoc-gen-grpc="$plugin" "$@"

mkdir -p "$out"
for file in "$tmp"/proto/*; do
  sed -e 's/^from proto import /from shardd.proto import /' "$file" \
    >"$out/$(basename "$file")"
done
printf '"""Generated protobuf and gRPC modules (client/python/generate.sh)."""\n' \
  >"$out/__init__.py"
