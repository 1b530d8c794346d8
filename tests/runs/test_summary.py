"""A run's summary when `eval.before` is off: the before figures are null, the after ones as always."""

from __future__ import annotations

from harnessrl.config import load_config
from harnessrl.runs.summary import summarise
from harnessrl.trainer.loop import EvalResult


def test_summary_without_the_before_evaluation() -> None:
    cfg = load_config(None, ["eval.before=false", "eval.extra_temperatures=[1.0]"])
    after = [EvalResult(0.5, 0.2, 0.8, 4), EvalResult(0.25, 0.05, 0.7, 4, failed=1)]
    s = summarise(cfg, [], after, 3, [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.3}])
    assert s["heldout_reward_before"] is None and s["heldout_ci95_before"] is None
    assert s["heldout_reward_after"] == 0.5 and s["n_heldout"] == 4 and s["heldout_curve"] == [[3, 0.5]]
    assert s["heldout_by_temperature"]["1"] == {"before": None, "after": after[1].as_dict()}
    assert s["heldout_failed_before"] is None and s["heldout_failed_after"] == 0
    with_before = summarise(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"before": True})}),
                            after, after, 3, [])  # fmt: skip
    assert (
        with_before["heldout_curve"] == [[0, 0.5], [3, 0.5]] and with_before["heldout_reward_before"] == 0.5
    )
