#!/usr/bin/env bash
# GPU smoke test: the whole loop (calc example: harness subprocesses -> gateway -> vLLM, grading,
# PPO update, weights pushed back into vLLM) with vLLM serving SmolLM2-135M-Instruct on one GPU.
# Target: under 10 minutes on one GPU. It cannot run on the CPU machines CI uses.
#
#   bash bench/gpu_smoke.sh                 # installs vLLM into .bench/venv-vllm on first use
#   VLLM_BIN=/path/to/vllm bash bench/gpu_smoke.sh   # or use an existing vLLM (>= 0.19: disk weight transfer)
#
# What it checks: the run finishes, every training call was recorded with token IDs and logprobs, and
# vLLM served the new weights (weight loads through /pause, /update_weights, /reset_prefix_cache,
# /resume). The trainer runs on the same GPU (train.device=cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
make -s .venv/.installed >/dev/null 2>&1 || make install
PORT=${VLLM_PORT:-8300}
RUN_DIR=${RUN_DIR:-runs/gpu-smoke}
MODEL_DIR=$(.venv/bin/python -c 'from harnessrl.modeling.loading import resolve_model; print(resolve_model("smollm2"))')
if [ -z "${VLLM_BIN:-}" ]; then
  if [ ! -x .bench/venv-vllm/bin/vllm ]; then
    python3 -m venv .bench/venv-vllm
    .bench/venv-vllm/bin/pip install -q "vllm>=0.19"
  fi
  VLLM_BIN=.bench/venv-vllm/bin/vllm
fi
LOG=$(mktemp -t vllm-XXXX.log)
VLLM_SERVER_DEV_MODE=1 "$VLLM_BIN" serve "$MODEL_DIR" --port "$PORT" --served-model-name smollm2 \
  --max-model-len 2048 --gpu-memory-utilization 0.3 --enable-sleep-mode \
  --weight-transfer-config '{"backend": "disk"}' >"$LOG" 2>&1 &
VLLM_PID=$!
trap 'kill $VLLM_PID 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
  kill -0 $VLLM_PID 2>/dev/null || { echo "vLLM exited; log: $LOG" >&2; tail -50 "$LOG" >&2; exit 1; }
  sleep 1
done
start=$(date +%s)
HF_HUB_OFFLINE=1 .venv/bin/harnessrl train --config src/harnessrl/examples/calc/config.yaml --fresh \
  run_dir="$RUN_DIR" engine.kind=vllm engine.url="http://127.0.0.1:$PORT" train.device=cuda \
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
