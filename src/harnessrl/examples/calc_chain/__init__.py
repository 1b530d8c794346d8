"""`calc_chain`: the calc harness on a running total, 1 to 10 steps per task, each step a fresh
conversation with the calculator tool (about two calls a step) — rollouts of 2 to 20 calls, the
workload of the ablation benchmark (`bench/train_ablation.py --example calc_chain`)."""

from __future__ import annotations
