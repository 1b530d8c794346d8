"""The run configuration's sections (engine, gateway, controller, train, eval, harness, tasks, grader)
and `RunConfig`, the whole of them: typed, with every default and check in one place."""

from __future__ import annotations

import importlib.util
import re
from typing import Any, Literal

from pydantic import Field, model_validator

from harnessrl.adapter import AdvantageLevel, Credit, Estimator, LossMode, ZeroVariance
from harnessrl.config.project import GraderSection, HarnessSection, TasksSection, _Section
from harnessrl.config.teaching import SftSection, TeacherSection, algorithm_problem
from harnessrl.defaults import (
    DEFAULT_MAX_TOKENS,
    ENGINE_MAX_BATCH,
    LORA_TARGET_MODULES,
    ROLLOUT_CACHE_SIZE,
    WAL_LIMIT_MB,
)
from harnessrl.schema import GuardPolicy
from harnessrl.store import is_postgres_url


class EngineSection(_Section):
    """The engine: the builtin one (started by the run) or an external vLLM / SGLang server."""

    # a model directory, or "smollm2" for the packaged SmolLM2-135M-Instruct ("smollm2-16k",
    # "smollm2-32k": the same weights with YaRN-scaled RoPE for long harness prompts)
    model: str = "smollm2"
    port: int = Field(default=0, ge=0, le=65535)  # 0: pick a free port
    max_batch: int = Field(
        default=ENGINE_MAX_BATCH, ge=1
    )  # sequences the engine decodes together (vLLM: --max-num-seqs)
    # context length (prompt + completion) the engine accepts; None: the model's own (8,192 for smollm2,
    # 16,384 for smollm2-16k, 32,768 for smollm2-32k: RoPE-scaled variants, docs/long-context.md)
    max_model_len: int | None = Field(default=None, ge=64)
    threads: int | None = None  # CPU threads of the engine (None: torch's default; vLLM: OMP_NUM_THREADS)
    device: str = "cpu"  # builtin or managed vLLM engine: "cpu" or "cuda[:N]"
    # engine weights and KV cache (builtin, managed vLLM)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # builtin engine on CPU: oneDNN-packed linear weights, F.linear, or auto (see modeling/packed.py)
    matmul: Literal["auto", "onednn", "aten"] = "auto"
    # which implementation computes the model (engine and trainer alike): "auto" (a builtin family when
    # config.json names one: Llama, Qwen2, Qwen3, Gemma 3; else transformers' own: Qwen3.5, Gemma 4, MoE,
    # ...), "builtin" or "transformers" (docs/models.md)
    model_impl: Literal["auto", "builtin", "transformers"] = "auto"
    # tool-call format the engine and the gateway parse completions with: "auto" (detected from the
    # model's own chat template: hermes for <tool_call>, llama3_json for Llama 3.1+, qwen3_coder for
    # Qwen3.5's <function=...>, gemma4 for Gemma 4's <|tool_call>, pythonic for [f(x=1)]; the hermes
    # convention for templates without tools), or one of those names, or "none" (docs/models.md)
    tool_parser: Literal["auto", "hermes", "llama3_json", "qwen3_coder", "gemma4", "pythonic", "none"] = (
        "auto"
    )
    # extra variables for the model's chat template on every call, e.g. {"enable_thinking": false} for
    # Qwen3; a request's `chat_template_kwargs` overrides them (docs/models.md)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # "vllm": vLLM's OpenAI server; at `url` if set (already running, serving `model`), else started and
    # stopped by the run from vLLM's own venv (docs/vllm.md). "sglang": a server already running at
    # `url`. An external server must be able to read the run directory, where new weights are written.
    kind: Literal["builtin", "vllm", "sglang"] = "builtin"
    url: str | None = None  # the external server's URL (engine.kind vllm / sglang)
    # managed vLLM: its venv's interpreter (None: $HARNESSRL_VLLM_PYTHON, else .bench/venv-vllm/bin/python
    # under the working directory or this checkout, as `make install-vllm` builds it)
    vllm_python: str | None = None
    # vLLM weight sync after each update: "reload" (in place, through /collective_rpc reload_weights;
    # a managed server is restarted if that fails) or "restart" (managed only: a new server each time)
    vllm_sync: Literal["reload", "restart"] = "reload"
    # how a full model reaches the engine after each update: "memory" (builtin engine only, the default
    # there: in the model's dtype through a shared-memory segment on one machine, else streamed over its
    # admin socket; no file) or "file" (a safetensors folder under the run's weights/ the engine reads;
    # vLLM and SGLang always). None: the kind's default.
    # LoRA syncs move the adapter folder either way; checkpoints are files either way (docs/scale.md).
    weight_sync: Literal["memory", "file"] | None = None
    vllm_kv_cache_gb: int = Field(default=1, ge=1)  # managed vLLM on CPU: KV cache GB
    vllm_enforce_eager: bool = False  # managed vLLM: no torch.compile (starts sooner, decodes slower)
    vllm_args: list[str] = Field(default_factory=list)  # managed vLLM: more command-line arguments
    vllm_start_timeout_s: float = Field(default=900.0, gt=0)  # managed vLLM: longest wait for /health

    @model_validator(mode="after")
    def _external_needs_url(self) -> EngineSection:
        if self.kind == "sglang" and not self.url:
            raise ValueError(f"engine.kind {self.kind!r} needs engine.url (the running server)")
        if self.vllm_sync == "restart" and (self.kind != "vllm" or self.url):
            raise ValueError(
                "engine.vllm_sync=restart needs a managed vLLM (engine.kind=vllm, no engine.url)"
            )
        if self.weight_sync == "memory" and self.kind != "builtin":
            raise ValueError(
                f"engine.weight_sync=memory needs the builtin engine; a {self.kind} server loads a folder "
                "(set engine.weight_sync=file or leave it unset)"
            )
        _check_device(self.device, "engine.device")
        return self


def _check_device(device: str, name: str) -> None:
    if device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:N', not {device!r}")


class GatewaySection(_Section):
    """The gateway process."""

    port: int = Field(default=0, ge=0, le=65535)  # 0: pick a free port (replica r: port + r)
    default_max_tokens: int = Field(
        default=DEFAULT_MAX_TOKENS, ge=1
    )  # completion budget of a call whose request sets none
    mode: Literal["passthrough", "tito"] = "passthrough"  # tito: the gateway builds prompts from token IDs
    # Gateway processes on the run's store (> 1 needs `store: postgresql://…`): each rollout is served
    # by one of them, and moves to another if that one stops answering (docs/scale.md).
    replicas: int = Field(default=1, ge=1, le=64)
    # Gateways already running (e.g. a Kubernetes StatefulSet; the run starts none): their URLs as the
    # controller and the harnesses reach them, the admin key in $HARNESSRL_ADMIN_KEY; when the run starts
    # the engine, the engine key they were started with in $HARNESSRL_ENGINE_KEY. Several URLs are
    # replicas on one PostgreSQL store (the `store` setting names it too, for `inspect` and the index).
    urls: list[str] = Field(default_factory=list)
    # rollouts each gateway keeps in memory (keys, state; least recently used out, re-read from the
    # store when needed again)
    rollout_cache_size: int = Field(default=ROLLOUT_CACHE_SIZE, ge=1)
    # Every try of one model call together, on all engine replicas; None: CALL_TIMEOUT_SHARE (0.8) of
    # controller.harness_timeout_s, so a call an overloaded engine cannot finish fails (recorded as
    # failed) before the harness is killed, not after. Set, it must stay below harness_timeout_s.
    call_timeout_s: float | None = Field(default=None, gt=0)
    upstream_timeout_s: float | None = Field(default=None, gt=0)  # one try; None: the call timeout
    stream_open_timeout_s: float = Field(default=30.0, gt=0)  # one streamed try, until the engine's headers
    wal_limit_mb: float = Field(default=WAL_LIMIT_MB, gt=0)  # bound on the SQLite store's write-ahead log

    def timeouts(self, harness_timeout_s: float) -> tuple[float, float]:
        """(upstream try, whole call) in seconds, by the rule above."""
        call = self.call_timeout_s or CALL_TIMEOUT_SHARE * harness_timeout_s
        return min(self.upstream_timeout_s or call, call), call


CALL_TIMEOUT_SHARE = 0.8  # gateway.call_timeout_s defaults to this share of controller.harness_timeout_s


class ControllerSection(_Section):
    """Running harnesses."""

    concurrency: int = Field(default=16, ge=1)  # attempts running at once
    harness_timeout_s: float = Field(
        default=300.0, gt=0
    )  # an attempt running longer is killed (its process group) and graded as timed out
    max_attempts: int = Field(
        default=2, ge=1
    )  # tries per rollout when attempts fail for infrastructure reasons
    grader_timeout_s: float = Field(default=60.0, gt=0)  # a grader running longer is a grader error
    grader_retries: int = Field(
        default=0, ge=0
    )  # a crashed grader runs again this many times before the rollout fails
    # Each attempt in a bubblewrap sandbox: no network but the gateway, a private filesystem view,
    # resource limits (docs/sandbox.md; None in a sandbox_* limit: not limited). "auto": wherever bwrap
    # works on this machine, else plain subprocesses with a loud warning; true: required (an error where
    # bwrap cannot run); false: plain subprocesses, chosen.
    sandbox: Literal["auto"] | bool = "auto"  # (what each mode guarantees: docs/security.md)
    # Local runs: Python harnesses forked from a process that has already imported `preload`
    # (docs/operations.md), saving each attempt's interpreter start and imports. With `sandbox` or
    # `ray_address` it does not apply (those runners start every attempt themselves).
    fork_server: bool = False
    # modules the fork server imports once, e.g. [harnessrl.preload.openai] (openai, first request warmed)
    preload: list[str] = Field(default_factory=list)
    sandbox_cpu_seconds: int | None = None  # CPU seconds per process (RLIMIT_CPU)
    sandbox_memory_mb: int | None = 4096  # per process (RLIMIT_AS)
    sandbox_max_processes: int | None = 256  # processes per user in the sandbox (RLIMIT_NPROC)
    sandbox_max_file_mb: int | None = 1024  # largest file the harness may write (RLIMIT_FSIZE)
    sandbox_cgroup: Literal["auto", "required", "never"] = "auto"  # one cgroup bounds the whole attempt
    sandbox_cgroup_memory_mb: int | None = 8192  # all of an attempt's processes together
    sandbox_cgroup_max_pids: int | None = 1024  # processes of one attempt together (cgroup pids.max)
    sandbox_ro_paths: list[str] = Field(default_factory=list)  # more host paths the harness reads (a CLI)
    # aliases of the guard (tasks.guard; docs/security.md, Guards)
    sandbox_hide_git: bool = False  # alias: hidden "**/.git" (every `.git` in the attempt's home/ hidden)
    sandbox_disable_git: bool = False  # alias: no_git (`git` commands fail inside the sandbox)
    # Attempts as Ray tasks on a cluster (docs/ray.md): "auto", "host:port" or "ray://…"; None: local.
    # With `sandbox: true` each attempt is sandboxed on its node.
    ray_address: str | None = None
    ray_num_cpus: float = 1.0  # CPUs Ray reserves per attempt
    ray_memory_mb: int | None = None  # memory Ray reserves per attempt
    ray_resources: dict[str, float] = Field(default_factory=dict)  # custom Ray resources per attempt


TrackerName = Literal["tensorboard", "wandb", "mlflow"]


class LoraSection(_Section):
    """LoRA adapters on the policy's linear projections (docs/lora.md); `train.lora: {}` turns it on."""

    r: int = Field(default=8, ge=1)  # rank of each adapter (A: r × in, B: out × r)
    alpha: float = Field(default=16.0, gt=0)  # the update is scaled by alpha / r
    dropout: float = Field(default=0.0, ge=0, lt=1)  # dropout on the adapter's input, in the update only
    # linear layers adapted, by module name (PEFT's match: the name or its last parts)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGET_MODULES), min_length=1)


POLICY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # a policy's name: a model name and a route


class PolicySection(_Section):
    """One policy of a run with several (docs/lora.md): a LoRA adapter of its own on the shared base,
    chosen by the model name a harness sends (the policy's name, or one of `models`) or the route
    `/p/<name>/v1/...`."""

    models: list[str] = Field(default_factory=list)  # more model names that choose this policy


class TrainSection(_Section):
    """The RL schedule (sync or collocated async) and the PPO update."""

    # sync: roll out, pause, update; async: keep groups in flight during updates
    schedule: Literal["sync", "async"] = "sync"
    steps: int = Field(default=20, ge=1)  # updates to run
    batch_groups: int = Field(default=4, ge=1)  # tasks per step
    group_size: int = Field(default=8, ge=2)  # rollouts per task (GRPO siblings; one alone has no baseline)
    lr: float = Field(default=1e-5, gt=0)  # AdamW learning rate
    weight_decay: float = Field(default=0.0, ge=0)  # AdamW weight decay
    temperature: float = Field(default=1.0, ge=0)  # sampling temperature of training rollouts
    clip_low: float = Field(default=0.2, ge=0)  # PPO clip range below 1 (ratio ≥ 1 − clip_low)
    clip_high: float = Field(default=0.2, ge=0)  # PPO clip range above 1 (ratio ≤ 1 + clip_high)
    max_grad_norm: float = Field(default=1.0, gt=0)  # gradient norm clipping
    micro_batch_tokens: int = Field(
        default=4096, ge=1
    )  # tokens per forward/backward pass (gradient accumulation beyond)
    # a micro-batch's rows packed back to back (linear layers and attention over real tokens only, each
    # row at its own positions; on CUDA bf16 one varlen flash call) or right-padded to the longest; auto:
    # packed when padding would be over 10% of the positions. Same values (trainer/packing.py). On the
    # transformers path only attention-only model types pack (Llama, Qwen2/3, Qwen3-MoE, Gemma 3/4; auto
    # also weighs their one masked attention call); Qwen3.5's linear attention stays padded, `on` an error
    pack_rows: Literal["auto", "on", "off"] = "auto"
    epochs: int = Field(default=1, ge=1)  # optimizer steps over each batch
    estimator: Estimator = (
        Estimator.GRPO
    )  # group baseline: GRPO (mean/std), Dr.GRPO (mean), RLOO (leave-one-out)
    advantage_level: AdvantageLevel = (
        AdvantageLevel.ROLLOUT
    )  # rollout: group statistics over rollouts; sample: over rows (ablation only)
    loss_mode: LossMode = LossMode.ROLLOUT_TOKEN_MEAN  # loss normalisation (docs/concepts.md)
    zero_variance: ZeroVariance = ZeroVariance.KEEP  # groups whose rollouts all got the same reward
    # rollout: one advantage per rollout; step: plus a turn-level term from the grader's step rewards
    # (and annotations a task allows) on the calls they name (adapter/step_credit.py, docs/credit.md)
    credit: Credit = Credit.ROLLOUT
    step_coef: float = Field(default=1.0, ge=0)  # β: scale of the turn-level term under credit: step
    # token-prefix merging of a rollout's calls into rows; False: every call its own row (Agent
    # Lightning's transitions; for ablations)
    merge_calls: bool = True
    checkpoint_every: int = Field(
        default=5, ge=0
    )  # save a checkpoint every N steps and after the last (0: never; SFT saves its last step always)
    keep_checkpoints: int = Field(default=2, ge=1)  # newest checkpoints kept
    seed: int = 0  # seeds the task sampling per step and torch
    threads: int | None = None  # CPU threads of the trainer (None: torch's default)
    # async schedule: groups kept in flight, and the oldest weight version a trained row may come from
    max_inflight_groups: int = Field(default=8, ge=1)
    max_staleness: int | None = None  # rows staler than this many versions are dropped (None: keep all)
    tis_cap: float | None = None  # truncated importance sampling cap C (None: plain PPO against μ)
    kl_coef: float = 0.0  # β of the k3 KL penalty to the initial model (0: no reference model loaded)
    # an MoE model's router load-balancing loss, this times transformers' own (0: off, the RL default;
    # transformers-path MoE models only; trainer/moe_aux.py, docs/models.md)
    moe_aux_loss_coef: float = Field(default=0.0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # learning-rate schedule over `steps`
    warmup_steps: int = 0  # linear warm-up steps
    min_lr_ratio: float = 0.0  # the decayed schedules end at lr × this
    max_row_tokens: int | None = None  # rows longer than this are cut (see adapter.length)
    train_on_failed_attempts: bool = False  # also train on calls of attempts lost to infra failures
    time_budget_s: float | None = Field(
        default=None, gt=0
    )  # stop after the step during which this much training time ran out, saving that step (None: no limit)
    device: str = "cpu"  # where the policy (and reference) model trains: "cpu" or "cuda[:N]"
    # precision of the policy and the KL reference: float32, or bfloat16 (bf16 compute, exact fp32
    # master weights and fp32 AdamW moments; trainer/precision.py, docs/scale.md)
    dtype: Literal["float32", "bfloat16"] = "float32"
    # with dtype bfloat16: AdamW's first moment (exp_avg) in float32, or bfloat16 (2 bytes a parameter
    # less: 12 resident instead of 14; rounded to nearest after each step, the update within a few tenths
    # of a percent of the exact one; the second moment stays fp32; not with fsdp or lora; docs/scale.md)
    exp_avg_dtype: Literal["float32", "bfloat16"] = "float32"
    # with dtype bfloat16: how the bf16 weights the forward and the engine use are taken from the exact
    # fp32 masters after each step: nearest (a weight moves only once its master moved half a bf16 step,
    # so at small learning rates the policy lags its updates), or stochastic (each weight is its master in
    # expectation; int32 low halves, 2 bytes a parameter more); not with fsdp or lora; docs/scale.md
    bf16_rounding: Literal["nearest", "stochastic"] = "nearest"
    # data-parallel trainer ranks: k > 1 starts k - 1 worker processes (or joins those torchrun started)
    # that each take a share of every update's rows; the update equals the 1-rank one (docs/scale.md)
    world_size: int = Field(default=1, ge=1)
    # with world_size > 1: ddp (every rank a full replica) or fsdp (FSDP2: parameters, gradients and
    # optimizer state sharded over the ranks); gloo on CPU, NCCL with one GPU per rank (train.device: cuda)
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # linear layers of the policy on CPU: oneDNN-packed (forward and input gradient), F.linear, or auto
    # (oneDNN when its probe logprobs are within 1e-4 of F.linear's; see modeling/packed.py; bf16 weights
    # on a CPU without fast bf16 products: fp32 products rounded to bf16, modeling/upcast.py)
    matmul: Literal["auto", "onednn", "aten"] = "auto"
    # LoRA: train adapters only (base frozen, optimizer state for the adapters alone; the engine gets
    # the adapter, a few MB, after each update); None: full fine-tuning
    lora: LoraSection | None = None
    # rl: the RL loop; sft: fine-tune on the recorded calls of `sft.source` instead (what `harnessrl sft` runs)
    algorithm: Literal["rl", "sft"] = "rl"
    # on-policy distillation (docs/distillation.md): a teacher scores every token the student sampled
    teacher: TeacherSection | None = None
    distill_coef: float = Field(default=1.0, ge=0)  # weight of the per-token reverse KL (with `teacher`)
    # collocation: put the engine to sleep during each update (1: KV cache freed, weights moved off the
    # GPU; 2: weights discarded too, the new ones are loaded after wake-up); None keeps it awake
    engine_sleep_level: Literal[1, 2] | None = None
    # at each update's pause, cut non-streaming generations still running and resend them after the
    # update (under the new weights) instead of waiting for them (async: rollouts keep running)
    preempt_on_pause: bool = True
    # where step metrics go besides metrics.jsonl, each with a table of sample completions per step:
    # tensorboard (RUN_DIR/tensorboard), wandb (Weights & Biases), mlflow (docs/trackers.md)
    log_to: list[TrackerName] = Field(default_factory=lambda: list[TrackerName](["tensorboard"]))
    sample_rollouts: int = Field(default=4, ge=0)  # rollouts per step in the trackers' sample table (0: none)
    wandb_project: str = "harnessrl"  # the Weights & Biases project of the run
    # offline: the run's files in RUN_DIR/wandb, uploaded later with `wandb sync`; online: live (needs a login)
    wandb_mode: Literal["offline", "online"] = "offline"
    # an MLflow server or store URI (None: a file store in RUN_DIR/mlruns)
    mlflow_tracking_uri: str | None = None

    @model_validator(mode="after")
    def _check(self) -> TrainSection:
        if self.schedule == "async" and self.max_inflight_groups < self.batch_groups:
            raise ValueError(
                f"max_inflight_groups ({self.max_inflight_groups}) must be at least batch_groups "
                f"({self.batch_groups}) for the async schedule"
            )
        if self.advantage_level == AdvantageLevel.SAMPLE and self.estimator != Estimator.GRPO:
            raise ValueError(
                f"advantage_level 'sample' (an ablation) uses GRPO statistics over rows; it cannot be "
                f"combined with estimator {self.estimator.value!r}"
            )
        if self.credit == Credit.STEP and self.advantage_level == AdvantageLevel.SAMPLE:
            raise ValueError("credit 'step' builds on rollout-level advantages; set advantage_level: rollout")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError("tis_cap must be positive")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        _check_device(self.device, "train.device")
        if self.world_size > 1 and self.device not in ("cpu", "cuda"):
            raise ValueError(
                f"train.device {self.device!r} with train.world_size > 1: set cpu, or cuda (each rank then "
                "takes cuda:<LOCAL_RANK>, one GPU per rank)"
            )
        self._check_exp_avg_dtype()
        self._check_bf16_rounding()
        if self.teacher is not None and (self.schedule == "async" or self.world_size > 1):
            raise ValueError("train.teacher runs with the sync schedule in one process so far")
        if self.world_size > 1 and self.lora is not None:
            raise ValueError("train.lora trains in one process so far; set train.world_size: 1")
        for tracker, module in (("wandb", "wandb"), ("mlflow", "mlflow")):
            if tracker in self.log_to and importlib.util.find_spec(module) is None:
                raise ValueError(
                    f"log_to has {tracker}, but the {module} package is not installed: "
                    "pip install 'harnessrl[trackers]' (or remove it from train.log_to)"
                )
        return self

    def _check_exp_avg_dtype(self) -> None:
        """A bf16 first moment applies to bf16 parameters under MasterAdamW (trainer/precision.py) only."""
        self._check_master_adamw_option(
            "exp_avg_dtype", "bfloat16", "float32",
            applies="applies to bf16 parameters; set train.dtype: bfloat16 (float32 training keeps fp32 moments)",
            fsdp="its shards are fp32 master weights under plain AdamW",
            lora="the adapters train in fp32 and their state is small",
        )  # fmt: skip

    def _check_bf16_rounding(self) -> None:
        """Stochastic rounding applies to bf16 parameters under MasterAdamW (trainer/precision.py) only."""
        self._check_master_adamw_option(
            "bf16_rounding", "stochastic", "nearest",
            applies="rounds bf16 weights from their fp32 masters; set train.dtype: bfloat16 (float32 weights are "
            "not rounded)",
            fsdp="FSDP2 casts its fp32 shards to bf16 for each forward, to nearest",
            lora="the adapters train in fp32, the bf16 base is frozen",
        )  # fmt: skip

    def _check_master_adamw_option(
        self, name: str, value: str, default: str, applies: str, fsdp: str, lora: str
    ) -> None:
        """A MasterAdamW option (`train.<name>` other than its `default`) needs bf16 parameters in one
        process or ddp: refused, naming the field and why, with float32, fsdp (fp32 shards under torch's
        AdamW) and lora (fp32 adapters)."""
        if getattr(self, name) == default:
            return
        setting = f"train.{name}: {value}"
        if self.dtype != "bfloat16":
            raise ValueError(f"{setting} {applies} or train.{name}: {default}")
        if self.world_size > 1 and self.parallel == "fsdp":
            raise ValueError(
                f"{setting} does not apply with train.parallel: fsdp ({fsdp}); set train.{name}: {default} "
                "or train.parallel: ddp"
            )
        if self.lora is not None:
            raise ValueError(
                f"{setting} does not apply with train.lora ({lora}); set train.{name}: {default}"
            )


class EvalSection(_Section):
    """Held-out evaluation before and after training."""

    n_heldout: int = Field(default=100, ge=1)  # at most this many held-out tasks are evaluated
    temperature: float = Field(default=0.0, ge=0)  # the reported held-out reward (0: greedy)
    extra_temperatures: list[float] = Field(default_factory=list)  # also evaluated and reported
    # also evaluate (at `temperature`) after every N-th update during training, logged with the step
    # as `heldout_reward` (0: only before and after); its time is left out of `train_wall_seconds`
    every: int = Field(default=0, ge=0)
    # false: no evaluation before training (its figures are null in summary.json), for a caller that
    # evaluated the same starting model once already (`harnessrl eval`, bench/distill.py)
    before: bool = True


class DataSection(_Section):
    """How many tasks to take, and the seed of generators and splits."""

    # training tasks: at most this many from a task file (None: all), exactly this many from a
    # generator (None: 1000)
    n_train: int | None = Field(default=None, ge=1)
    seed: int = 0  # seed of generators and of `tasks.heldout_fraction`'s split


class RunConfig(_Section):
    """Everything one run needs."""

    name: str = ""  # a label for the run (summary.json, inspect); default: the config file's folder name
    # where `grader.python` and `tasks.generator` modules are looked up first; set by `load_config` to
    # the config file's folder
    config_dir: str = ""
    run_dir: str = "runs/demo"  # where the run keeps its store, logs, checkpoints and summary (relative to the current folder)
    # Where the gateway records rollouts and calls: "" is `<run_dir>/store.sqlite`; another path is a
    # SQLite file; a postgresql://user@host:port/db URL is a PostgreSQL database (the `postgres` extra;
    # migrations are applied at start; docs/operations.md). `inspect` and `export` read either; the
    # dashboard reads SQLite stores.
    store: str = ""
    harness: HarnessSection = Field(default_factory=HarnessSection)
    tasks: TasksSection = Field(default_factory=TasksSection)
    grader: GraderSection = Field(default_factory=GraderSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    gateway: GatewaySection = Field(default_factory=GatewaySection)
    controller: ControllerSection = Field(default_factory=ControllerSection)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    data: DataSection = Field(default_factory=DataSection)
    sft: SftSection = Field(default_factory=SftSection)  # `harnessrl sft` (docs/distillation.md)
    # several policies in one run: policy name -> {models: [more model names that choose it]}; each
    # trains a LoRA adapter of its own (needs train.lora); a harness chooses one by the model name it
    # sends or the route /p/<name>/v1; a call naming no policy goes to the first listed (docs/lora.md)
    policies: dict[str, PolicySection] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _policies_are_adapters(self) -> RunConfig:
        if not self.policies:
            return self
        if self.train.lora is None:
            raise ValueError(
                "policies: each policy trains a LoRA adapter of its own on the shared base; set train.lora "
                "(train.lora={} takes every default) or remove policies"
            )
        seen: dict[str, str] = {}
        for name, policy in self.policies.items():
            if not POLICY_NAME.match(name):
                raise ValueError(
                    f"policies: {name!r} is not a valid policy name (letters, digits, '.', '_', '-'; at most 64)"
                )
            for model in (name, *policy.models):
                if model in seen and seen[model] != name:
                    raise ValueError(
                        f"policies: model name {model!r} chooses both {seen[model]!r} and {name!r}"
                    )
                seen[model] = name
        return self

    def policy_models(self) -> dict[str, list[str]]:
        """Every policy with the model names that choose it (its own first), in the config's order (the
        first policy is the default)."""
        return {name: [name, *(m for m in p.models if m != name)] for name, p in self.policies.items()}

    @model_validator(mode="after")
    def _sft_has_a_source(self) -> RunConfig:
        problem = algorithm_problem(self.train.algorithm, self.sft, self.train)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _calls_fail_before_harnesses_die(self) -> RunConfig:
        call, harness = self.gateway.call_timeout_s, self.controller.harness_timeout_s
        if call is not None and call >= harness:
            raise ValueError(
                f"gateway.call_timeout_s ({call:g}) must be below controller.harness_timeout_s ({harness:g}): "
                "a call that cannot finish should fail before its harness is killed (unset it for 0.8x)"
            )
        return self

    @model_validator(mode="after")
    def _replicas_need_a_shared_store(self) -> RunConfig:
        if self.train.lora is not None and self.engine.kind != "builtin":
            raise ValueError(
                f"train.lora is served by the builtin engine so far (engine.kind {self.engine.kind!r} "
                "cannot load adapters yet); set engine.kind: builtin or remove train.lora"
            )
        if self.gateway.urls and self.gateway.replicas > 1:
            raise ValueError("gateway.urls names running gateways; gateway.replicas starts them: set one")
        bad = [u for u in self.gateway.urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"gateway.urls: {bad[0]!r} is not an http(s):// URL")
        if self.gateway.replicas > 1 and not is_postgres_url(self.store):
            raise ValueError(
                f"gateway.replicas={self.gateway.replicas} needs a store every replica writes: set "
                "store to a postgresql:// URL (a SQLite file belongs to one gateway process)"
            )
        return self

    def guard(self) -> GuardPolicy | None:
        """The guard of every task of the run: `tasks.guard` with the controller's old git flags."""
        c = self.controller
        alias = GuardPolicy(hidden=["**/.git"] if c.sandbox_hide_git else [], no_git=c.sandbox_disable_git)
        if alias.empty:
            return self.tasks.guard
        return alias.merged(self.tasks.guard)

    def missing(self) -> list[str]:
        """What a training run still lacks (harness, tasks, grader): one line each, empty when complete."""
        out = []
        if not self.harness.command:
            out.append("harness.command: the argv that starts your harness, e.g. [python, harness.py]")
        if not (self.tasks.train or self.tasks.generator):
            out.append("tasks.train: a JSONL file of tasks (or tasks.generator: module:function)")
        if not (self.grader.python or self.grader.command or self.grader.judge):
            out.append("grader.python: module:function (or grader.command: argv, or grader.judge)")
        return out
