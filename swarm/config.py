"""Typed run config: one YAML file describes a whole training run.

A run config is nested dataclasses, one per component (model, stages, optimizer, averaging,
data, network). It loads from and saves to YAML without loss, and every problem is reported as a
:class:`ConfigError` naming the offending field (``optimizer.lr``, ``stages.num_stages``, ...).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

WIRE_DTYPES = ("float32", "float16", "bfloat16")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
OPTIMIZERS = ("adamw", "nadamw")
COMPRESSIONS = ("none", "float16", "bfloat16", "blockwise8bit", "float8")
AGGREGATIONS = ("centered_clip", "mean")  # how a stage's reducers combine its members' gradients
AVERAGING_MODES = ("every_step", "local")  # what a stage's servers average: gradients every step, or (local)
# pseudo-gradients every averaging.local_steps steps of their own (swarm.averaging.local)


class ConfigError(ValueError):
    """A run config is malformed; the message names the field."""


MAX_EXPERTS = 64  # experts per block a run with expert servers may have (swarm.dht enumerates a key for each)


@dataclass
class MoEConfig:
    """Mixture-of-experts: the MLP of every `every`-th block (blocks i with (i + 1) % every == 0) becomes
    `num_experts` expert MLPs, `top_k` of them chosen per token by a router (swarm.model.moe)."""

    every: int = 2
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25  # an expert takes at most ceil(factor * tokens * top_k / num_experts); 0: no limit
    aux_loss_weight: float = 0.01  # weight of the load-balancing loss (summed over the MoE blocks) in the objective
    expert_hidden: int = 0  # an expert's hidden size; 0: the dense MLP's, model.mlp_ratio * model.d_model
    # Where the experts live: False, inside the servers of their block's stage; True, on expert servers
    # (swarm-peer --role expert) that the stage server calls, routing around the dead and slow ones.
    expert_servers: bool = False
    # With expert servers: a token goes on with the experts that answered (gates renormalized over them)
    # as long as at least k_min of its top-k were not lost to failures (slots dropped for capacity do not
    # count as lost); otherwise the micro-batch is refused as not ready (the trainer retries later).
    # 0: a token may lose all its experts (its residual carries it).
    k_min: int = 1

    def validate(self) -> None:
        _positive(self, "every", "model.moe")

        if self.num_experts < 2:
            raise ConfigError(f"model.moe.num_experts must be at least 2, got {self.num_experts}")
        if self.expert_servers is True and self.num_experts > MAX_EXPERTS:
            raise ConfigError(f"model.moe.num_experts is at most {MAX_EXPERTS} with expert servers (the DHT has a "
                              f"checkpoint key per expert), got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"model.moe.top_k must be in 1..model.moe.num_experts ({self.num_experts}), "
                              f"got {self.top_k}")
        for name in ("capacity_factor", "aux_loss_weight"):
            value = getattr(self, name)
            if not 0.0 <= value < float("inf"):
                raise ConfigError(f"model.moe.{name} must be a finite number, not negative, got {value}")
        _non_negative(self, "expert_hidden", "model.moe")
        if not isinstance(self.expert_servers, bool):
            raise ConfigError(f"model.moe.expert_servers must be true or false, got {self.expert_servers!r}")
        if not 0 <= self.k_min <= self.top_k:
            raise ConfigError(f"model.moe.k_min must be in 0..model.moe.top_k ({self.top_k}), got {self.k_min}")


@dataclass
class ModelConfig:
    """A GPT-style decoder."""

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    seed: int = 0  # parameter initialization seed, so every replica of a stage starts equal
    # None: every block is dense. Left out of the YAML and of the state hash when None, so dense runs
    # are described exactly as before MoE existed.
    moe: MoEConfig | None = field(default=None, metadata={"omit_if_none": True})

    def validate(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            _positive(self, name, "model")
        if self.d_model % self.n_head:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.moe is not None:
            self.moe.validate()
            if not self.moe_layers():
                raise ConfigError(f"model.moe.every ({self.moe.every}) exceeds model.n_layer ({self.n_layer}): "
                                  "no block would be a mixture of experts")

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` (global) is a mixture of experts: (index + 1) % moe.every == 0."""
        return self.moe is not None and (index + 1) % self.moe.every == 0

    def moe_layers(self) -> list[int]:
        """Global indices of the MoE blocks (e.g. [1, 3] for 4 blocks and every 2); [] without moe."""
        return [i for i in range(self.n_layer) if self.is_moe_layer(i)]

    @property
    def expert_hidden(self) -> int:
        """An expert's hidden size (moe.expert_hidden, or the dense MLP's when that is 0)."""
        if self.moe is None or self.moe.expert_hidden == 0:
            return self.mlp_ratio * self.d_model
        return self.moe.expert_hidden


def check_moe_placement(model: ModelConfig, num_stages: int) -> None:
    """ConfigError naming model.moe.every unless every MoE block is the last block of a non-last stage,
    or lies in the last stage: a non-last stage's output is then the MoE output itself, so its
    backward needs no expert output kept or recomputed (design note on MoE, section 3.1)."""
    if num_stages < 1 or model.n_layer % num_stages:
        return  # the split itself is reported elsewhere
    per_stage = model.n_layer // num_stages
    for index in model.moe_layers():
        stage, position = divmod(index, per_stage)
        if stage < num_stages - 1 and position != per_stage - 1:
            raise ConfigError(
                f"model.moe.every ({model.moe.every}) makes block {index} a mixture of experts, but it is "
                f"block {position} of {per_stage} in stage {stage} of {num_stages}: an MoE block must be the last "
                "block of a non-last stage, or in the last stage (stages.num_stages sets the split)"
            )


@dataclass
class StagesConfig:
    """How the model is split into pipeline stages, and how activations cross the wire."""

    num_stages: int = 2
    # What a stage computes in: "auto" is bfloat16 on a CUDA device and float32 on a CPU. Under
    # bfloat16 the weights, their gradients and the optimizer state stay float32 (autocast).
    compute_dtype: str = "auto"
    # Activations and their gradients between stages: "auto" is bfloat16 when compute_dtype is
    # bfloat16 and float32 otherwise (a trainer cannot know which servers of "auto" have a GPU).
    wire_dtype: str = "auto"
    # A backward whose stage stepped once since its forward: true, on the parameters its forward used (weight
    # stashing: consistent, a step old); false, on the parameters of now (the gradient from the next stage is
    # of the old activations). bench/convergence.py compares them.
    stash_weights: bool = True

    def validate(self) -> None:
        _positive(self, "num_stages", "stages")
        if self.compute_dtype == "float16":
            raise ConfigError("stages.compute_dtype float16 would need loss scaling, which swarm does not do; "
                              "use bfloat16 (same speed on GPUs that have it, no scaling needed) or float32")
        _choice(self, "compute_dtype", COMPUTE_DTYPES, "stages")
        _choice(self, "wire_dtype", ("auto", *WIRE_DTYPES), "stages")

    @property
    def wire(self) -> str:
        """The wire dtype requests are sent in, "auto" resolved."""
        if self.wire_dtype != "auto":
            return self.wire_dtype
        return "bfloat16" if self.compute_dtype == "bfloat16" else "float32"


MAX_STEP_WAIT = 10.0  # optimizer.drain_seconds, step_wait_seconds, round_wait_seconds,
# ahead_wait_seconds: longer, a request timed out


@dataclass
class OptimizerConfig:
    """AdamW (or NAdamW) with linear warmup then cosine decay; one step per `batch_size` samples per stage."""

    # adamw: torch's AdamW; nadamw: torch's NAdam with decoupled weight decay (Nesterov momentum, beta1 0.99).
    # With look-ahead, AdamW ends lower over seeds at the swarm's late shares and step sizes, and exact NAdamW
    # itself is ~4% behind exact AdamW on tiny.yaml (bench/staleness.py --seeds 5; README, Learning)
    name: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    total_steps: int = 1000
    weight_decay: float = 0.1
    # None: the optimizer's own, 0.9 for adamw, 0.99 for nadamw
    beta1: float | None = None
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max gradient norm of each stage's own parameters; 0 disables
    batch_size: int = 32  # samples per optimizer step (the stage's target batch size)
    micro_batch_size: int = 8  # samples per forward/backward request
    # Samples a server computes while its stage's round runs are applied one step late. With lookahead, they
    # run on the parameters the step would make from this server's own share of the batch (StageOptimizer.
    # preview), which the round's step then nearly equals: their gradients are nearly fresh.
    lookahead: bool = True
    # A stage's batch that fills while backwards of forwards run on its parameters are still on their way waits for
    # them, at most 1.5 x its measured forward-to-backward trips and at most this long, and counts them in: fresh,
    # where they would be a step stale in the next batch (swarm/drain.py). 0: a batch closes when it fills.
    drain_seconds: float = 0.5
    # A forward (or the last stage's call) that comes while its stage's batch is closing (due, or its round under
    # way) waits for the step, at most this long, then runs on the look-ahead. 0: never waits.
    step_wait_seconds: float = 0.25
    # ...or, while its stage's round runs, until the round has taken what this server's rounds usually take (their
    # median, a quarter more), at most this long: on thin links a round takes seconds, and the forwards' bytes would
    # slow it down (swarm/drain.py). 0: step_wait_seconds alone.
    round_wait_seconds: float = 2.0
    # A forward that comes, in a stage with other servers, while this server's forwards in flight fill what the
    # batch still needs (its backward would come after the step) waits for the step, at most this long, then runs
    # ahead on the parameters the step is predicted to make from this server's share of the batch: often a small
    # share, and then a poor prediction (swarm/drain.py). 0: never waits.
    ahead_wait_seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.beta1 is None:
            self.beta1 = 0.99 if self.name == "nadamw" else 0.9

    def validate(self) -> None:
        _choice(self, "name", OPTIMIZERS, "optimizer")
        for name in ("lr", "total_steps", "batch_size", "micro_batch_size", "eps"):
            _positive(self, name, "optimizer")
        for name in ("min_lr", "warmup_steps", "weight_decay", "grad_clip"):
            _non_negative(self, name, "optimizer")
        for name in ("drain_seconds", "step_wait_seconds", "round_wait_seconds", "ahead_wait_seconds"):  # (finite)
            value = getattr(self, name)
            if not 0.0 <= value <= MAX_STEP_WAIT:
                raise ConfigError(f"optimizer.{name} must be between 0 and {MAX_STEP_WAIT:g} seconds, got {value}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.min_lr > self.lr:
            raise ConfigError(f"optimizer.min_lr ({self.min_lr}) must not exceed optimizer.lr ({self.lr})")
        if self.micro_batch_size > self.batch_size:
            raise ConfigError(
                f"optimizer.micro_batch_size ({self.micro_batch_size}) must not exceed "
                f"optimizer.batch_size ({self.batch_size})"
            )


@dataclass
class ZeroConfig:
    """ZeRO-style sharding of a stage's optimizer state among its servers (swarm.zero)."""

    enabled: bool = False
    replicas: int = 2  # servers that hold each chunk's moments: 2 survives any one leaving; 1 halves memory
    chunk_elements: int = 2**11  # parameters per chunk: the unit of ownership (smaller: better balanced owners)

    def validate(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"averaging.zero.replicas must be at least 1, got {self.replicas}")
        if not 0 < self.chunk_elements <= 2**17:
            raise ConfigError(f"averaging.zero.chunk_elements must be in 1..{2**17}, got {self.chunk_elements}")


@dataclass
class AveragingConfig:
    """Averaging of gradients among the servers of one stage (times in seconds)."""

    compression: str = "none"
    target_group_size: int = 8  # the most servers one round averages; keep it >= the servers of a stage
    matchmaking_timeout: float = 10.0  # a round that has not formed its group by then steps locally
    allreduce_timeout: float = 30.0  # exchanging the gradients once the group is formed
    state_download_timeout: float = 60.0  # a joining or lagging server downloading its stage's state
    min_matchmaking_time: float = 5.0  # a round's leader waits this long for servers still missing
    request_timeout: float = 3.0  # one matchmaking request, and one progress read or write in the DHT
    direct_matchmaking: bool = True  # also send matchmaking declarations straight to the stage's servers
    next_chunk_timeout: float = 10.0  # a peer silent this long in an all-reduce or download is dropped
    shutdown_timeout: float = 5.0  # the averaging process gets this long to leave cleanly
    progress_period: float = 1.0  # how often a server publishes its samples and reads its stage's
    aggregation: str = "centered_clip"  # how a reducer combines members' gradients (or "mean"; see README)
    clip_factor: float = 4.0  # CenteredClip's radius: this many times the members' median distance from the median
    # Seconds a peer must have watched another server of the stage (or the coordinator, a stage's servers)
    # before that server's word on a step, a state or a checkpoint counts (swarm.tenure; README, Trust)
    min_tenure: float = 10.0
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    # Low-communication mode (README, Averaging over home uplinks): with mode "local" each server of a stage takes
    # local_steps optimizer steps of its own, then the stage's servers average their pseudo-gradients (slow weights
    # minus their own) and all take the same outer step: Nesterov momentum with DiLoCo's constants by default
    mode: str = "every_step"
    local_steps: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    pseudo_gradient_compression: str = "float16"  # how pseudo-gradients travel ("compression" is for gradients)
    # Error feedback: what the codec rounds off a server's pseudo-gradient stays with the server and goes into its
    # next one, so nothing is lost on the way, only late (swarm.averaging.feedback); needs a codec with a fixed grid
    # (float8, float16, bfloat16; blockwise8bit's blocks start wherever the all-reduce cuts a part)
    pseudo_gradient_error_feedback: bool = True
    # What the gradient of a backward counts for on a server that did not run its forward (the server that did
    # was gone): replicas differ by up to local_steps steps, so it is inconsistent; 0 drops it (the input's
    # gradient still goes back to the stages before), 1 counts it in full. bench/recompute.py measured the best
    # weight at 0.44-0.98 over a run (README, Low-communication mode): 0.5 is the least far from it at worst
    recomputed_weight: float = 0.5
    # Expert servers: every this many seconds the hosts of an expert average its parameters, so replicas that took
    # different backwards end equal (swarm.serving.replicas); 0: never
    expert_replica_period: float = 30.0

    def validate(self) -> None:
        _choice(self, "compression", COMPRESSIONS, "averaging")
        period = self.expert_replica_period
        if isinstance(period, bool) or not isinstance(period, (int, float)) or not 0.0 <= period < float("inf"):
            raise ConfigError(f"averaging.expert_replica_period must be a finite number of seconds, not negative "
                              f"(0: never), got {period!r}")
        _choice(self, "mode", AVERAGING_MODES, "averaging")
        _choice(self, "pseudo_gradient_compression", COMPRESSIONS, "averaging")
        if not (isinstance(self.local_steps, int) and not isinstance(self.local_steps, bool) and self.local_steps >= 1):
            raise ConfigError(f"averaging.local_steps must be a whole number of at least 1, got {self.local_steps!r}")
        if not 0.0 < self.outer_lr <= 10.0:
            raise ConfigError(f"averaging.outer_lr must be in (0, 10], got {self.outer_lr}")
        if not 0.0 <= self.recomputed_weight <= 1.0:
            raise ConfigError(f"averaging.recomputed_weight must be in [0, 1], got {self.recomputed_weight}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(f"averaging.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not isinstance(self.pseudo_gradient_error_feedback, bool):
            raise ConfigError("averaging.pseudo_gradient_error_feedback must be true or false, got "
                              f"{self.pseudo_gradient_error_feedback!r}")
        if self.mode == "local" and self.pseudo_gradient_error_feedback \
                and self.pseudo_gradient_compression == "blockwise8bit":
            raise ConfigError("averaging.pseudo_gradient_error_feedback needs a codec with a fixed grid, and "
                              "blockwise8bit's blocks start wherever the all-reduce cuts a part: use float8 for 8 bits "
                              "a value with error feedback, or set pseudo_gradient_error_feedback to false")
        if self.mode == "local" and self.zero.enabled:
            raise ConfigError("averaging.mode local does not shard its state yet (averaging.zero): turn zero off, "
                              "or average every step")
        _choice(self, "aggregation", AGGREGATIONS, "averaging")
        if not self.clip_factor >= 1.0 or self.clip_factor == float("inf"):
            raise ConfigError(f"averaging.clip_factor must be a finite number of at least 1, got {self.clip_factor}")
        self.zero.validate()
        if self.zero.enabled and self.compression != "none":
            raise ConfigError("averaging.zero sends gradients and updates as float32: set averaging.compression "
                              f"to none (got {self.compression!r}), or turn zero off")
        for name in ("target_group_size", "matchmaking_timeout", "allreduce_timeout", "state_download_timeout",
                     "min_matchmaking_time", "request_timeout", "next_chunk_timeout", "shutdown_timeout",
                     "progress_period", "min_tenure"):
            _positive(self, name, "averaging")
        if self.target_group_size < 2:
            raise ConfigError(f"averaging.target_group_size must be at least 2, got {self.target_group_size}")
        # Matchmaking can deadlock for a request_timeout when two peers ask each other to lead (hivemind's
        # note); a shorter request_timeout breaks that before the round's window closes.
        _ordered(self, ("request_timeout", "min_matchmaking_time", "matchmaking_timeout"), "averaging")
        _ordered(self, ("next_chunk_timeout", "allreduce_timeout"), "averaging")
        # a joiner watches its stage's servers for min_tenure before it may take a state from one of them
        _ordered(self, ("min_tenure", "state_download_timeout"), "averaging")


@dataclass
class DataConfig:
    """Where training text comes from and how it becomes tokens."""

    corpus: str = "stdlib"  # "stdlib" (this Python's own sources) or a file path or glob
    tokenizer: str | None = None  # a `tokenizers` JSON file; None means bytes (vocabulary 256)
    val_percent: float = 5.0  # share of files held out for validation, chosen by path hash
    seed: int = 0
    max_bytes: int = 0  # cap on corpus bytes read (0 = no cap); keeps tiny runs fast

    def validate(self) -> None:
        if not self.corpus:
            raise ConfigError("data.corpus must not be empty")
        if not 0.0 < self.val_percent < 100.0:
            raise ConfigError(f"data.val_percent must be in (0, 100), got {self.val_percent}")
        _non_negative(self, "max_bytes", "data")


# DHT nodes refuse a record of the run that expires further ahead than this (swarm.dht.keys.RunRecordGuard),
# so a stranger's record cannot outlive its author by more than an hour.
MAX_RECORD_TTL = 3600.0


@dataclass
class NetworkConfig:
    """Timeouts and periods of everything that crosses the network (seconds)."""

    announce_period: float = 10.0  # how often a server renews its DHT record
    record_ttl: float = 30.0  # a server record expires this long after its last renewal
    request_timeout: float = 60.0  # the most one forward or backward RPC may take (the ceiling)
    timeout_multiplier: float = 5.0  # an RPC times out after this many times the server's measured time...
    timeout_floor: float = 5.0  # ...but never sooner than this
    ban_seconds: float = 15.0  # a failed server is avoided this long, doubling per repeated failure...
    max_ban_seconds: float = 300.0  # ...up to this; a success resets it
    bootstrap_timeout: float = 30.0  # joining the DHT and finding the run config
    # a stage server refuses a request as busy while the work queued ahead of it would hold it longer than this, unless
    # its caller has no other server to go to (swarm-peer --max-wait overrides it); None: swarm.worker.auto_max_wait,
    # from the stage's median server, in a stage of three servers or more (an expert host: never); .inf: never
    max_wait: float | None = None

    def validate(self) -> None:
        for name in ("announce_period", "record_ttl", "request_timeout", "timeout_multiplier", "timeout_floor",
                     "ban_seconds", "max_ban_seconds", "bootstrap_timeout"):
            _positive(self, name, "network")
        _ordered(self, ("timeout_floor", "request_timeout"), "network")
        if self.max_wait is not None and not 0 < self.max_wait <= math.inf:
            raise ConfigError(f"network.max_wait must be a number of seconds > 0 (.inf: never) or null (auto), got "
                              f"{self.max_wait}")
        if self.max_ban_seconds < self.ban_seconds:
            raise ConfigError(f"network.max_ban_seconds ({self.max_ban_seconds}) must be at least "
                              f"network.ban_seconds ({self.ban_seconds})")
        if self.record_ttl <= self.announce_period:
            raise ConfigError(
                f"network.record_ttl ({self.record_ttl}) must exceed network.announce_period "
                f"({self.announce_period}), or records expire between renewals"
            )
        if self.record_ttl > MAX_RECORD_TTL:
            raise ConfigError(f"network.record_ttl ({self.record_ttl}) must be at most {MAX_RECORD_TTL:g}: "
                              "DHT nodes refuse records that expire further ahead")


@dataclass
class CheckpointConfig:
    """How often a server writes its stage's state to its disk, and how many it keeps.

    A checkpoint is written when `every_steps` optimizer steps or `every_seconds` seconds have
    passed since the last one (whichever comes first; 0 turns that trigger off), and when the stage
    has not stepped for `idle_seconds` with steps no checkpoint holds (its trainers gone; 0: never).
    """

    every_steps: int = 50
    every_seconds: float = 600.0
    keep: int = 3  # checkpoints kept per stage; the newest verified one is never deleted
    idle_seconds: float = 30.0

    def validate(self) -> None:
        _non_negative(self, "every_steps", "checkpoint")
        _non_negative(self, "every_seconds", "checkpoint")
        _non_negative(self, "idle_seconds", "checkpoint")
        _positive(self, "keep", "checkpoint")
        if self.every_steps == 0 and self.every_seconds == 0:
            raise ConfigError("checkpoint.every_steps and checkpoint.every_seconds are both 0: set one of them "
                              "(servers turn checkpoints off with --no-checkpoints)")


@dataclass
class RunConfig:
    """Everything that defines a training run; the coordinator publishes it in the DHT."""

    run_id: str = "swarm"
    model: ModelConfig = field(default_factory=ModelConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> RunConfig:
        if not self.run_id or not all(c.isalnum() or c in "-_" for c in self.run_id):
            raise ConfigError(f"run_id must be non-empty letters, digits, '-' or '_', got {self.run_id!r}")
        for section in (self.model, self.stages, self.optimizer, self.averaging, self.data, self.network,
                        self.checkpoint):
            section.validate()
        if self.model.n_layer % self.stages.num_stages:
            raise ConfigError(
                f"stages.num_stages ({self.stages.num_stages}) must divide model.n_layer "
                f"({self.model.n_layer}) so every stage holds the same number of blocks"
            )
        check_moe_placement(self.model, self.stages.num_stages)
        optimizer = self.optimizer
        wait = max(optimizer.step_wait_seconds, optimizer.round_wait_seconds, optimizer.ahead_wait_seconds)
        if wait >= self.network.timeout_floor / 2:
            raise ConfigError(
                f"a forward may wait {wait:g} s for its stage's step (optimizer.step_wait_seconds, round_wait_seconds, "
                f"ahead_wait_seconds): keep it under half of network.timeout_floor ({self.network.timeout_floor:g} s), "
                "or callers give up on forwards still waiting, their backwards never come, and the forwards after "
                "them wait on those"
            )
        if self.averaging.zero.enabled and self.optimizer.name != "adamw":
            raise ConfigError(f"averaging.zero shards AdamW's moments: set optimizer.name to adamw (got "
                              f"{self.optimizer.name!r}), or turn zero off")
        return self

    @property
    def layers_per_stage(self) -> int:
        return self.model.n_layer // self.stages.num_stages

    def state_hash(self) -> str:
        """sha256 of what shapes a stage's state (the model and its split into stages).

        Checkpoints carry it: a state is usable by a run whose hash matches, whatever its other
        settings (timeouts, averaging, data) are.
        """
        shape = {"model": _as_dict(self.model), "num_stages": self.stages.num_stages}
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return _as_dict(self)

    @classmethod
    def from_dict(cls, data: Any, ignored: list[str] | None = None) -> RunConfig:
        """Build and validate a config; wrong types are errors naming the field.

        Unknown keys are errors too, unless `ignored` is given: then they are left out and their
        names appended to it (a config published by a newer peer, with settings this one lacks).
        """
        return _build(cls, data, "", ignored).validate()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str, ignored: list[str] | None = None) -> RunConfig:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"run config is not valid YAML: {e}") from None
        return cls.from_dict({} if data is None else data, ignored)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read run config {path}: {e.strerror}") from None
        return cls.from_yaml(text)


def _as_dict(obj: Any) -> Any:
    """dataclasses.asdict, leaving out fields marked ``omit_if_none`` whose value is None."""
    if not dataclasses.is_dataclass(obj):
        return obj
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None and f.metadata.get("omit_if_none"):
            continue
        out[f.name] = _as_dict(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    return out


def _build(cls: type, data: Any, prefix: str, ignored: list[str] | None = None) -> Any:
    where = prefix.rstrip(".") or "run config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, data)) - names)
    if unknown and ignored is None:
        raise ConfigError(f"unknown key {prefix}{unknown[0]} (known: {', '.join(sorted(names))})")
    if unknown:
        ignored.extend(prefix + key for key in unknown)
    kwargs = {name: _convert(hints[name], value, f"{prefix}{name}", ignored)
              for name, value in data.items() if name in names}
    return cls(**kwargs)


def _convert(hint: Any, value: Any, name: str, ignored: list[str] | None = None) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, name + ".", ignored)
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return None
    for t in allowed:  # an optional section, such as model.moe
        if dataclasses.is_dataclass(t) and isinstance(value, dict):
            return _build(t, value, name + ".", ignored)
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if any(t is not type(None) and type(value) is t for t in allowed):
        return value
    expected = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"{name} must be {expected}, got {value!r}")


def _positive(section: Any, name: str, where: str) -> None:
    if not getattr(section, name) > 0:
        raise ConfigError(f"{where}.{name} must be positive, got {getattr(section, name)}")


def _non_negative(section: Any, name: str, where: str) -> None:
    if getattr(section, name) < 0:
        raise ConfigError(f"{where}.{name} must not be negative, got {getattr(section, name)}")


def _ordered(section: Any, names: tuple[str, ...], where: str) -> None:
    """Each of `names` must be smaller than the next."""
    for smaller, larger in zip(names, names[1:]):
        if not getattr(section, smaller) < getattr(section, larger):
            raise ConfigError(
                f"{where}.{smaller} ({getattr(section, smaller)}) must be less than {where}.{larger} "
                f"({getattr(section, larger)})"
            )


def _choice(section: Any, name: str, choices: tuple[str, ...], where: str) -> None:
    if getattr(section, name) not in choices:
        raise ConfigError(f"{where}.{name} must be one of {', '.join(choices)}, got {getattr(section, name)!r}")
