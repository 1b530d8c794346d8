#!/usr/bin/env bash
# Install the pinned real harnesses into .bench/harnesses/ (gitignored), each only once:
#   npm: @anthropic-ai/claude-code, @openai/codex, opencode-ai (node >= 20 on PATH)
#   PyPI: openhands-sdk + openhands-tools (Python >= 3.12, own venv), mini-swe-agent (own venv)
# OpenHands needs Python >= 3.12. Where none is on PATH (Debian 12 ships 3.11), CPython 3.13 is built
# once from Debian's signature-checked source package (apt-get source, a private apt state: the
# system's apt configuration is left alone). About 1.2 GB of npm binaries; first run ~10 minutes.
# `setup.sh opencode`: only OpenCode (npm opencode-ai, ~190 MB; for the opencode_calc example).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=.bench/harnesses
CLAUDE_CODE=2.1.332
CODEX=0.171.0
OPENCODE=1.18.33
OPENHANDS=1.58.2
MINI_SWE_AGENT=2.4.6
PY313=3.13.5
mkdir -p "$ROOT"
log() { echo "setup-harnesses: $*"; }

npm_ok() {
  [ -x "$ROOT/npm/node_modules/.bin/claude" ] && [ -x "$ROOT/npm/node_modules/.bin/codex" ] \
    && [ -x "$ROOT/npm/node_modules/.bin/opencode" ] \
    && [ "$("$ROOT/npm/node_modules/.bin/claude" --version 2>/dev/null | cut -d' ' -f1)" = "$CLAUDE_CODE" ] \
    && [ "$("$ROOT/npm/node_modules/.bin/codex" --version 2>/dev/null)" = "codex-cli $CODEX" ] \
    && [ "$("$ROOT/npm/node_modules/.bin/opencode" --version 2>/dev/null)" = "$OPENCODE" ]
}
if [ "${1:-}" = "opencode" ]; then  # only OpenCode (the opencode_calc example needs nothing else)
  bin="$ROOT/npm/node_modules/.bin/opencode"
  if [ -x "$bin" ] && [ "$("$bin" --version 2>/dev/null)" = "$OPENCODE" ]; then
    log "opencode $OPENCODE present"
  else
    log "npm install opencode-ai@$OPENCODE"
    mkdir -p "$ROOT/npm"
    [ -f "$ROOT/npm/package.json" ] || echo '{"name": "harnessrl-bench-harnesses", "private": true}' > "$ROOT/npm/package.json"
    (cd "$ROOT/npm" && npm install --no-audit --no-fund --save-exact "opencode-ai@$OPENCODE")
    [ "$("$bin" --version 2>/dev/null)" = "$OPENCODE" ] \
      || { echo "setup-harnesses: opencode does not report version $OPENCODE" >&2; exit 1; }
  fi
  exit 0
fi
if npm_ok; then
  log "npm harnesses present"
else
  log "npm install claude-code@$CLAUDE_CODE codex@$CODEX opencode-ai@$OPENCODE"
  mkdir -p "$ROOT/npm"
  echo '{"name": "harnessrl-bench-harnesses", "private": true}' > "$ROOT/npm/package.json"
  (cd "$ROOT/npm" && npm install --no-audit --no-fund --save-exact \
    "@anthropic-ai/claude-code@$CLAUDE_CODE" "@openai/codex@$CODEX" "opencode-ai@$OPENCODE")
  npm_ok || { echo "setup-harnesses: the npm harnesses do not report the pinned versions" >&2; exit 1; }
fi

python312() {  # a Python >= 3.12 interpreter: on PATH, or built here before
  for p in "$ROOT/python/bin/python3.13" python3.13 python3.12 python3.14; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import ssl, sqlite3, ctypes, sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$p"; return 0
    fi
  done
  return 1
}
if ! python312 >/dev/null; then
  log "no Python >= 3.12 on PATH: building CPython $PY313 from Debian's source package (once, ~8 min)"
  APT="$ROOT/apt"
  mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$ROOT/src"
  echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" > "$APT/sources.list"
  APTOPTS=(-o "Dir::Etc::SourceList=$PWD/$APT/sources.list" -o Dir::Etc::SourceParts=/dev/null
           -o "Dir::State::Lists=$PWD/$APT/lists" -o "Dir::Cache=$PWD/$APT/cache")
  apt-get "${APTOPTS[@]}" update
  (cd "$ROOT/src" && apt-get "${APTOPTS[@]}" source --download-only "python3.13=$PY313-*" 2>/dev/null \
     || apt-get "${APTOPTS[@]}" source --download-only python3.13)
  tarball=$(ls "$ROOT"/src/python3.13_*.orig.tar.xz | head -1)
  rm -rf "$ROOT/src/build" && mkdir -p "$ROOT/src/build"
  tar -xJf "$tarball" -C "$ROOT/src/build" --strip-components=1
  prefix="$PWD/$ROOT/python"
  (cd "$ROOT/src/build" && ./configure --prefix="$prefix" --without-ensurepip --disable-test-modules >/dev/null \
     && nice -n 10 make -j"$(nproc)" >/dev/null && make install >/dev/null)
  "$prefix/bin/python3.13" -m ensurepip >/dev/null
  rm -rf "$ROOT/src/build"
fi
PY312=$(python312)

venv() {  # venv NAME PYTHON PIP-ARGS...: create and install once (a stamp names what is installed)
  local name=$1 py=$2; shift 2
  local stamp="$ROOT/$name/.installed-$(echo "$*" | tr ' =' '_-')"
  if [ -f "$stamp" ]; then log "$name present"; return; fi
  log "$name: pip install $*"
  rm -rf "${ROOT:?}/$name"
  "$py" -m venv "$ROOT/$name"
  "$ROOT/$name/bin/pip" install -q --upgrade pip
  "$ROOT/$name/bin/pip" install -q "$@"
  touch "$stamp"
}
venv venv-openhands "$PY312" "openhands-sdk==$OPENHANDS" "openhands-tools==$OPENHANDS"
venv venv-mini python3 "mini-swe-agent==$MINI_SWE_AGENT"
log "done"
