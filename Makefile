# hilo: `make train` (set up, then a tiny pretraining run) and `make test` (set up, then the test suite).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
ARGS   ?=
DECODE_ARGS ?=

.PHONY: setup train test eval bench lint clean

setup: $(VENV)/.hilo-installed

# torch first: on a machine without an NVIDIA GPU take the CPU build (a local wheel when pip's find-links offer
# one, else PyPI's CPU index of PyTorch) so the multi-GB CUDA build is never pulled; later installs keep it.
$(VENV)/.hilo-installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(PIP) install "torch>=2.4"; \
	elif $(PIP) install -q --no-index --no-deps --only-binary=:all: "torch>=2.4" 2>/dev/null \
	     && $(PIP) show torch 2>/dev/null | grep -q '^Version: .*+cpu'; then \
	  version=$$($(PIP) show torch | sed -n 's/^Version: //p'); \
	  echo "torch $$version (CPU build) from a local wheel; now its dependencies"; \
	  $(PIP) install "torch==$$version"; \
	else \
	  $(PIP) uninstall -q -y torch 2>/dev/null; \
	  $(PIP) install --retries 1 --index-url https://download.pytorch.org/whl/cpu "torch>=2.4" \
	  || { echo "could not install torch's CPU build from download.pytorch.org; install torch yourself into" \
	       "$(VENV) (pip install torch --index-url <a CPU wheel index>) and run make again"; exit 1; }; \
	fi
	$(PIP) install -e ".[test]"
	touch $@

train: setup
	$(PY) train.py $(ARGS)

# Two pytest workers, one torch thread each (tests/conftest.py), stealing tests from each other as they finish: on a
# 2-core CPU machine 501 s, against 557 s with each worker taking whole files (--dist loadfile: the worker left with
# the slow files finishes last). PYTEST_WORKERS=0 runs it serially.
PYTEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest tests $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist worksteal) $(ARGS)

# make eval RUN=runs/<name> [ARGS="eval.seq_len=4096"]
eval: setup
	$(PY) eval.py checkpoint=$(RUN) $(ARGS)

# make bench [ARGS="<train_throughput.py args>"] [DECODE_ARGS="<decode.py args>"]: training throughput (the
# script's defaults: every family, 340m, T = 2048/8192/16384, 32768 tokens per step, step-time breakdown; tiny on
# CPU), then decoding latency and state memory against context (decode.py: 340m, 1K..32K, every family on CUDA;
# tiny on CPU)
bench: setup
	$(PY) benchmarks/train_throughput.py $(ARGS)
	$(PY) benchmarks/decode.py $(DECODE_ARGS)
	$(PY) benchmarks/hla_numerics.py
	@if $(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
	  $(PY) benchmarks/peers.py; else echo "benchmarks/peers.py skipped: it needs a CUDA GPU"; fi

# ruff is pinned (as in pyproject's dev extra): a new release adds rules; bump it together with their fixes
lint: setup
	$(PIP) install -q ruff==0.17.6
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
