"""The shardd.v1 messages and enums in one namespace.

    from shardd import v1
    spec = v1.ModelSpec(architecture="ShardMoEForCausalLM")
"""

# pylint: disable=wildcard-import,unused-wildcard-import
from shardd.proto.coordinator_pb2 import *  # noqa: F401,F403
from shardd.proto.model_pb2 import *  # noqa: F401,F403
from shardd.proto.plan_pb2 import *  # noqa: F401,F403
