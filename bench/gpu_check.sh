#!/usr/bin/env bash
# GPU checks of the builtin engine and the collocated loop, in one short run (about 5 minutes on one
# GPU). Results go to $OUT (default bench/results/gpu): gpu_check.json (exactness per dtype, engine sleep
# memory), engine_gpu_fp32.json / engine_gpu_bf16.json (bench/engine.py on the GPU against transformers
# generate on the same GPU), loop_summary.json + loop_metrics.jsonl (the $LOOP_EXAMPLE loop with engine and
# trainer on the GPU, the engine asleep at level 2 during each update), fsdp_2gpu.txt (with 2+ GPUs: one
# 2-rank FSDP update over NCCL against one process, bench/torchrun_update.py), and log.txt.
#
#   bash bench/gpu_check.sh                       # with the project installed (make install) and a GPU
#   MODEL_CONFIG=DIR bash bench/gpu_check.sh      # random weights with DIR's config.json + tokenizer
#                                                 # (where the real weights cannot be brought)
# Every stage runs even if an earlier one failed; the exit code is the number of failed stages.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
WORK=${WORK:-/tmp/harnessrl-gpu}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}  # cpu: a dry run of the script itself
LEVELS=${LEVELS:-1 4 16 64 256}
STAGES=${STAGES:-checks engine loop fsdp}
LOOP_EXAMPLE=${LOOP_EXAMPLE:-search}  # needs only the project's own deps (calc needs reasoning-gym)
mkdir -p "$OUT" "$WORK"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec > >(tee -a "$OUT/log.txt") 2>&1
failed=0
stage() {  # stage NAME CMD...: run, time and report one stage
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name"
  "$@"; local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || failed=$((failed + 1))
}
nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

on() { [[ " $STAGES " == *" $1 "* ]]; }
if [ -n "${MODEL_CONFIG:-}" ]; then
  MODEL=$WORK/model
  on checks || $PY bench/gpu_check.py --make-model "$MODEL_CONFIG" --model-dir "$MODEL" --dtypes  # model only
  on checks && stage checks $PY bench/gpu_check.py --make-model "$MODEL_CONFIG" --model-dir "$MODEL" --device "$DEVICE" \
    --out "$OUT/gpu_check.json"
else
  MODEL=$($PY -c 'from harnessrl.modeling.loading import resolve_model; print(resolve_model("smollm2"))')
  on checks && stage checks $PY bench/gpu_check.py --model-dir "$MODEL" --device "$DEVICE" --out "$OUT/gpu_check.json"
fi
on engine && for dt in float32 bfloat16; do
  tag=$([ $dt = float32 ] && echo fp32 || echo bf16)
  stage "engine-$tag" $PY bench/engine.py --model "$MODEL" --device "$DEVICE" --dtype $dt \
    --concurrency $LEVELS --max-model-len 512 --out "$OUT/engine_gpu_$tag.json"
done
loop() {
  $PY -c "import openai" || return 1  # the harnesses need it: fail loudly, not as rollouts without calls
  $PY -c 'from harnessrl.cli import main; main()' train --config "src/harnessrl/examples/$LOOP_EXAMPLE/config.yaml" \
    --fresh run_dir="$WORK/loop" engine.model="$MODEL" engine.device="$DEVICE" train.device="$DEVICE" \
    train.engine_sleep_level=2 train.steps=3 train.batch_groups=4 train.group_size=4 \
    controller.concurrency=16 eval.n_heldout=16 eval.extra_temperatures=[] gateway.default_max_tokens=64 \
    && cp "$WORK/loop/summary.json" "$OUT/loop_summary.json" && cp "$WORK/loop/metrics.jsonl" "$OUT/loop_metrics.jsonl"
  local rc=$?
  tail -3 "$WORK"/loop/rollouts/*/attempt-0/stderr.txt 2>/dev/null | tail -8
  grep -h "event=engine_sleep\|event=engine_wake\|weights_swapped" "$WORK"/loop/logs/engine*.log | tail -6
  return $rc
}
on loop && stage loop loop
fsdp() {  # 2 ranks, one GPU each (NCCL, bf16 compute): one sharded update against one process
  local n
  n=$($PY -c "import torch; print(torch.cuda.device_count())")
  if [ "$n" -lt 2 ]; then echo "skipped: $n GPU(s); the 2-rank FSDP step needs 2"; return 0; fi
  $PY -m torch.distributed.run --standalone --nproc-per-node 2 bench/torchrun_update.py --model-dir "$MODEL" \
    --device cuda --tol 1e-2 | tee "$OUT/fsdp_2gpu.txt"
}
on fsdp && stage fsdp fsdp
echo "failed stages: $failed"
exit $failed
