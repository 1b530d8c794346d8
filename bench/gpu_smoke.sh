#!/usr/bin/env bash
# GPU smoke test: the whole loop (calc example: harness subprocesses -> gateway -> vLLM, grading,
# PPO update, weights pushed back into vLLM) with vLLM serving SmolLM2-135M-Instruct on one GPU.
# Target: under 10 minutes on one GPU. It cannot run on the CPU machines CI uses.
#
#   bash bench/gpu_smoke.sh                 # installs CUDA vLLM into .bench/venv-vllm-gpu on first use
#   VLLM_PYTHON=/path/to/python bash bench/gpu_smoke.sh   # or a Python that has vLLM (>= 0.32)
#
# What it checks: the run finishes, every training call was recorded with token IDs and logprobs, and
# vLLM served the new weights. vLLM is the run's own (engine.kind=vllm without engine.url, as on CPU:
# docs/vllm.md), on the GPU (engine.device=cuda); weight syncs go through /pause, /collective_rpc
# reload_weights, /reset_prefix_cache, /update_weight_version, /resume. The trainer runs on the same
# GPU (train.device=cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
make -s .venv/.installed >/dev/null 2>&1 || make install
RUN_DIR=${RUN_DIR:-runs/gpu-smoke}
if [ -z "${VLLM_PYTHON:-}" ]; then
  if [ ! -x .bench/venv-vllm-gpu/bin/python ]; then
    python3 -m venv .bench/venv-vllm-gpu
    .bench/venv-vllm-gpu/bin/pip install -q "vllm>=0.32"
  fi
  VLLM_PYTHON=.bench/venv-vllm-gpu/bin/python
fi
start=$(date +%s)
HF_HUB_OFFLINE=1 .venv/bin/harnessrl train --config src/harnessrl/examples/calc/config.yaml --fresh \
  run_dir="$RUN_DIR" engine.kind=vllm engine.vllm_python="$VLLM_PYTHON" engine.device=cuda train.device=cuda \
  'engine.vllm_args=["--gpu-memory-utilization","0.3"]' \
  train.steps=3 eval.n_heldout=32 eval.extra_temperatures=[] controller.concurrency=32
echo "gpu smoke: whole loop in $(( $(date +%s) - start )) s; summary: $RUN_DIR/summary.json"
.venv/bin/python - "$RUN_DIR" <<'PY'
import json, sqlite3, sys
run = sys.argv[1]
summary = json.load(open(f"{run}/summary.json"))
db = sqlite3.connect(f"{run}/store.sqlite")
n, = db.execute("SELECT count(*) FROM calls").fetchone()
assert n > 0, "no calls recorded"
print(f"calls recorded: {n}; steps: {summary.get('steps')}; held-out before/after: "
      f"{summary.get('eval_before')} -> {summary.get('eval_after')}")
PY
