"""Typed run configuration: YAML files plus dotted overrides (`train.lr=2e-5`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from harnessrl.adapter import AdvantageLevel, Estimator, LossMode, ZeroVariance


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineSection(_Section):
    """The engine: the builtin one (started by the run) or an external vLLM / SGLang server."""

    model: str = "smollm2"  # a model directory, or "smollm2" for the packaged SmolLM2-135M-Instruct
    port: int = 0  # 0: pick a free port
    max_batch: int = 32
    max_model_len: int = 2048
    threads: int | None = None
    device: str = "cpu"  # builtin engine: "cpu" or "cuda[:N]"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # builtin engine's weights and KV cache
    # builtin engine on CPU: oneDNN-packed linear weights, F.linear, or auto (see modeling/packed.py)
    matmul: Literal["auto", "onednn", "aten"] = "auto"
    # "vllm" / "sglang": a server already running at `url`, serving `model` (the trainer loads the same
    # directory); it must be able to read the run directory, where new weights are written
    kind: Literal["builtin", "vllm", "sglang"] = "builtin"
    url: str | None = None

    @model_validator(mode="after")
    def _external_needs_url(self) -> EngineSection:
        if self.kind != "builtin" and not self.url:
            raise ValueError(f"engine.kind {self.kind!r} needs engine.url (the running server)")
        _check_device(self.device, "engine.device")
        return self


def _check_device(device: str, name: str) -> None:
    if device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:N', not {device!r}")


class GatewaySection(_Section):
    """The gateway process."""

    port: int = 0
    default_max_tokens: int = 256
    mode: Literal["passthrough", "tito"] = "passthrough"  # tito: the gateway builds prompts from token IDs


class ControllerSection(_Section):
    """Running harnesses."""

    concurrency: int = 16
    harness_timeout_s: float = 300.0
    max_attempts: int = 2
    grader_timeout_s: float = 60.0
    grader_retries: int = 0  # a crashed grader runs again this many times before the rollout fails
    # Each attempt in a bubblewrap sandbox: no network but the gateway, a private filesystem view,
    # resource limits (docs/sandbox.md). None: not limited.
    sandbox: bool = False
    # Local runs: Python harnesses forked from a process that has already imported `preload`
    # (docs/operations.md), saving each attempt's interpreter start and imports. With `sandbox` or
    # `ray_address` it does not apply (those runners start every attempt themselves).
    fork_server: bool = False
    preload: list[str] = Field(default_factory=list)
    sandbox_cpu_seconds: int | None = None
    sandbox_memory_mb: int | None = 4096  # per process (RLIMIT_AS)
    sandbox_max_processes: int | None = 256
    sandbox_max_file_mb: int | None = 1024
    sandbox_cgroup: Literal["auto", "required", "never"] = "auto"  # one cgroup bounds the whole attempt
    sandbox_cgroup_memory_mb: int | None = 8192  # all of an attempt's processes together
    sandbox_cgroup_max_pids: int | None = 1024
    sandbox_ro_paths: list[str] = Field(default_factory=list)  # more host paths the harness may read
    sandbox_hide_git: bool = False
    sandbox_disable_git: bool = False
    # Attempts as Ray tasks on a cluster (docs/ray.md): "auto", "host:port" or "ray://…"; None: local.
    # With `sandbox: true` each attempt is sandboxed on its node.
    ray_address: str | None = None
    ray_num_cpus: float = 1.0
    ray_memory_mb: int | None = None
    ray_resources: dict[str, float] = Field(default_factory=dict)

    def runner(self) -> Any:
        """The runner these settings describe: local, sandboxed, on Ray (sandboxed or not)."""
        from harnessrl.controller import LocalRunner, RayRunner, RaySpec, SandboxRunner

        sandbox = self.sandbox_spec() if self.sandbox else None
        if self.fork_server and sandbox is None and self.ray_address is None:
            from harnessrl.controller import ForkServerRunner

            return ForkServerRunner(self.preload)
        if self.ray_address is not None:
            memory = None if self.ray_memory_mb is None else self.ray_memory_mb << 20
            return RayRunner(RaySpec(address=self.ray_address, num_cpus=self.ray_num_cpus,
                                     memory_bytes=memory, resources=dict(self.ray_resources), sandbox=sandbox))  # fmt: skip
        return SandboxRunner(sandbox) if sandbox is not None else LocalRunner()

    def sandbox_spec(self) -> Any:
        """The `SandboxSpec` these settings describe (for `SandboxRunner`)."""
        from harnessrl.controller.sandbox import SandboxSpec

        mb = lambda v: None if v is None else v << 20  # noqa: E731
        return SandboxSpec(
            cpu_seconds=self.sandbox_cpu_seconds,
            memory_bytes=mb(self.sandbox_memory_mb),
            max_processes=self.sandbox_max_processes,
            max_file_bytes=mb(self.sandbox_max_file_mb),
            cgroup=self.sandbox_cgroup,
            cgroup_memory_bytes=mb(self.sandbox_cgroup_memory_mb),
            cgroup_max_pids=self.sandbox_cgroup_max_pids,
            ro_paths=tuple(self.sandbox_ro_paths),
            hide_git=self.sandbox_hide_git,
            disable_git=self.sandbox_disable_git,
        )


class TrainSection(_Section):
    """The RL schedule (sync or collocated async) and the PPO update."""

    schedule: Literal["sync", "async"] = "sync"
    steps: int = 20
    batch_groups: int = 4  # tasks per step
    group_size: int = 8  # rollouts per task (GRPO siblings)
    lr: float = 1e-5
    weight_decay: float = 0.0
    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 4096
    epochs: int = 1
    estimator: Estimator = Estimator.GRPO
    advantage_level: AdvantageLevel = AdvantageLevel.ROLLOUT
    loss_mode: LossMode = LossMode.ROLLOUT_TOKEN_MEAN
    zero_variance: ZeroVariance = ZeroVariance.KEEP  # groups whose rollouts all got the same reward
    # token-prefix merging of a rollout's calls into rows; False: every call its own row (Agent
    # Lightning's transitions; for ablations)
    merge_calls: bool = True
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    seed: int = 0
    threads: int | None = None
    # async schedule: groups kept in flight, and the oldest weight version a trained row may come from
    max_inflight_groups: int = 8
    max_staleness: int | None = None  # rows staler than this many versions are dropped (None: keep all)
    tis_cap: float | None = None  # truncated importance sampling cap C (None: plain PPO against μ)
    kl_coef: float = 0.0  # β of the k3 KL penalty to the initial model (0: no reference model loaded)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # the decayed schedules end at lr × this
    max_row_tokens: int | None = None  # rows longer than this are cut (see adapter.length)
    train_on_failed_attempts: bool = False  # also train on calls of attempts lost to infra failures
    time_budget_s: float | None = None  # stop after the step during which this much training time ran out
    device: str = "cpu"  # where the policy (and reference) model trains: "cpu" or "cuda[:N]"
    # linear layers of the policy on CPU: oneDNN-packed (forward and input gradient), F.linear, or auto
    # (oneDNN when its probe logprobs are within 1e-4 of F.linear's; see modeling/packed.py)
    matmul: Literal["auto", "onednn", "aten"] = "auto"
    # collocation: put the engine to sleep during each update (1: KV cache freed, weights moved off the
    # GPU; 2: weights discarded too, the new ones are loaded after wake-up); None keeps it awake
    engine_sleep_level: Literal[1, 2] | None = None
    # at each update's pause, cut non-streaming generations still running and resend them after the
    # update (under the new weights) instead of waiting for them (async: rollouts keep running)
    preempt_on_pause: bool = True

    @model_validator(mode="after")
    def _check(self) -> TrainSection:
        if self.schedule == "async" and self.max_inflight_groups < self.batch_groups:
            raise ValueError(
                f"max_inflight_groups ({self.max_inflight_groups}) must be at least batch_groups "
                f"({self.batch_groups}) for the async schedule"
            )
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError("tis_cap must be positive")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        _check_device(self.device, "train.device")
        return self


class EvalSection(_Section):
    """Held-out evaluation before and after training."""

    n_heldout: int = 100
    temperature: float = 0.0  # the reported held-out reward (0: greedy)
    extra_temperatures: list[float] = Field(default_factory=list)  # also evaluated and reported
    # also evaluate (at `temperature`) after every N-th update during training, logged with the step
    # as `heldout_reward` (0: only before and after); its time is left out of `train_wall_seconds`
    every: int = Field(default=0, ge=0)


class DataSection(_Section):
    """Task data of the example."""

    n_train: int = 1000
    seed: int = 0


class RunConfig(_Section):
    """Everything one run needs."""

    example: str = "calc"
    run_dir: str = "runs/demo"
    engine: EngineSection = Field(default_factory=EngineSection)
    gateway: GatewaySection = Field(default_factory=GatewaySection)
    controller: ControllerSection = Field(default_factory=ControllerSection)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    data: DataSection = Field(default_factory=DataSection)


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says which and why."""


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one `a.b.c=value` override (value parsed as YAML) to a nested dict in place."""
    if "=" not in override:
        raise ConfigError(f"override '{override}' must look like section.key=value")
    path, raw = override.split("=", 1)
    keys = path.strip().split(".")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{override}': '{k}' is not a section")
    node[keys[-1]] = yaml.safe_load(raw)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or the defaults) and apply dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"config {path} must be a mapping of sections")
        data = loaded
    for o in overrides or []:
        apply_override(data, o)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"config error at '{where}': {first['msg']}") from e
