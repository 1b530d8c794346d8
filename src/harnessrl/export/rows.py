"""Training rows of a run, as the trainer built them, in a flat schema other trainers can read.

Each training step's rollouts (numbered as in `metrics.jsonl`; the groups of the async schedule one
by one) go through the adapter's own `build_batch` with the run's settings from `config.json`: merge
by token prefix, advantages over each group with `train.estimator`, the zero-variance rule, the length
limit, and the loss weights of `train.loss_mode` over that batch. So every exported row carries the
advantage and per-token weights the update used. Staleness filters (async runs) are not applied.

One record per row (`TrainingRow`, schema version `ROWS_SCHEMA_VERSION`); docs/export.md maps the
columns onto verl's, TRL's and OpenRLHF's names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.adapter import build_batch
from harnessrl.inspection.runview import Place, RunSettings, all_rollouts, rollout_place
from harnessrl.schema import Rollout
from harnessrl.store import Store

ROWS_SCHEMA_VERSION: Final = 1
"""Version of the exported row schema; bump on any incompatible change."""


class TrainingRow(BaseModel):
    """One training sample: a token sequence of one rollout with everything the policy loss needs.

    `input_ids[i]` is trained on when `loss_mask[i]` is 1 (a token the model sampled); there
    `old_logprobs[i]` is the engine's logprob at `temperature` and `token_weights[i]` the token's weight
    in its step's loss (the sum over a step's rows is 1 with the default loss mode). The loss of the
    update is Σ token_weights · ℓ(token, advantage)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = Field(description="ROWS_SCHEMA_VERSION of the writer")
    run_id: str | None = Field(description="the run's id (run.json), None when unknown")
    step: int | None = Field(description="the update the row fed (1-based, as in metrics.jsonl); None: async")
    group_index: int | None = Field(description="async schedule: the group index k (g<k>); else None")
    rollout_id: str = Field(description="the rollout the row comes from")
    group_id: str = Field(description="the rollout's group (GRPO siblings); the rollout id when it has none")
    task_id: str = Field(description="the task the rollout tried")
    attempt: int = Field(description="the attempt whose calls made the row")
    row_index: int = Field(description="position of the row among its rollout's rows")
    call_ids: list[str] = Field(description="the calls merged into the row, in order")
    weight_versions: list[int | None] = Field(description="the weight version that served each call")
    policy: str | None = Field(
        default=None, description="several policies: the policy (LoRA adapter) the row trains; None: the one"
    )
    temperature: float = Field(description="sampling temperature the old logprobs were computed at")
    reward: float = Field(description="the rollout's reward")
    advantage: float = Field(
        description="the rollout's advantage (every trainable token gets it, "
        "plus a turn-level term under train.credit step: `token_advantages`)"
    )
    input_ids: list[int] = Field(description="the row's token ids")
    loss_mask: list[int] = Field(
        description="1 where the token was sampled by the model (trained on), else 0"
    )
    old_logprobs: list[float] = Field(description="the engine's logprob per token; 0 where loss_mask is 0")
    token_weights: list[float] = Field(
        description="per-token weight in the step's loss; 0 where loss_mask is 0"
    )
    n_tokens: int = Field(description="len(input_ids)")
    n_trainable: int = Field(description="sum(loss_mask)")
    token_advantages: list[float] | None = Field(
        default=None,
        description="train.credit step: each token's advantage (the rollout's plus its call's "
        "turn-level term, docs/credit.md); None: every trainable token has `advantage`",
    )


def _batch_key(place: Place) -> tuple[int, int] | None:
    """Which update a training rollout fed: (step, -1) sync, (-1, group) async; None: not trained on."""
    if place.phase != "train":
        return None
    if place.step is not None:
        return (place.step, -1)
    if place.group is not None:
        return (-1, place.group)
    return None


def training_batches(store: Store) -> dict[tuple[int, int], list[Rollout]]:
    """The training rollouts of a run by the update they fed, in step (then group) order."""
    batches: dict[tuple[int, int], list[Rollout]] = {}
    for r in all_rollouts(store):
        key = _batch_key(rollout_place(r))
        if key is not None:
            batches.setdefault(key, []).append(r)
    return dict(sorted(batches.items()))


def iter_rows(store: Store, settings: RunSettings, run_id: str | None) -> Iterator[TrainingRow]:
    """Every training row of the run, step by step, rollouts in creation order within a step."""
    for (step, group), rollouts in training_batches(store).items():
        details = [store.detail(r.rollout_id) for r in rollouts]
        batch = build_batch(
            details, settings.advantage_level, settings.estimator, settings.loss_mode, settings.zero_variance,
            max_row_tokens=settings.max_row_tokens, include_failed_attempts=settings.include_failed_attempts,
            merge=settings.merge, credit=settings.credit, step_coef=settings.step_coef,
        )  # fmt: skip
        by_id = {d.rollout.rollout_id: d for d in details}
        position: dict[str, int] = {}
        per_token: list[list[float] | None] = (
            list(batch.token_advantages) if batch.token_advantages is not None else [None] * len(batch.rows)
        )
        for row, adv, weights, toks in zip(
            batch.rows, batch.advantages, batch.weights, per_token, strict=True
        ):
            d = by_id[row.rollout_id]
            attempt = next(c.attempt for c in d.calls if c.call_id == row.call_ids[0])
            index = position.get(row.rollout_id, 0)
            position[row.rollout_id] = index + 1
            yield TrainingRow(
                schema_version=ROWS_SCHEMA_VERSION, run_id=run_id,
                step=step if step >= 0 else None, group_index=group if group >= 0 else None,
                rollout_id=row.rollout_id, group_id=d.rollout.group_id or row.rollout_id,
                task_id=d.rollout.task_id, attempt=attempt, row_index=index, call_ids=list(row.call_ids),
                weight_versions=list(row.weight_versions), policy=row.policy, temperature=row.temperature,
                reward=batch.rewards[row.rollout_id], advantage=adv, input_ids=list(row.tokens),
                loss_mask=list(row.loss_mask), old_logprobs=list(row.old_logprobs),
                token_weights=list(weights), n_tokens=len(row.tokens), n_trainable=row.n_trainable,
                token_advantages=toks,
            )  # fmt: skip
