"""Python client of shardd, the distributed sharding daemon for MoE training.

    from shardd import Coordinator, ShardError

The protobuf and gRPC modules are generated into ``shardd.proto`` (by Bazel,
or by client/python/generate.sh outside it); their messages are re-exported
here as ``shardd.v1``.
"""

from shardd.client import (DEFAULT_IDLE_TIMEOUT_S, DEFAULT_TIMEOUT_S,
                           Coordinator, Job, ModelRef, ModelSource,
                           SubmittedModel, model_request, plan_options,
                           read_token_file)
from shardd.errors import JobFailedError, ShardError
from shardd import v1

__all__ = [
    "Coordinator",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "Job",
    "JobFailedError",
    "ModelRef",
    "ModelSource",
    "ShardError",
    "SubmittedModel",
    "model_request",
    "plan_options",
    "read_token_file",
    "v1",
]
