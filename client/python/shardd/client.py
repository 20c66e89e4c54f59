"""A typed, blocking client of the shardd coordinator (proto/coordinator.proto).

Every unary call carries a deadline (the client's ``timeout`` unless the call
passes its own); the event stream of a job has none, and is cancelled instead
when no event arrives for ``idle_timeout``. Every failure raises
:class:`shardd.ShardError` with the gRPC code and the coordinator's message.
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
from dataclasses import dataclass, field
from typing import (Any, Callable, Iterator, List, Mapping, Optional, Sequence,
                    Tuple, TypeVar, Union)

import grpc

from shardd.errors import JobFailedError, ShardError
from shardd.proto import coordinator_pb2 as cpb
from shardd.proto import coordinator_pb2_grpc as cpb_grpc
from shardd.proto import model_pb2 as mpb
from shardd.proto import plan_pb2 as ppb

# A model to submit: a parsed Hugging Face config.json or native spec (a
# dict; one with a top-level "root" member is a native spec, as on the
# server), a ModelSpec message, or a path to either JSON file.
ModelSource = Union[Mapping[str, Any], mpb.ModelSpec, pathlib.Path]
# A model the coordinator already has (its id) or one to submit.
ModelRef = Union[str, ModelSource]

_Response = TypeVar("_Response")

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_IDLE_TIMEOUT_S = 600.0


def _invalid(message: str) -> ShardError:
    return ShardError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _read_file(path: Union[str, os.PathLike], option: str) -> bytes:
    """A whole file. Raises ShardError(INVALID_ARGUMENT) naming `option`."""
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError as error:
        raise _invalid(f"{option}: cannot read {path}: {error.strerror}") from None
    if not data:
        raise _invalid(f"{option}: {path} is empty")
    return data


def read_token_file(path: Union[str, os.PathLike], option: str = "token_file") -> str:
    """The first line of a token file, surrounding whitespace removed.

    Raises:
        ShardError: INVALID_ARGUMENT naming `option` when the file cannot be
            read or the token is empty.
    """
    text = _read_file(path, option).decode("utf-8", errors="replace")
    lines = text.splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise _invalid(f"{option}: the first line of {path} is empty")
    return token


def plan_options(
    *,
    dp: Optional[int] = None,
    replicate: Optional[int] = None,
    ep: Optional[int] = None,
    ep_capacity_factor: Optional[float] = None,
    strategy: Optional[str] = None,
    microbatches: Optional[int] = None,
    passes: Optional[int] = None,
    no_grad_passes: Optional[int] = None,
    defer_grad_sync: Optional[bool] = None,
    reshard_after_forward: Optional[Union[bool, int]] = None,
    forward_prefetch: Optional[int] = None,
    backward_prefetch: Optional[int] = None,
    mixed_precision: Optional[bool] = None,
    keep_compute_shard: Optional[bool] = None,
    bucket_elements: Optional[int] = None,
    include_timeline: Optional[bool] = None,
    shard_placement: Optional[str] = None,
    micro_batch_size: Optional[int] = None,
    seq_len: Optional[int] = None,
    activation_checkpointing: Optional[str] = None,
    worker_device: Optional[str] = None,
    lora_rank: Optional[int] = None,
    lora_alpha: Optional[float] = None,
    lora_targets: Optional[Sequence[str]] = None,
) -> ppb.PlanOptions:
    """Builds a PlanOptions message; None leaves the strategy's default.

    Args:
        dp: ranks to shard over (MeshSpec.dp_shard).
        replicate: replicas (MeshSpec.dp_replicate, HSDP when > 1).
        ep: expert-parallel degree (MeshSpec.ep): the dp ranks form ep
            groups, each holding 1/ep of every layer's routed experts
            (docs/expert_parallel.md).
        ep_capacity_factor: with ep, the routing skew the activation model
            assumes (default 2.0, between 1 and ep).
        strategy: a registered strategy instead of the model's architecture.
        microbatches, passes, no_grad_passes, defer_grad_sync: the step shape.
        reshard_after_forward: True/False, or an int group size.
        forward_prefetch, backward_prefetch: prefetch depths.
        mixed_precision: False plans every dtype as the parameter's own.
        keep_compute_shard: keep a compute-dtype copy of every shard.
        bucket_elements: flat-bucket size (megatron_fsdp).
        include_timeline: return the full memory timeline.
        shard_placement: "auto" (default) or "dim0".
        micro_batch_size, seq_len: count each rank's activations for that
            many sequences of seq_len tokens per micro-batch (a job's plan
            always counts its own).
        activation_checkpointing: "none", "all", "experts" or "every:K":
            the layers (or only the experts) that recompute in backward.
        worker_device: "cpu" (default) or "cuda": whose activations to
            count (a GPU worker keeps them in bf16 under mixed precision,
            with its kernels' saved state); a job's plan takes the device
            from its workers.
        lora_rank, lora_alpha, lora_targets: LoRA fine-tuning
            (docs/lora.md): rank-R adapters on PEFT's module names (and
            "experts"), scaled by alpha / rank (alpha default 8); every
            other weight frozen.
    """
    options = ppb.PlanOptions()
    if lora_rank is not None:
        if not lora_targets:
            raise _invalid("lora_targets: name the modules to adapt "
                           "(q_proj, v_proj, ..., experts)")
        options.lora.rank = lora_rank
        options.lora.alpha = 8.0 if lora_alpha is None else lora_alpha
        options.lora.targets.extend(lora_targets)
    elif lora_alpha is not None or lora_targets:
        raise _invalid("lora_alpha, lora_targets: need lora_rank")
    if dp is not None:
        options.mesh.dp_shard = dp
    if replicate is not None:
        options.mesh.dp_replicate = replicate
    if ep is not None:
        options.mesh.ep = ep
    if ep_capacity_factor is not None:
        options.ep_capacity_factor = ep_capacity_factor
    if strategy is not None:
        options.strategy = strategy
    if microbatches is not None:
        options.microbatches = microbatches
    if passes is not None:
        options.passes = passes
    if no_grad_passes is not None:
        options.no_grad_passes = no_grad_passes
    if defer_grad_sync is not None:
        options.defer_grad_sync = defer_grad_sync
    if isinstance(reshard_after_forward, bool):
        options.reshard_after_forward.reshard = reshard_after_forward
    elif reshard_after_forward is not None:
        options.reshard_after_forward.group_size = reshard_after_forward
    if forward_prefetch is not None:
        options.forward_prefetch_depth = forward_prefetch
    if backward_prefetch is not None:
        options.backward_prefetch_depth = backward_prefetch
    if mixed_precision is not None:
        options.mixed_precision = mixed_precision
    if keep_compute_shard is not None:
        options.keep_compute_shard = keep_compute_shard
    if bucket_elements is not None:
        options.bucket_elements = bucket_elements
    if shard_placement is not None:
        options.shard_placement = shard_placement
    if micro_batch_size is not None:
        options.micro_batch_size = micro_batch_size
    if seq_len is not None:
        options.seq_len = seq_len
    if activation_checkpointing is not None:
        options.activation_checkpointing = activation_checkpointing
    if worker_device is not None:
        devices = {"cpu": ppb.WORKER_DEVICE_CPU, "cuda": ppb.WORKER_DEVICE_CUDA}
        if worker_device not in devices:
            raise _invalid(
                f"worker_device: expected 'cpu' or 'cuda', got {worker_device!r}")
        options.worker_device = devices[worker_device]
    if include_timeline is not None:
        options.include_timeline = include_timeline
    return options


def _merge_options(options: Optional[ppb.PlanOptions],
                   overrides: Mapping[str, Any]) -> ppb.PlanOptions:
    """`options` (copied) with the keyword overrides of plan_options on top."""
    merged = ppb.PlanOptions()
    if options is not None:
        merged.CopyFrom(options)
    merged.MergeFrom(plan_options(**overrides))
    return merged


def model_request(model: ModelSource, *, name: str = "",
                  options: Optional[ppb.PlanOptions] = None) -> cpb.SubmitModelRequest:
    """The SubmitModelRequest for `model` (see ModelSource).

    A dict is sent as JSON text, so the coordinator parses and validates it
    and its errors name the JSON path (``dims.top_k: ...``).

    Raises:
        ShardError: INVALID_ARGUMENT when a file cannot be read or is not
            JSON, or `model` is of another type.
    """
    request = cpb.SubmitModelRequest(name=name)
    if options is not None:
        request.options.CopyFrom(options)
    if isinstance(model, pathlib.Path):
        path = model
        try:
            model = json.loads(_read_file(path, "model"))
        except ValueError as error:
            raise _invalid(f"model: {path} is not JSON: {error}") from None
        if not isinstance(model, Mapping):
            raise _invalid(f"model: {path} does not hold a JSON object")
        if not request.name:
            request.name = path.name
    if isinstance(model, mpb.ModelSpec):
        request.spec.CopyFrom(model)
    elif isinstance(model, Mapping):
        text = json.dumps(model)
        if "root" in model:
            request.native_spec_json = text
        else:
            request.hf_config_json = text
    else:
        raise _invalid(
            "model: expected a config.json or native spec dict, a ModelSpec "
            f"or a pathlib.Path, got {type(model).__name__}")
    return request


@dataclass
class SubmittedModel:
    """What SubmitModel returned: the model's id, totals and plan."""

    model_id: str
    summary: mpb.ModelSummary
    plan: ppb.ShardingPlan


@dataclass
class Job:
    """A queued training job. Iterate over :meth:`events` to follow it.

    Attributes:
        job_id: the coordinator's id ("j-1").
        model_id: the model it trains.
        world_size: ranks it runs on.
        plan: the model's plan when this client submitted it, else None.
    """

    job_id: str
    model_id: str
    world_size: int
    plan: Optional[ppb.ShardingPlan]
    coordinator: "Coordinator" = field(repr=False)

    def events(self, *, from_step: int = 0,
               idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S) -> Iterator[cpb.StepEvent]:
        """Step events until the job ends; see :meth:`Coordinator.watch`."""
        return self.coordinator.watch(self.job_id, from_step=from_step,
                                      idle_timeout=idle_timeout)

    def wait(self, *, idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
             on_event: Optional[Callable[[cpb.StepEvent], None]] = None
             ) -> List[cpb.StepEvent]:
        """Follows the job to its end and returns every step event.

        Raises:
            JobFailedError: the job failed (message: step, rank, cause).
            ShardError: the stream failed (see :meth:`Coordinator.watch`).
        """
        events = []
        for event in self.events(idle_timeout=idle_timeout):
            events.append(event)
            if on_event is not None:
                on_event(event)
        return events

    def info(self) -> cpb.JobInfo:
        """The job as GetStatus lists it (state, steps done, last loss).

        Raises:
            ShardError: NOT_FOUND when the coordinator no longer lists it,
                or the errors of :meth:`Coordinator.status`.
        """
        for job in self.coordinator.status().jobs:
            if job.job_id == self.job_id:
                return job
        raise ShardError(grpc.StatusCode.NOT_FOUND,
                         f"job {self.job_id} is not listed by the coordinator")


class Coordinator:
    """A connection to a shardd-coordinator.

    Example::

        with Coordinator("127.0.0.1:7070") as coordinator:
            job = coordinator.train(pathlib.Path("tests/data/small_moe.json"),
                                    steps=20, global_batch=16, seq_len=32)
            for event in job.events():
                print(event.step, event.loss)

    The security options are shardctl's: ``tls_ca`` (--tls-ca) turns TLS on
    and verifies the coordinator; ``tls_cert``/``tls_key`` (--tls-cert,
    --tls-key) present a client certificate for mutual TLS; ``token`` or
    ``token_file`` (--token-file, default ``$SHARDD_TOKEN_FILE``) is sent as
    ``authorization: Bearer <token>`` with every call, on TLS and plaintext
    channels alike.
    """

    def __init__(
        self,
        address: str,
        *,
        tls_ca: Optional[Union[str, os.PathLike]] = None,
        tls_cert: Optional[Union[str, os.PathLike]] = None,
        tls_key: Optional[Union[str, os.PathLike]] = None,
        tls_server_name: Optional[str] = None,
        token: Optional[str] = None,
        token_file: Optional[Union[str, os.PathLike]] = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        connect_timeout: Optional[float] = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        """Opens a channel to `address` ("host:port").

        Args:
            address: the coordinator's host:port.
            tls_ca: PEM CA bundle that verifies the coordinator; set: TLS.
            tls_cert, tls_key: client certificate and key (both or neither;
                they need tls_ca).
            tls_server_name: expected name in the server certificate instead
                of the address's host.
            token: client bearer token.
            token_file: file whose first line is the token (when no token is
                given; default ``$SHARDD_TOKEN_FILE``).
            timeout: deadline of each call in seconds (> 0).
            connect_timeout: wait this long for the connection (None: do not
                wait; the first call connects).

        Raises:
            ShardError: INVALID_ARGUMENT naming the option (empty address,
                timeout <= 0, unreadable files, a certificate without its key
                or without tls_ca); UNAVAILABLE when not connected within
                connect_timeout (the message names the address).
        """
        if not address:
            raise _invalid("address: required (host:port)")
        if timeout <= 0:
            raise _invalid(f"timeout: must be > 0, got {timeout}")
        if (tls_cert is None) != (tls_key is None):
            raise _invalid("tls_cert and tls_key: give both or neither")
        if tls_cert is not None and tls_ca is None:
            raise _invalid("tls_cert: a client certificate needs tls_ca")
        if token is None:
            if token_file is None:
                token_file = os.environ.get("SHARDD_TOKEN_FILE") or None
            if token_file is not None:
                token = read_token_file(token_file, "token_file")
        self._address = address
        self.timeout = timeout
        self._metadata: Tuple[Tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ())
        # Jobs stream one event per step; plans of large models are big.
        channel_options: List[Tuple[str, Any]] = [
            ("grpc.max_receive_message_length", 256 << 20),
        ]
        if tls_ca is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_file(tls_ca, "tls_ca"),
                private_key=(_read_file(tls_key, "tls_key")
                             if tls_key is not None else None),
                certificate_chain=(_read_file(tls_cert, "tls_cert")
                                   if tls_cert is not None else None))
            if tls_server_name:
                channel_options.append(
                    ("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(address, credentials,
                                                options=channel_options)
        else:
            self._channel = grpc.insecure_channel(address, options=channel_options)
        self._stub = cpb_grpc.CoordinatorStub(self._channel)
        if connect_timeout is not None:
            try:
                grpc.channel_ready_future(self._channel).result(
                    timeout=connect_timeout)
            except grpc.FutureTimeoutError:
                self._channel.close()
                raise ShardError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"cannot connect to the coordinator at {address} within "
                    f"{connect_timeout:g} s") from None

    @property
    def address(self) -> str:
        """The coordinator's host:port."""
        return self._address

    def close(self) -> None:
        """Closes the channel; streams in progress are cancelled."""
        self._channel.close()

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, rpc: str, method: Callable[..., _Response], request: Any,
              timeout: Optional[float]) -> _Response:
        try:
            return method(request, timeout=timeout or self.timeout,
                          metadata=self._metadata)
        except grpc.RpcError as error:
            raise ShardError.from_rpc_error(error, rpc) from None

    # --- Strategies, models and plans ---------------------------------------

    def list_strategies(self, *, timeout: Optional[float] = None
                        ) -> cpb.ListStrategiesResponse:
        """The registered strategies and the HF architectures shardd parses."""
        return self._call("ListStrategies", self._stub.ListStrategies,
                          cpb.ListStrategiesRequest(), timeout)

    def submit_model(self, model: ModelSource, *, name: str = "",
                     options: Optional[ppb.PlanOptions] = None,
                     timeout: Optional[float] = None,
                     **plan_kwargs: Any) -> SubmittedModel:
        """Parses, plans and stores a model on the coordinator.

        Args:
            model: a config.json or native spec dict, a ModelSpec, or a path.
            name: display name (default: the file name for a path).
            options: PlanOptions; keyword arguments of :func:`plan_options`
                (dp=, replicate=, strategy=, ...) override its fields.

        Returns:
            The model id (the same for the same model and options), its
            summary and its plan.

        Raises:
            ShardError: INVALID_ARGUMENT (malformed spec, the message names
                the field; unknown architecture or strategy; bad mesh),
                RESOURCE_EXHAUSTED (model too large), transport errors.
        """
        if not name and isinstance(model, pathlib.Path):
            name = model.name
        request = model_request(model, name=name,
                                options=_merge_options(options, plan_kwargs))
        response = self._call("SubmitModel", self._stub.SubmitModel, request,
                              timeout)
        return SubmittedModel(model_id=response.model_id,
                              summary=response.summary, plan=response.plan)

    def plan(self, model: ModelRef, *, options: Optional[ppb.PlanOptions] = None,
             timeout: Optional[float] = None, **plan_kwargs: Any) -> ppb.ShardingPlan:
        """The sharding plan of a model.

        A model id returns its stored plan, or with options a new plan for
        them (the stored one is unchanged). Anything else is submitted
        (:meth:`submit_model`) and its plan returned.

        Raises:
            ShardError: NOT_FOUND (unknown model id), INVALID_ARGUMENT (bad
                options or model), transport errors.
        """
        if isinstance(model, str):
            request = cpb.GetPlanRequest(model_id=model)
            if options is not None or plan_kwargs:
                request.options.CopyFrom(_merge_options(options, plan_kwargs))
                request.replan = True
            return self._call("GetPlan", self._stub.GetPlan, request,
                              timeout).plan
        return self.submit_model(model, options=options, timeout=timeout,
                                 **plan_kwargs).plan

    # --- Status -------------------------------------------------------------

    def status(self, *, timeout: Optional[float] = None) -> cpb.GetStatusResponse:
        """Models, workers and jobs of the coordinator."""
        return self._call("GetStatus", self._stub.GetStatus,
                          cpb.GetStatusRequest(), timeout)

    def live_workers(self, *, timeout: Optional[float] = None) -> int:
        """How many registered workers are alive."""
        return sum(1 for worker in self.status(timeout=timeout).workers
                   if worker.alive)

    def list_checkpoints(self, job_id: str = "", *,
                         timeout: Optional[float] = None
                         ) -> Sequence[cpb.CheckpointInfo]:
        """Committed checkpoints (of one job, or all).

        Raises:
            ShardError: FAILED_PRECONDITION (the coordinator has no
                --checkpoint-dir), INVALID_ARGUMENT (job_id not a plain name).
        """
        return self._call("ListCheckpoints", self._stub.ListCheckpoints,
                          cpb.ListCheckpointsRequest(job_id=job_id),
                          timeout).checkpoints

    # --- Training -----------------------------------------------------------

    def train(
        self,
        model: ModelRef,
        *,
        steps: int = 100,
        global_batch: int = 32,
        seq_len: int = 64,
        microbatches: Optional[int] = None,
        data_path: Optional[str] = None,
        lr: Optional[float] = None,
        beta1: Optional[float] = None,
        beta2: Optional[float] = None,
        eps: Optional[float] = None,
        weight_decay: Optional[float] = None,
        grad_clip: Optional[float] = None,
        seed: Optional[int] = None,
        defer_grad_sync: bool = False,
        fine_grained: bool = False,
        packing: bool = True,
        checkpoint_every: Optional[int] = None,
        keep_checkpoints: Optional[int] = None,
        keep_every: Optional[int] = None,
        on_checkpoint_failure: Optional[str] = None,
        resume_from: Optional[str] = None,
        lora_from: Optional[str] = None,
        config: Optional[cpb.TrainConfig] = None,
        options: Optional[ppb.PlanOptions] = None,
        name: str = "",
        timeout: Optional[float] = None,
        **plan_kwargs: Any,
    ) -> Job:
        """Queues a training job and returns its handle.

        A model that is not an id is submitted first. Without ``dp`` it is
        sharded over every live worker (divided by ``replicate``), as
        ``shardctl train`` does. The TrainConfig fields left None keep the
        workers' defaults (proto/coordinator.proto, TrainConfig); ``config``
        gives them all at once (the keyword arguments override it).
        ``microbatches`` and ``defer_grad_sync`` also go into the plan.
        ``packing=False`` trains an SFT dataset (``data_path`` a directory
        from tools/prepare_sft.py) one example per row, padded.
        ``lora_from`` starts a LoRA job's adapters from PEFT's files in that
        directory (an absolute path the workers read).

        Raises:
            ShardError: those of :meth:`submit_model`; FAILED_PRECONDITION
                (no live workers, or workers of the plan missing or dead);
                NOT_FOUND (unknown model id); RESOURCE_EXHAUSTED (too many
                jobs pending); INVALID_ARGUMENT (replicate does not divide
                the live workers).
        """
        train_config = cpb.TrainConfig()
        if config is not None:
            train_config.CopyFrom(config)
        train_config.steps = steps
        train_config.global_batch = global_batch
        train_config.seq_len = seq_len
        fields = dict(microbatches=microbatches, data_path=data_path, lr=lr,
                      beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay, grad_clip=grad_clip,
                      seed=seed, checkpoint_every=checkpoint_every,
                      keep_checkpoints=keep_checkpoints,
                      keep_every=keep_every,
                      on_checkpoint_failure=on_checkpoint_failure,
                      resume_from=resume_from, lora_from=lora_from)
        for key, value in fields.items():
            if value is not None:
                setattr(train_config, key, value)
        if defer_grad_sync:
            train_config.defer_grad_sync = True
        if fine_grained:
            train_config.fine_grained = True
        if not packing:
            train_config.no_packing = True

        plan: Optional[ppb.ShardingPlan] = None
        if isinstance(model, str):
            model_id = model
        else:
            merged = _merge_options(options, plan_kwargs)
            if train_config.microbatches:
                merged.microbatches = train_config.microbatches
            if train_config.defer_grad_sync:
                merged.defer_grad_sync = True
            if merged.mesh.dp_shard == 0:
                live = self.live_workers(timeout=timeout)
                if live == 0:
                    raise ShardError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"dp: no live workers on the coordinator at "
                        f"{self._address}; start shardd-worker processes "
                        f"with --coordinator {self._address}")
                replicate = max(1, merged.mesh.dp_replicate)
                if live % replicate:
                    raise _invalid(f"replicate: {replicate} does not divide "
                                   f"the {live} live workers; pass dp=")
                merged.mesh.dp_shard = live // replicate
            submitted = self.submit_model(model, name=name, options=merged,
                                          timeout=timeout)
            model_id = submitted.model_id
            plan = submitted.plan
        response = self._call(
            "SubmitStep", self._stub.SubmitStep,
            cpb.SubmitStepRequest(model_id=model_id, config=train_config),
            timeout)
        return Job(job_id=response.job_id, model_id=model_id,
                   world_size=response.world_size, plan=plan, coordinator=self)

    def watch(self, job_id: str, *, from_step: int = 0,
              idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
              raise_on_failure: bool = True) -> Iterator[cpb.StepEvent]:
        """Yields a job's step events until its last one (``done`` set).

        The stream has no deadline (jobs run for hours); it is cancelled
        when no event arrives for `idle_timeout` seconds while the caller
        waits for one.

        Args:
            job_id: the job (Job.job_id).
            from_step: skip the events before this step.
            idle_timeout: seconds without an event before giving up.
            raise_on_failure: raise JobFailedError for the failure event;
                False yields it (its ``error`` set) and ends.

        Raises:
            JobFailedError: the job failed.
            ShardError: NOT_FOUND (unknown job), UNAVAILABLE (coordinator
                gone), DEADLINE_EXCEEDED (no event for idle_timeout),
                INTERNAL (the stream ended before the job's last event).
        """
        if idle_timeout <= 0:
            raise _invalid(f"idle_timeout: must be > 0, got {idle_timeout}")
        call = self._stub.WatchStep(
            cpb.WatchStepRequest(job_id=job_id, from_step=from_step),
            metadata=self._metadata)
        idle = threading.Event()

        def give_up() -> None:
            idle.set()
            call.cancel()

        try:
            while True:
                # The timer runs only while we wait, not while the caller
                # handles an event.
                timer = threading.Timer(idle_timeout, give_up)
                timer.daemon = True
                timer.start()
                try:
                    event = next(call)
                except StopIteration:
                    raise ShardError(
                        grpc.StatusCode.INTERNAL,
                        f"job {job_id}: the stream ended before the job's "
                        "last event", "WatchStep") from None
                finally:
                    timer.cancel()
                if event.error:
                    if raise_on_failure:
                        raise JobFailedError(job_id, event.error)
                    yield event
                    return
                yield event
                if event.done:
                    return
        except grpc.RpcError as error:
            if idle.is_set():
                raise ShardError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"job {job_id}: no event for {idle_timeout:g} s",
                    "WatchStep") from None
            raise ShardError.from_rpc_error(error, "WatchStep") from None
        finally:
            call.cancel()
