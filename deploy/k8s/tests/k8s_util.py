"""Helpers the deploy/k8s tests share: finding kubectl, rendering overlays."""

import os
import shutil
import subprocess
import tempfile

import yaml

# The kustomizations the tests render, relative to deploy/k8s.
KUSTOMIZATIONS = ("overlays/cpu", "overlays/gpu", "train")


def runfiles_root():
    """The directory the bazel test runs in (paths below are relative to it)."""
    return os.getcwd()


def kubectls():
    """Every kubectl to render with: the one on PATH, then those named in
    SHARDD_KUBECTLS (colon-separated, e.g. an old kubectl 1.20 beside a new
    one), without duplicates."""
    found = []
    on_path = shutil.which("kubectl")
    if on_path:
        found.append(on_path)
    for extra in os.environ.get("SHARDD_KUBECTLS", "").split(":"):
        if extra and extra not in found:
            found.append(extra)
    real, unique = set(), []
    for path in found:
        key = os.path.realpath(path)
        if key not in real:
            real.add(key)
            unique.append(path)
    return unique


def kubectl_env(home):
    env = dict(os.environ)
    # kubectl may write a cache under HOME; keep it in the test's temp dir.
    env["HOME"] = home
    env["KUBECONFIG"] = os.path.join(home, "no-kubeconfig")
    return env


def copy_tree(dest):
    """Copies deploy/k8s (runfile symlinks resolved: kustomize refuses files
    whose real path lies outside the kustomization) to dest; returns it."""
    source = os.path.join(runfiles_root(), "deploy", "k8s")
    shutil.copytree(source, dest, symlinks=False,
                    ignore=shutil.ignore_patterns("node_modules", "tests"))
    return dest


def render(kubectl, tree, kustomization, home):
    """`kubectl kustomize` of tree/kustomization: (objects, stderr). Raises
    RuntimeError with kubectl's message when it fails."""
    result = subprocess.run(
        [kubectl, "kustomize", os.path.join(tree, kustomization)],
        capture_output=True, text=True, timeout=60, env=kubectl_env(home))
    if result.returncode != 0:
        raise RuntimeError(
            f"{kubectl} kustomize {kustomization} exited "
            f"{result.returncode}: {result.stderr.strip()}")
    objects = [o for o in yaml.safe_load_all(result.stdout) if o]
    return objects, result.stderr


def by_kind(objects, kind, name=None):
    """The objects of `kind` (and `name`, when given)."""
    return [o for o in objects
            if o.get("kind") == kind and
            (name is None or o["metadata"]["name"] == name)]


def one(objects, kind, name):
    matches = by_kind(objects, kind, name)
    if len(matches) != 1:
        raise AssertionError(f"expected one {kind}/{name}, got {len(matches)}")
    return matches[0]


def make_temp_dir(prefix):
    return tempfile.mkdtemp(prefix=prefix,
                            dir=os.environ.get("TEST_TMPDIR"))
