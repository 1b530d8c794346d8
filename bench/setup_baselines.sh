#!/usr/bin/env bash
# Virtual environments for the gateway baselines, kept apart from harnessrl's own .venv:
#   .bench/venv-al       agentlightning==1.0.2 (needs Python >= 3.12: found via PY312 or pyenv)
#   .bench/venv-litellm  litellm and the proxy's dependencies (litellm[proxy] does not resolve here)
# and wrk (Debian package) for load.
# and, for the engine benchmark, .bench/venv-llamacpp (llama-cpp-python[server], built from source).
# Usage: bash bench/setup_baselines.sh [gateway] [llamacpp]   (default: gateway)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .bench
WANT=" ${*:-gateway} "
if [[ "$WANT" == *" gateway "* ]]; then
# A candidate counts only if it runs: under pyenv, `python3.12` on PATH can be a shim that fails when
# 3.12 is installed but not the active version (exit 127); the version's own binary then works.
working_py312() {
  for c in "${PY312:-}" "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 \
           /usr/bin/python3.1[2-9] /usr/local/bin/python3.1[2-9]; do
    [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo "$c"; return; }
  done
}
PY312=$(working_py312)
if [ ! -x .bench/venv-al/bin/python ]; then
  if [ -z "$PY312" ]; then echo "need Python >= 3.12 for agentlightning (set PY312)" >&2; exit 2; fi
  "$PY312" -m venv .bench/venv-al
  .bench/venv-al/bin/pip install -q agentlightning==1.0.2
fi
if [ ! -x .bench/venv-litellm/bin/litellm ]; then
  python3 -m venv .bench/venv-litellm
  .bench/venv-litellm/bin/pip install -q litellm gunicorn uvicorn uvloop fastapi starlette backoff rq granian \
    orjson apscheduler cryptography python-multipart email-validator PyJWT websockets semver Expression fastapi-sso mcp soundfile
fi
command -v wrk >/dev/null || { echo "installing wrk (Debian package)"; apt-get install -y wrk >/dev/null; }
fi
# The engine baseline: llama-cpp-python's OpenAI server (built from source, ~6-10 minutes on 2 cores).
if [[ "$WANT" == *" llamacpp "* ]] && [ ! -x .bench/venv-llamacpp/bin/python ]; then
  rm -rf .bench/venv-llamacpp.tmp && python3 -m venv .bench/venv-llamacpp.tmp
  # -march=native turns on ggml's AMX path on CPUs that advertise AMX; under this VM it dies with
  # SIGILL at the first decode, so build for AVX-512 (+VNNI/BF16) explicitly, without AMX.
  CMAKE_ARGS="${LLAMACPP_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}" \
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    .bench/venv-llamacpp.tmp/bin/pip install -q --no-cache-dir "llama-cpp-python[server]"
  mv .bench/venv-llamacpp.tmp .bench/venv-llamacpp
fi
