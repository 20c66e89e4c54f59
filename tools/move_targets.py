#!/usr/bin/python3
"""Moves Bazel targets (their rules and source files) to another package.

Usage: tools/move_targets.py OLD_PKG:NAME=NEW_PKG ... [--rename OLD=NEW ...]

For each target: the rule block leaves OLD_PKG/BUILD.bazel for
NEW_PKG/BUILD.bazel (created when missing), its local srcs/hdrs/data files
are `git mv`ed, and then every reference in the repository follows:
labels in BUILD files (written relative to the package they stand in),
#include paths, header guards, and paths and labels in scripts and docs.
`--rename OLD=NEW` also renames a moved file (path relative to the repo).
Used for the package restructuring (docs/design.md); run from the repo root.
"""
import os
import re
import subprocess
import sys

ROOT = os.getcwd()
SKIP_DIRS = {".git", "node_modules"}
TEXT_EXT = (".cc", ".h", ".cu", ".cuh", ".md", ".sh", ".py", ".bzl", ".yaml",
            ".yml", ".txt", ".json", ".proto", ".bazelrc", "")
LABEL_RE = re.compile(r'"(//[\w/.-]*)?(:[\w/.+-]+)?"')


def build_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames
                       if d not in SKIP_DIRS and not d.startswith("bazel-")]
        if "BUILD.bazel" in filenames:
            yield os.path.relpath(dirpath, ROOT)


def split_blocks(text):
    """Top-level statements with their attached comment lines."""
    lines = text.splitlines(keepends=True)
    blocks, pending, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            pending.append(line)
            i += 1
            continue
        if not line.strip():
            if pending:
                blocks.append(("text", "".join(pending)))
                pending = []
            blocks.append(("text", line))
            i += 1
            continue
        depth, j, body = 0, i, []
        while True:
            body.append(lines[j])
            stripped = re.sub(r'"[^"]*"', '""', lines[j].split("#")[0])
            depth += stripped.count("(") + stripped.count("[") - \
                stripped.count(")") - stripped.count("]")
            j += 1
            if depth <= 0 or j >= len(lines):
                break
        name = re.search(r'^\s*name\s*=\s*"([^"]+)"', "".join(body), re.M)
        blocks.append(("rule" if name else "stmt",
                       "".join(pending) + "".join(body),
                       name.group(1) if name else None))
        pending = []
        i = j
    if pending:
        blocks.append(("text", "".join(pending)))
    return blocks


def local_files(block_text, pkg):
    out = []
    for attr in ("srcs", "hdrs", "data", "textual_hdrs"):
        m = re.search(attr + r'\s*=\s*\[([^\]]*)\]', block_text)
        if not m:
            m2 = re.search(attr + r'\s*=\s*"([^"]+)"', block_text)
            items = [m2.group(1)] if m2 else []
        else:
            items = re.findall(r'"([^"]+)"', m.group(1))
        for it in items:
            if it.startswith("//") or it.startswith(":") or it.startswith("@"):
                continue
            if os.path.isfile(os.path.join(pkg, it)):
                out.append(it)
    return out


def main(argv):
    moves, renames = [], {}
    args = iter(argv)
    for a in args:
        if a == "--rename":
            old, new = next(args).split("=")
            renames[old] = new
        else:
            src, new_pkg = a.split("=")
            pkg, name = src.split(":")
            moves.append((pkg, name, new_pkg))

    label_map = {(p, n): np for p, n, np in moves}
    pkgs = {p: split_blocks(open(os.path.join(p, "BUILD.bazel")).read())
            for p in build_files()}
    file_map = {}
    moved_blocks = {}
    loads_needed = {}
    for pkg, name, new_pkg in moves:
        blocks = pkgs[pkg]
        idx = [i for i, b in enumerate(blocks)
               if b[0] == "rule" and b[2] == name]
        if len(idx) != 1:
            sys.exit("no single rule %s:%s" % (pkg, name))
        block = blocks.pop(idx[0])
        moved_blocks.setdefault(new_pkg, []).append((pkg, block))
        for f in local_files(block[1], pkg):
            old = pkg + "/" + f
            new = renames.get(old, new_pkg + "/" + os.path.basename(f))
            file_map[old] = new
        for b in blocks:
            stmt = "".join(l for l in b[1].splitlines(True)
                           if not l.startswith("#"))
            if b[0] != "stmt" or not stmt.startswith("load("):
                continue
            symbols = re.findall(r'"(\w+)"', b[1])
            used = [s for s in symbols
                    if re.search(r"\b%s\(" % s, block[1])]
            if used:
                source = re.match(r'load\("([^"]+)"', stmt).group(1)
                loads_needed.setdefault(new_pkg, {}).setdefault(
                    source, set()).update(used)

    def resolve(label_pkg, label_name, ctx_pkg):
        pkg = label_pkg if label_pkg is not None else ctx_pkg
        name = label_name if label_name else pkg.split("/")[-1]
        if (pkg, name) in label_map:
            pkg = label_map[(pkg, name)]
        elif pkg + "/" + name in file_map:
            newpath = file_map[pkg + "/" + name]
            pkg, name = os.path.dirname(newpath), os.path.basename(newpath)
        if pkg == ctx_pkg:
            return '":%s"' % name
        if name == pkg.split("/")[-1]:
            return '"//%s"' % pkg
        return '"//%s:%s"' % (pkg, name)

    def rewrite_labels(text, ctx_pkg, origin_pkg):
        def sub(m):
            p, n = m.group(1), m.group(2)
            if p is None and n is None:
                return m.group(0)
            p = p[2:] if p else origin_pkg
            n = n[1:] if n else None
            return resolve(p, n, ctx_pkg)
        return LABEL_RE.sub(sub, text)

    # Write BUILD files.
    for new_pkg in moved_blocks:
        if new_pkg not in pkgs:
            pkgs[new_pkg] = [("text", 'package(default_visibility = '
                              '["//visibility:public"])\n'), ("text", "\n")]
    out = {}
    for pkg, blocks in pkgs.items():
        parts = []
        for b in blocks:
            parts.append(rewrite_labels(b[1], pkg, pkg) if b[0] != "text"
                         else b[1])
        text = "".join(parts)
        extra = []
        for source, symbols in sorted(loads_needed.get(pkg, {}).items()):
            missing = [s for s in sorted(symbols)
                       if not re.search(r'load\("%s"[^)]*"%s"' % (
                           re.escape(source), s), text)]
            if missing:
                extra.append("load(%s)\n" % ", ".join(
                    ['"%s"' % source] + ['"%s"' % s for s in missing]))
        for origin, b in moved_blocks.get(pkg, []):
            extra.append("\n" + rewrite_labels(b[1], pkg, origin))
        if extra:
            head, sep, rest = text.partition("\n\n")
            loads = [e for e in extra if e.startswith("load(")]
            rules = [e for e in extra if not e.startswith("load(")]
            text = head + "\n" + "".join(loads) + sep + rest
            text = text.rstrip("\n") + "\n" + "".join(rules)
        text = re.sub(r"\n{3,}", "\n\n", text)
        out[pkg] = text
    for old, new in file_map.items():
        os.makedirs(os.path.dirname(new), exist_ok=True)
        subprocess.check_call(["git", "mv", old, new])
    for pkg, text in out.items():
        os.makedirs(pkg, exist_ok=True)
        with open(os.path.join(pkg, "BUILD.bazel"), "w") as f:
            f.write(text)

    # Text rewrites everywhere else.
    subs = []
    for old, new in file_map.items():
        subs.append((re.compile(r"(?<![\w/.-])" + re.escape(old) + r"(?![\w])"),
                     new))
        if old.endswith(".h"):
            g_old = "SHARDD_" + re.sub(r"[/.]", "_", old).upper() + "_"
            g_new = "SHARDD_" + re.sub(r"[/.]", "_", new).upper() + "_"
            subs.append((re.compile(r"\b" + g_old + r"\b"), g_new))
    for (pkg, name), new_pkg in label_map.items():
        subs.append((re.compile(r"//" + re.escape(pkg) + ":" + name +
                                r"(?![\w])"), "//%s:%s" % (new_pkg, name)))
        subs.append((re.compile(r"(?<![\w/.-])" + re.escape(pkg) + "/" + name +
                                r"(?![\w.])"), "%s/%s" % (new_pkg, name)))
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames
                       if d not in SKIP_DIRS and not d.startswith("bazel-")]
        for fn in filenames:
            if fn == "BUILD.bazel" or os.path.splitext(fn)[1] not in TEXT_EXT:
                continue
            path = os.path.join(dirpath, fn)
            try:
                text = open(path).read()
            except (UnicodeDecodeError, OSError):
                continue
            new = text
            for rx, rep in subs:
                new = rx.sub(rep, new)
            if new != text:
                with open(path, "w") as f:
                    f.write(new)
    print("moved %d targets, %d files" % (len(moves), len(file_map)))


if __name__ == "__main__":
    main(sys.argv[1:])
