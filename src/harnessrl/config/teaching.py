"""The config of learning from a teacher (docs/distillation.md): `sft` (fine-tuning on recorded calls,
`harnessrl sft`) and `train.teacher` (on-policy distillation: a teacher scores the student's tokens)."""

from __future__ import annotations

from typing import Any, Literal, Protocol

from pydantic import Field, model_validator

from harnessrl.config.project import _Section


class TrainFields(Protocol):
    """What these checks read of the `train` section (config.sections.TrainSection; a protocol, not an
    import: sections imports this module)."""

    teacher: Any
    world_size: int
    lora: Any
    moe_aux_loss_coef: float


class SftSection(_Section):
    """Supervised fine-tuning on recorded calls (`harnessrl sft --config C --from RUN_DIR|TRACE`)."""

    # rollouts whose reward is below this are left out (None: every rollout, graded or not)
    min_reward: float | None = None
    epochs: int = Field(default=1, ge=1)  # passes over the rows
    batch_rows: int = Field(default=8, ge=1)  # rows per optimizer step
    lr: float | None = Field(default=None, gt=0)  # AdamW learning rate (None: train.lr)
    # the student's template over the recorded messages (text-level): auto (where the recorded tokens are
    # not what the student's template and tokenizer give), always, or never (the recorded tokens as they are)
    retemplate: Literal["auto", "always", "never"] = "auto"
    include_eval: bool = False  # also train on evaluation rollouts (held-out tasks: off, they leak)
    # the recorded calls to imitate: a run directory or a trace file (relative to the current folder);
    # the --from of `harnessrl sft` sets it; `train.algorithm: sft` needs it
    source: str | None = None


class TeacherSection(_Section):
    """On-policy distillation: a teacher's logprobs of the tokens the student sampled (`train.teacher`)."""

    # a model folder (or known name) loaded beside the trainer, or `url` of a server answering
    # /v1/completions with vLLM's `prompt_logprobs` for token-ID prompts (then `model` is the served name)
    model: str = ""
    url: str | None = None
    api_key: str | None = None  # the server's key (url only)
    rl: bool = (
        False  # also train on the rollout's RL advantage (distillation + RL); False: distillation alone
    )
    batch_rows: int = Field(default=8, ge=1)  # rows per teacher request (url) or forward (model)
    timeout_s: float = Field(default=300.0, gt=0)  # one teacher request (url)
    tokenizer: str | None = None  # url only: a folder with the served model's tokenizer.json, for the check

    @model_validator(mode="after")
    def _names_a_teacher(self) -> TeacherSection:
        if not self.model and not self.url:
            raise ValueError(
                "train.teacher needs model (a model folder) or url (a server with prompt logprobs)"
            )
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"train.teacher.url: {self.url!r} is not an http(s):// URL")
        return self


def algorithm_problem(algorithm: str, sft: SftSection, train: TrainFields) -> str | None:
    """What is wrong with `train.algorithm: sft` in this config (None: nothing, or the algorithm is rl)."""
    if algorithm != "sft":
        return None
    if not sft.source:
        return (
            "train.algorithm: sft fine-tunes on recorded calls: set sft.source to a run directory or a trace "
            "file (harnessrl export RUN --format trace), or use harnessrl sft --from RUN_DIR|TRACE"
        )
    if train.teacher is not None:
        return (
            "train.teacher is on-policy distillation, part of the RL loop: remove it, or set "
            "train.algorithm: rl (SFT imitates sft.source's calls and scores nothing with a teacher)"
        )
    return sft_unsupported(train)


def sft_unsupported(train: TrainFields) -> str | None:
    """The first setting of `train` that SFT (one process, full fine-tuning, trainer/sft.py) cannot
    honour, as an error naming the field and the fix; None when SFT trains as the config asks."""
    if train.world_size > 1:
        return (
            f"train.world_size: {train.world_size}: SFT trains in one process (no ddp or fsdp ranks); "
            "set train.world_size=1 for it"
        )
    if train.lora is not None:
        return (
            "train.lora: SFT fine-tunes every parameter (no LoRA adapters yet); remove train.lora "
            "(train.lora=null) for it"
        )
    if train.moe_aux_loss_coef > 0:
        return (
            f"train.moe_aux_loss_coef: {train.moe_aux_loss_coef:g}: SFT adds no router load-balancing loss; "
            "set train.moe_aux_loss_coef=0 for it"
        )
    return None
