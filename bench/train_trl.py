"""harnessrl against TRL's `GRPOTrainer`: reward against wall-clock on the single-turn `instruct` task.

Both arms train SmolLM2-135M-Instruct (fp32, CPU) on the same train prompts with the same GRPO
settings, taken from the instruct example's config: group size, tasks per step (so the same
completions per optimizer step), sampling temperature, completion length cap
(`gateway.default_max_tokens`), learning rate (constant), clip 0.2, no KL, one epoch per batch, and the
same per-completion token-mean loss (harnessrl's rollout-token-mean is TRL's `loss_type="grpo"` when a
rollout is one call). Each arm trains until the same wall-clock budget runs out and stops after the
step during which it ran out; evaluation is not counted in the budget.

- **harnessrl**: `run(cfg)` on the instruct config (engine + gateway + harness subprocesses + PPO
  trainer) with `train.time_budget_s`; held-out reward before and after.
- **TRL**: `GRPOTrainer` in this process with `grpo_reward`; a callback stops it when the budget is
  spent and evaluates the held-out tasks (greedy `model.generate`, `reward_text`, the same chat
  rendering) before, after and at `--mid-evals` points in between, with the clock paused.

`--seeds` runs one pair per `train.seed` (harnessrl's task order and sampling, TRL's `seed`; the
train and held-out tasks stay the same). Writes `--out` after every arm (bench/results/trl.json: per
seed and arm held-out before/after with 95% intervals, steps, train wall, completions per second, the
training-reward curve against training wall-clock; `over_seeds`: per-arm means and the harnessrl − TRL
difference of held-out after, paired by seed, with its standard error; `--resume` keeps the arms
already there) and `--plot` (docs/img/trl_vs_harnessrl.png), and prints a table. `eval_wall_s` is the time outside
training: for harnessrl also the start of engine and gateway, for TRL the evaluations alone. Both arms
run one after the other on this machine: run it when nothing else is (the load averages around each
arm are in the JSON); `--threads 1` keeps a shared machine from stalling multi-threaded torch.

    .venv/bin/python bench/train_trl.py [--seeds 0 1 2 3 4 5] [--budget-s 600] [--n-heldout 100] [--resume]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harnessrl.chat import render_chat
from harnessrl.config import RunConfig, load_config
from harnessrl.examples import get_example
from harnessrl.examples.instruct.task import build_splits, grpo_reward, reward_text, trl_dataset
from harnessrl.modeling.loading import resolve_model
from harnessrl.runs.flow import run
from harnessrl.trainer.metrics import mean_ci95

ARMS = ("harnessrl", "trl")
DEFAULT_BUDGET_S = 600.0
DEFAULT_N_HELDOUT = 60
ROOT = Path(__file__).resolve().parent.parent


# --- shared -----------------------------------------------------------------------------------------


def bench_config(args: argparse.Namespace, seed: int) -> RunConfig:
    """The instruct example's config with the bench's overrides for one seed (both arms read their
    settings here; `train.seed` seeds harnessrl's task order and sampling and TRL's `seed`)."""
    overrides = [
        f"run_dir={args.run_root}/seed{seed}/harnessrl",
        f"train.seed={seed}",
        f"eval.n_heldout={args.n_heldout}",
        "eval.extra_temperatures=[]",
        "train.steps=100000",  # more than any budget allows: the time budget stops the run
        f"train.time_budget_s={args.budget_s}",
        "train.checkpoint_every=0",  # neither arm saves checkpoints inside the budget
        *([f"engine.threads={args.threads}", f"train.threads={args.threads}"] if args.threads else []),
        *args.override,
    ]
    return load_config(get_example("instruct").config_path, overrides)


def heldout_stats(rewards: list[float]) -> dict[str, Any]:
    """Mean, 95% interval (harnessrl's `mean_ci95`) and n of per-task held-out rewards."""
    mean, lo, hi = mean_ci95(rewards)
    return {"mean": mean, "ci95": [lo, hi], "n": len(rewards)}


# --- harnessrl arm ----------------------------------------------------------------------------------


def run_harnessrl(cfg: RunConfig) -> dict[str, Any]:
    """One full harnessrl run (eval before, training under the budget, eval after) and its curve."""

    def on_step(step: int, m: dict[str, Any]) -> None:
        print(f"  harnessrl step {step}: reward {m['reward']:.3f}  step {m['time_step_s']:.1f}s  "
              f"(rollouts {m['time_rollout_s']:.1f}s, update {m['time_update_s']:.1f}s)", flush=True)  # fmt: skip

    started = time.time()
    summary = run(cfg, fresh=True, on_step=on_step)
    records = [
        json.loads(line)
        for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    curve, elapsed = [], 0.0
    for r in records:
        elapsed += r["time_step_s"]
        curve.append({"step": r["step"], "train_s": elapsed, "reward": r["reward"]})
    lo_b, hi_b = summary["heldout_ci95_before"]
    lo_a, hi_a = summary["heldout_ci95_after"]
    n, train_wall, steps = summary["n_heldout"], summary["train_wall_seconds"], summary["train_steps"]
    completions = sum(r["rollouts"] - r.get("rollouts_failed", 0) for r in records)
    return {
        "heldout_before": {"mean": summary["heldout_reward_before"], "ci95": [lo_b, hi_b], "n": n},
        "heldout_after": {"mean": summary["heldout_reward_after"], "ci95": [lo_a, hi_a], "n": n},
        "heldout_curve": [
            {"train_s": 0.0, "step": 0, "mean": summary["heldout_reward_before"], "ci95": [lo_b, hi_b]},
            {
                "train_s": train_wall,
                "step": steps,
                "mean": summary["heldout_reward_after"],
                "ci95": [lo_a, hi_a],
            },
        ],
        "train_wall_s": train_wall,
        "steps": steps,
        "completions": completions,
        "completions_per_s": completions / train_wall if train_wall else None,
        "eval_wall_s": time.time() - started - train_wall,  # everything but training: start-up included
        "curve": curve,
        "summary": summary,
    }


# --- TRL arm ----------------------------------------------------------------------------------------


@dataclass
class HeldoutEval:
    """Greedy held-out evaluation of an HF model on `trl_dataset` rows, scored by `reward_text`."""

    rows: list[dict[str, Any]]
    tokenizer: Any
    max_new_tokens: int
    batch_size: int

    @torch.no_grad()
    def __call__(self, model: Any) -> dict[str, Any]:
        """Held-out reward of `model`'s current weights (left-padded batches, greedy, eval mode)."""
        from transformers import GenerationConfig

        tok, was_training = self.tokenizer, model.training
        model.eval()
        gen = GenerationConfig(
            do_sample=False,
            max_new_tokens=self.max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        rewards: list[float] = []
        for i in range(0, len(self.rows), self.batch_size):
            rows = self.rows[i : i + self.batch_size]
            texts = [
                tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows
            ]
            enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
            out = model.generate(**enc, generation_config=gen)
            completions = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            rewards += [reward_text(r, c) for r, c in zip(rows, completions, strict=True)]
        model.train(was_training)
        return heldout_stats(rewards)


@dataclass
class TrainClock:
    """Training wall-clock with evaluation left out: `pause()` while evaluating."""

    started: float = field(default_factory=time.monotonic)
    paused_s: float = 0.0

    def elapsed(self) -> float:
        """Seconds of training so far."""
        return time.monotonic() - self.started - self.paused_s

    def timed(self, fn: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], float]:
        """Run `fn` with the clock paused; return its result and how long it took."""
        t0 = time.monotonic()
        result = fn()
        took = time.monotonic() - t0
        self.paused_s += took
        return result, took


def make_budget_callback(
    budget_s: float, clock: TrainClock, evaluate: HeldoutEval, mid_evals: int, rewards: list[float]
) -> Any:
    """A `TrainerCallback` that records the reward curve, evaluates at `mid_evals` evenly spaced points
    of the budget (clock paused) and stops training after the step during which the budget ran out.
    `rewards` receives each generation batch's mean reward from the reward function."""
    from transformers import TrainerCallback

    class BudgetCallback(TrainerCallback):  # type: ignore[misc]
        """Stops `GRPOTrainer` at the wall-clock budget; see `make_budget_callback`."""

        def __init__(self) -> None:
            self.curve: list[dict[str, Any]] = []
            self.heldout: list[dict[str, Any]] = []
            self.eval_s = 0.0
            self._marks = [budget_s * (k + 1) / (mid_evals + 1) for k in range(mid_evals)]

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> Any:
            """Record the step, maybe evaluate, and stop once the budget is spent."""
            train_s = clock.elapsed()
            reward = rewards[-1] if rewards else float("nan")
            self.curve.append({"step": state.global_step, "train_s": train_s, "reward": reward})
            print(f"  trl step {state.global_step}: reward {reward:.3f}  train {train_s:.0f}s", flush=True)
            if train_s >= budget_s:
                control.should_training_stop = True
            elif self._marks and train_s >= self._marks[0] and model is not None:
                while self._marks and train_s >= self._marks[0]:
                    self._marks.pop(0)
                result, took = clock.timed(lambda: evaluate(model))
                self.eval_s += took
                self.heldout.append({"train_s": train_s, "step": state.global_step, **result})
                print(f"  trl held-out at {train_s:.0f}s: {result['mean']:.3f} ({took:.0f}s)", flush=True)
            return control

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> Any:
            """Attach TRL's mean completion length to the step's curve point."""
            if logs and self.curve and "completions/mean_length" in logs:
                self.curve[-1]["mean_length"] = logs["completions/mean_length"]
            return control

    return BudgetCallback()


def trl_reward(rewards: list[float]) -> Callable[..., list[float | None]]:
    """`grpo_reward` over the JSON-encoded `constraints_json` column (an Arrow column of mixed dicts
    would gain None fields); appends each batch's mean to `rewards`."""

    def instruct_constraints(
        completions: list[Any], constraints_json: list[str], **kw: Any
    ) -> list[float | None]:
        values = grpo_reward(completions, [json.loads(c) for c in constraints_json], **kw)
        rewards.append(sum(values) / len(values))
        return [*values]

    return instruct_constraints


def grpo_args(cfg: RunConfig, args: argparse.Namespace, output_dir: Path) -> Any:
    """`GRPOConfig` with the harnessrl config's settings (fields as in TRL 1.16's grpo_config.py)."""
    from trl import GRPOConfig

    t = cfg.train
    per_step = t.batch_groups * t.group_size
    if per_step % args.trl_micro_batch:
        raise SystemExit(
            f"--trl-micro-batch {args.trl_micro_batch} must divide {per_step} completions per step"
        )
    return GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=t.seed,
        # one optimizer step = batch_groups prompts × group_size completions, generated in one batch
        num_generations=t.group_size,
        per_device_train_batch_size=args.trl_micro_batch,
        gradient_accumulation_steps=per_step // args.trl_micro_batch,
        max_completion_length=cfg.gateway.default_max_tokens,
        temperature=t.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=t.lr,
        lr_scheduler_type=t.lr_schedule,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        beta=t.kl_coef,
        num_iterations=t.epochs,
        epsilon=t.clip_low,
        epsilon_high=t.clip_high,
        loss_type=args.trl_loss_type,
        scale_rewards="group",  # GRPO: (r - group mean) / group std, as harnessrl's estimator
        max_steps=100000,  # the budget callback stops it
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        gradient_checkpointing=args.trl_gradient_checkpointing,  # TRL's default is on; harnessrl recomputes nothing
    )


def run_trl(cfg: RunConfig, args: argparse.Namespace) -> dict[str, Any]:
    """`GRPOTrainer` on the instruct train prompts under the budget, with held-out evaluations."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.run_root) / f"seed{cfg.train.seed}" / "trl"
    shutil.rmtree(out_dir, ignore_errors=True)
    model_dir = resolve_model(cfg.engine.model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    heldout_rows = check_same_tasks(cfg, tok)
    train = Dataset.from_list(
        [
            {"prompt": r["prompt"], "constraints_json": json.dumps(r["constraints"]), "task_id": r["task_id"]}
            for r in trl_dataset(cfg.data.n_train, cfg.data.seed, "train")
        ]
    )
    rewards: list[float] = []
    config = grpo_args(cfg, args, out_dir)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_reward(rewards),
        args=config,
        train_dataset=train,
        processing_class=tok,
    )
    evaluate = HeldoutEval(heldout_rows, tok, cfg.gateway.default_max_tokens, args.eval_batch)
    t0 = time.monotonic()
    before = evaluate(trainer.model)
    eval_s = time.monotonic() - t0
    print(f"  trl held-out before: {before['mean']:.3f} ({eval_s:.0f}s)", flush=True)
    clock = TrainClock()
    callback = make_budget_callback(args.budget_s, clock, evaluate, args.mid_evals, rewards)
    trainer.add_callback(callback)
    trainer.remove_callback(PrinterCallback)  # its per-step dict print; the callback prints a line per step
    trainer.train()
    train_wall = clock.elapsed()
    t0 = time.monotonic()
    after = evaluate(trainer.model)
    eval_s += time.monotonic() - t0 + callback.eval_s
    steps = int(trainer.state.global_step)
    completions = steps * cfg.train.batch_groups * cfg.train.group_size
    return {
        "heldout_before": before,
        "heldout_after": after,
        "heldout_curve": [
            {"train_s": 0.0, "step": 0, **before},
            *callback.heldout,
            {"train_s": train_wall, "step": steps, **after},
        ],
        "train_wall_s": train_wall,
        "steps": steps,
        "completions": completions,
        "completions_per_s": completions / train_wall if train_wall else None,
        "eval_wall_s": eval_s,
        "curve": callback.curve,
        "trl_settings": {
            "per_device_train_batch_size": args.trl_micro_batch,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "generation_batch_size": config.generation_batch_size,
            "loss_type": args.trl_loss_type,
            "gradient_checkpointing": args.trl_gradient_checkpointing,
        },
    }


def check_same_tasks(cfg: RunConfig, tok: Any) -> list[dict[str, Any]]:
    """The held-out rows for TRL, checked to be harnessrl's held-out tasks (same prompts, same order)
    and to render to the same prompt text as harnessrl's gateway."""
    rows = trl_dataset(cfg.eval.n_heldout, cfg.data.seed, "heldout")
    _, heldout = build_splits(cfg.data.n_train, cfg.eval.n_heldout, cfg.data.seed)
    if [r["prompt"][0]["content"] for r in rows] != [t.input["prompt"] for t in heldout]:
        raise SystemExit("trl_dataset('heldout') and build_splits disagree: the arms would see other tasks")
    msgs = rows[0]["prompt"]
    if tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) != render_chat(msgs):
        raise SystemExit("the tokenizer's chat template renders differently from harnessrl.chat.render_chat")
    return rows


# --- report -----------------------------------------------------------------------------------------


def plot(result: dict[str, Any], out: Path) -> None:
    """Training reward (batch mean) against training wall-clock for each arm and seed, held-out points
    with 95% intervals on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"harnessrl": "tab:blue", "trl": "tab:orange"}
    markers = "so^Dv"
    for i, (seed, run_) in enumerate(sorted(result["runs"].items())):
        for name, arm in run_["arms"].items():
            c, m = colors.get(name, "tab:gray"), markers[i % len(markers)]
            xs = [p["train_s"] for p in arm["curve"]]
            ax.plot(xs, [p["reward"] for p in arm["curve"]], color=c, alpha=0.35, linewidth=1,
                    label=f"{name}: train reward (batch mean)" if i == 0 else None)  # fmt: skip
            hx = [p["train_s"] for p in arm["heldout_curve"]]
            hy = [p["mean"] for p in arm["heldout_curve"]]
            err = [[y - p["ci95"][0] for y, p in zip(hy, arm["heldout_curve"], strict=True)],
                   [p["ci95"][1] - y for y, p in zip(hy, arm["heldout_curve"], strict=True)]]  # fmt: skip
            ax.errorbar(hx, hy, yerr=err, fmt=m + "--", color=c, capsize=3, markeredgecolor="black",
                        label=f"{name} seed {seed}: held-out greedy, {arm['steps']} steps")  # fmt: skip
    ax.axvline(result["budget_s"], color="gray", linestyle=":", label="time budget")
    ax.set_xlabel("training wall-clock (s, evaluation excluded)")
    ax.set_ylabel("reward (fraction of constraints met)")
    ax.set_ylim(-0.02, 1.02)
    title = (f"instruct, SmolLM2-135M, CPU: harnessrl vs TRL GRPOTrainer ({result['budget_s']:g} s budget, "
             f"held-out n={result['n_heldout']}, 95% CI)")  # fmt: skip
    ax.set_title(title + ("\n" + result["note"] if result.get("note") else ""), fontsize=9)
    ax.legend(loc="lower right", fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def table(result: dict[str, Any]) -> str:
    """The printed comparison: one line per seed and arm, then the means over seeds."""
    head = (f"{'seed':<5} {'arm':<10} {'steps':>5} {'train s':>8} {'compl/s':>8} {'eval s':>7} "
            f"{'held-out before':>22} {'held-out after':>22}")  # fmt: skip
    lines = [head]
    for seed, run_ in sorted(result["runs"].items()):
        for name, a in run_["arms"].items():
            b, f = a["heldout_before"], a["heldout_after"]
            cps = a["completions_per_s"] or 0.0
            lines.append(
                f"{seed:<5} {name:<10} {a['steps']:>5} {a['train_wall_s']:>8.0f} {cps:>8.3f} "
                f"{a['eval_wall_s']:>7.0f} {b['mean']:>8.3f} [{b['ci95'][0]:.2f}, {b['ci95'][1]:.2f}] "
                f"{f['mean']:>8.3f} [{f['ci95'][0]:.2f}, {f['ci95'][1]:.2f}]"
            )
    for name, agg in result["over_seeds"].get("arms", {}).items():
        lines.append(f"mean  {name:<10} held-out after {agg['heldout_after_mean']:.3f} over seeds "
                     f"{agg['seeds']} (per seed {', '.join(f'{v:.3f}' for v in agg['heldout_after'])}); "
                     f"{agg['completions_per_s_mean']:.3f} completions/s")  # fmt: skip
    if (d := result["over_seeds"].get("heldout_after_diff")) is not None:
        lines.append(f"harnessrl - trl, held-out after, paired by seed: mean {d['mean']:+.3f} "
                     f"(per seed {', '.join(f'{v:+.3f}' for v in d['per_seed'])}, SE {d['se']:.3f})")  # fmt: skip
    return "\n".join(lines)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or platform's guess elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def compare(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios harnessrl / TRL, when both arms ran."""
    if not {"harnessrl", "trl"} <= arms.keys():
        return {}
    h, t = arms["harnessrl"], arms["trl"]
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    return {
        "heldout_gain_harnessrl": h["heldout_after"]["mean"] - h["heldout_before"]["mean"],
        "heldout_gain_trl": t["heldout_after"]["mean"] - t["heldout_before"]["mean"],
        "heldout_after_diff": h["heldout_after"]["mean"] - t["heldout_after"]["mean"],
        "completions_per_s_ratio": ratio(h["completions_per_s"], t["completions_per_s"]),
        "steps_ratio": ratio(h["steps"], t["steps"]),
    }


def over_seeds(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per arm: held-out after and completions/s for every seed that ran it, and their means; the
    harnessrl - TRL difference of held-out after, paired by seed, with its standard error."""
    arms: dict[str, Any] = {}
    for name in ARMS:
        done = [(seed, r["arms"][name]) for seed, r in sorted(runs.items()) if name in r["arms"]]
        if not done:
            continue
        after = [a["heldout_after"]["mean"] for _, a in done]
        cps = [a["completions_per_s"] or 0.0 for _, a in done]
        arms[name] = {"seeds": [seed for seed, _ in done], "heldout_after": after,
                      "heldout_after_mean": sum(after) / len(after),
                      "heldout_before": [a["heldout_before"]["mean"] for _, a in done],
                      "steps": [a["steps"] for _, a in done], "completions_per_s_mean": sum(cps) / len(cps)}  # fmt: skip
    out: dict[str, Any] = {"arms": arms}
    diffs = [r["compare"]["heldout_after_diff"] for _, r in sorted(runs.items()) if r.get("compare")]
    if diffs:
        mean = sum(diffs) / len(diffs)
        var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) if len(diffs) > 1 else float("nan")
        out["heldout_after_diff"] = {"mean": mean, "per_seed": diffs, "se": (var / len(diffs)) ** 0.5}
    return out


def load_previous(args: argparse.Namespace, key: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """With --resume: the runs already in --out, refused unless they were made with the same key."""
    path = Path(args.out)
    if not args.resume or not path.exists():
        return {}
    old = json.loads(path.read_text())
    if old.get("key") != key:
        raise SystemExit(f"--resume: {path} was made with {old.get('key')}, not {key}")
    return dict(old.get("runs", {}))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="training wall-clock per arm")
    ap.add_argument("--n-heldout", type=int, default=DEFAULT_N_HELDOUT)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "trl.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "trl_vs_harnessrl.png"))
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of: harnessrl,trl")
    ap.add_argument("--run-root", default="runs/bench-trl")
    ap.add_argument("--mid-evals", type=int, default=2, help="TRL held-out evaluations inside the budget")
    ap.add_argument("--trl-micro-batch", type=int, default=16, help="TRL per_device_train_batch_size")
    ap.add_argument("--trl-loss-type", default="grpo", help="TRL loss_type ('grpo' = harnessrl's loss)")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL's default; off here")
    ap.add_argument("--eval-batch", type=int, default=20, help="TRL held-out generation batch")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of every process of both arms (default: the libraries' own, all cores)")  # fmt: skip
    ap.add_argument("--override", action="append", default=[], help="extra config overrides (a.b=value)")
    ap.add_argument("--note", default=None, help="a note stored in the JSON (default: marks smoke runs)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="train.seed of each pair of runs")
    ap.add_argument("--resume", action="store_true",
                    help="keep the seeds' arms already in --out (made with the same budget, held-out size and overrides)")  # fmt: skip
    args = ap.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if bad := [a for a in args.arms if a not in ARMS]:
        ap.error(f"--arms: unknown {bad}; choose from {', '.join(ARMS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the arms one after the other for every seed, write the JSON (after every arm) and the plot,
    print the table."""
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is local; transformers and TRL load lazily
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    note = args.note
    if note is None and (args.budget_s < DEFAULT_BUDGET_S or args.n_heldout < DEFAULT_N_HELDOUT):
        note = f"SMOKE RUN (budget {args.budget_s:g} s, n_heldout {args.n_heldout}): not the comparison"
    key = {"budget_s": args.budget_s, "n_heldout": args.n_heldout, "overrides": args.override,
           "threads": args.threads}  # fmt: skip
    runs = load_previous(args, key)
    cfg = bench_config(args, args.seeds[0])
    t = cfg.train
    result: dict[str, Any] = {
        "note": note or "",
        "key": key,
        "budget_s": args.budget_s,
        "n_heldout": args.n_heldout,
        "task": "instruct",
        "model": cfg.engine.model,
        "settings": {
            "group_size": t.group_size,
            "batch_groups": t.batch_groups,
            "completions_per_step": t.batch_groups * t.group_size,
            "lr": t.lr,
            "temperature": t.temperature,
            "max_completion_tokens": cfg.gateway.default_max_tokens,
            "eval_temperature": 0.0,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        cfg = bench_config(args, seed)
        run_ = runs.setdefault(str(seed), {"arms": {}})
        for name in args.arms:
            if name in run_["arms"]:
                print(f"== seed {seed} {name}: kept from {out}", flush=True)
                continue
            print(f"== seed {seed} {name} (budget {args.budget_s:g} s)", flush=True)
            load_before = os.getloadavg()
            arm = run_harnessrl(cfg) if name == "harnessrl" else run_trl(cfg, args)
            # a shared machine skews wall-clock: the 1/5/15-minute load averages around the arm say how much
            arm["loadavg"] = {"start": list(load_before), "end": list(os.getloadavg())}
            arm["cpu_model"] = cpu_model()  # sessions land on different CPUs: compare arms within a seed
            run_["arms"][name] = arm
            run_["compare"] = compare(run_["arms"])
            result.update(runs=runs, over_seeds=over_seeds(runs))
            out.write_text(json.dumps(result, indent=2))
    result.update(runs=runs, over_seeds=over_seeds(runs))
    out.write_text(json.dumps(result, indent=2))
    plot(result, Path(args.plot))
    print()
    print(table(result))
    if note:
        print(f"note: {note}")
    print(f"wrote {out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
