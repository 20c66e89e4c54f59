"""CUDA sources compiled by nvcc from /usr/local/cuda (no rules_cuda).

Only under `--config=cuda` (which sets --define=shardd_cuda=1); otherwise the
targets are incompatible and `bazel build //...` skips them, so the default
build needs no CUDA toolkit.
"""

NVCC = "/usr/local/cuda/bin/nvcc"

# sm_80 (A100) and sm_90a (H100/H200) SASS, plus compute_90 PTX for newer GPUs.
CUDA_GENCODE = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
]

def cuda_compatible():
    """target_compatible_with value: compatible only under --config=cuda."""
    return select({
        "//tools/bazel:cuda_enabled": [],
        "//conditions:default": ["//tools/bazel:incompatible"],
    })

def cuda_library(name, srcs, hdrs = [], deps = [], copts = [], visibility = None, **kwargs):
    """A cc_library whose .cu sources are compiled by nvcc.

    Args:
      name: library name.
      srcs: .cu files (and optionally .cc files compiled by the host compiler).
      hdrs: public headers.
      deps: cc deps (headers reachable from the .cu files must be in the
        workspace: nvcc runs with -I. and -I$(GENDIR)).
      copts: extra nvcc flags.
      visibility: visibility.
      **kwargs: passed to cc_library.
    """
    cu_srcs = [s for s in srcs if s.endswith(".cu")]
    cc_srcs = [s for s in srcs if not s.endswith(".cu")]
    objs = []
    for src in cu_srcs:
        obj = name + "_" + src.replace("/", "_")[:-len(".cu")] + ".o"
        native.genrule(
            name = obj[:-len(".o")] + "_nvcc",
            srcs = [src] + [h for h in native.glob(["**/*.h", "**/*.cuh"], allow_empty = True) if h not in hdrs] + hdrs,
            outs = [obj],
            # nvcc writes temporaries named after small PIDs; the sandbox's
            # PID namespace makes them collide, so run it unsandboxed.
            tags = ["no-sandbox"],
            target_compatible_with = cuda_compatible(),
            cmd = " ".join([
                NVCC,
                "-c",
                "-std=c++17",
                "-O3",
                "-Xcompiler=-fPIC",
                "-I.",
                "-I$(GENDIR)",
                "-I/usr/local/cuda/include",
            ] + CUDA_GENCODE + copts + [
                "$(location " + src + ")",
                "-o $@",
            ]),
            message = "nvcc " + src,
        )
        objs.append(":" + obj)
    native.cc_library(
        name = name,
        srcs = objs + cc_srcs,
        hdrs = hdrs,
        deps = deps + ["//third_party:cuda"],
        target_compatible_with = cuda_compatible(),
        visibility = visibility,
        **kwargs
    )
