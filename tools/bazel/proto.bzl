"""C++ and gRPC code generation with the system protoc (no downloads)."""

def cc_grpc_proto_library(name, srcs, deps = [], grpc = True, visibility = None):
    """Generates <x>.pb.{h,cc} (and <x>.grpc.pb.{h,cc}) for each .proto in srcs.

    Outputs mirror the source path, so code includes "proto/x.pb.h".

    Args:
      name: name of the resulting cc_library.
      srcs: .proto files in this package.
      deps: cc libraries of imported protos (their .proto files must be listed
        in `proto_deps` of this package or be well-known types).
      grpc: also run grpc_cpp_plugin.
      visibility: visibility of the cc_library.
    """
    outs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs += [base + ".pb.h", base + ".pb.cc"]
        if grpc:
            outs += [base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    grpc_flags = ""
    if grpc:
        grpc_flags = "--grpc_out=$(GENDIR) --plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin"
    native.genrule(
        name = name + "_gen",
        srcs = srcs,
        outs = outs,
        cmd = "/usr/bin/protoc -I. --cpp_out=$(GENDIR) " + grpc_flags + " $(SRCS)",
        message = "protoc " + name,
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + ["//third_party:grpc", "//third_party:protobuf"],
        visibility = visibility,
    )
