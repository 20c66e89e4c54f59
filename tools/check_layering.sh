#!/usr/bin/env bash
# Fails when a package depends on one above it (docs/design.md, "Package
# map"). Two checks, both needed: the Bazel deps of every target (bazel
# query over all select() branches, so CUDA-only deps count too), and the
# #include lines of every source file (an include can compile through a
# transitive dep that the BUILD file never names).
#
#   client -> server -> core (planner, program, checkpoint, layout, model)
#                                         <- worker -> kernels
#   viz, common, proto below all; testing/ only for tests.
#
# Usage: tools/check_layering.sh   (from anywhere in the repo; exit 1 on a
# violation, listing each with the rule it breaks).
set -euo pipefail
cd "$(dirname "$0")/.."

edges=$(mktemp)
tests=$(mktemp)
test_files=$(mktemp)
trap 'rm -f "$edges" "$tests" "$test_files"' EXIT
bazel query --noshow_progress --nograph:factored --output=graph \
  'deps(//..., 1)' 2>/dev/null | grep -- ' -> ' >"$edges"
bazel query --noshow_progress \
  'kind("cc_test|py_test|sh_test", //...) + attr(testonly, 1, //...)' \
  2>/dev/null >"$tests"
# The sources and headers of those targets: test code, whose includes may
# reach testing/ (a testonly helper library's header too).
test_targets='kind("cc_test", //...) + attr(testonly, 1, //...)'
bazel query --noshow_progress \
  "labels(srcs, $test_targets) + labels(hdrs, $test_targets)" \
  2>/dev/null >"$test_files"

exec /usr/bin/python3 - "$edges" "$tests" "$test_files" <<'EOF'
import os
import re
import sys

# Each layer may use the layers listed for it (and itself); a package
# belongs to the layer of its longest matching prefix.
CORE = ["planner", "program", "checkpoint", "layout", "model"]
BASE = ["common", "proto", "third_party", "tools/bazel"]
ALLOWED = {
    "third_party": [],
    "tools/bazel": ["third_party"],
    "proto": ["third_party", "tools/bazel"],
    "common": ["proto", "third_party", "tools/bazel"],
    "kernels": BASE,
    "viz": BASE,
    "model": BASE,
    "layout": ["model"] + BASE,
    "program": ["layout", "model"] + BASE,
    "checkpoint": ["layout", "model"] + BASE,
    "planner": ["program", "layout", "model"] + BASE,
    "worker": CORE + ["kernels", "viz"] + BASE,
    "server": CORE + ["viz"] + BASE,
    "client": ["server"] + CORE + ["viz"] + BASE,
}
# Packages above every layer (tests, benchmarks, deployment, tooling) may
# use anything; tests/data holds data files any test may read.
TOP = ["tests", "bench", "deploy", "tools", "client/python", "testing"]
ANYONE = ["tests/data"]


def layer(pkg):
    best = None
    for name in list(ALLOWED) + TOP:
        if pkg == name or pkg.startswith(name + "/"):
            if best is None or len(name) > len(best):
                best = name
    return best


def allowed(src_pkg, dst_pkg, is_test):
    if dst_pkg.startswith("@") or src_pkg == dst_pkg:
        return True
    src, dst = layer(src_pkg), layer(dst_pkg)
    if src is None or src in TOP:
        return True
    if any(dst_pkg == a or dst_pkg.startswith(a + "/") for a in ANYONE):
        return True
    if dst == "testing":
        return is_test
    if dst == src:
        return True
    return dst in ALLOWED[src]


def pkg_of(label):
    label = label.strip('"')
    if label.startswith("@"):
        return "@", label
    pkg = label[2:].split(":")[0]
    return pkg, label


tests = {l.strip() for l in open(sys.argv[2]) if l.strip()}
# //pkg:file.h -> pkg/file.h
test_files = {l.strip()[2:].replace(":", "/") for l in open(sys.argv[3])
              if l.strip().startswith("//")}
bad = []
for line in open(sys.argv[1]):
    a, b = [s.strip() for s in line.split(" -> ")]
    (pa, la), (pb, lb) = pkg_of(a), pkg_of(b)
    if pb == "@":
        continue
    if not allowed(pa, pb, la in tests):
        bad.append("dep      %s -> %s  (%s may use: %s)" % (
            la, lb, layer(pa), ", ".join(ALLOWED.get(layer(pa), []))))

# Includes: the package of an included repo header is its directory.
packages = set()
for d, dirs, files in os.walk("."):
    dirs[:] = [x for x in dirs if not x.startswith((".", "bazel-"))
               and x != "node_modules"]
    if "BUILD.bazel" in files:
        packages.add(os.path.normpath(d))
include_re = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
for pkg in sorted(packages):
    for f in sorted(os.listdir(pkg)):
        if not f.endswith((".h", ".cc", ".cu", ".cuh")):
            continue
        path = os.path.join(pkg, f)
        is_test = (f.endswith("_test.cc") or layer(pkg) in TOP or
                   path[2:] in test_files or
                   os.path.normpath(path) in test_files)
        for n, text in enumerate(open(path, errors="replace"), 1):
            m = include_re.match(text)
            if not m or "/" not in m.group(1):
                continue
            inc_pkg = os.path.dirname(m.group(1))
            if inc_pkg not in packages:
                continue
            if not allowed(pkg, inc_pkg, is_test):
                bad.append("include  %s:%d: %s  (%s may use: %s)" % (
                    path, n, m.group(1), layer(pkg),
                    ", ".join(ALLOWED.get(layer(pkg), []))))

if bad:
    print("check_layering: %d dependencies point up (docs/design.md):"
          % len(bad))
    print("\n".join(bad))
    sys.exit(1)
print("check_layering: %d deps and every include point down" %
      sum(1 for _ in open(sys.argv[1])))
EOF
