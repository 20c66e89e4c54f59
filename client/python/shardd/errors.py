"""The exceptions of the shardd client."""

from __future__ import annotations

from typing import Optional

import grpc


class ShardError(Exception):
    """A failed call: the gRPC status code and the coordinator's message.

    Server errors keep the code and message the coordinator sent (see
    proto/coordinator.proto for which RPC returns which code); transport
    failures arrive as UNAVAILABLE or DEADLINE_EXCEEDED; invalid client
    options (unreadable TLS files, a certificate without its key) as
    INVALID_ARGUMENT naming the option.

    Attributes:
        code: the ``grpc.StatusCode``.
        message: the message without the code.
        rpc: the RPC that failed ("SubmitModel"), or "" for local errors.
    """

    def __init__(self, code: grpc.StatusCode, message: str, rpc: str = "") -> None:
        self.code = code
        self.message = message
        self.rpc = rpc
        prefix = f"{rpc}: " if rpc else ""
        super().__init__(f"{prefix}{code.name}: {message}")

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError, rpc: str) -> "ShardError":
        """Converts a ``grpc.RpcError`` raised by a stub call."""
        code: Optional[grpc.StatusCode] = None
        details: Optional[str] = None
        # RpcErrors raised by calls are also grpc.Call objects.
        if isinstance(error, grpc.Call):
            code = error.code()
            details = error.details()
        return cls(code or grpc.StatusCode.UNKNOWN, details or str(error), rpc)


class JobFailedError(ShardError):
    """A training job failed on the workers (code ABORTED).

    The message is the coordinator's: it names the step, the rank, its
    address and the cause.

    Attributes:
        job_id: the failed job.
    """

    def __init__(self, job_id: str, message: str) -> None:
        self.job_id = job_id
        super().__init__(grpc.StatusCode.ABORTED,
                         f"job {job_id} failed: {message}", "WatchStep")
