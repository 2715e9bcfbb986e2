# Set-up and entry points. Every target installs what it needs into .venv first (idempotent).
#   make run     default experiment on the embedded SmolLM2-135M (CPU, <= 5 min on 2 cores)
#   make test    the test suite (what CI runs)
#   make bench   specdec vs HF transformers, plain decoding on CPU (benchmarks/bench_generate.py)
#   make gpu-check  GPU tests + every GPU benchmark in one call (benchmarks/gpu_check.sh)
#   make head    retrain the SmolLM2 draft head (<= 30 min on 2 cores)
#   make replies regenerate the store of SmolLM2's own replies that draft=replies drafts from (20 min)
#   make qwen-replies  the same for Qwen2.5-Coder: its own completions of code (30 min)
# GPU machines: make TORCH_SPEC=torch TORCH_INDEX=https://download.pytorch.org/whl/cu128 run
# (any CUDA build of torch >= 2.4 works; triton comes with it).

PYTHON ?= python3
VENV ?= .venv
# CPU build by default: keeps CPU machines lean (a plain `torch` resolves to a multi-GB CUDA build)
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= test,launchers,dev,cpu-ort
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast lint bench gpu-check gpu-wheels gpu-model-parts head replies qwen-replies clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m experiments.run $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check specdec experiments benchmarks tests
	$(PY) -m ruff format --check specdec experiments benchmarks tests

bench: $(STAMP)
	$(PY) -m benchmarks.bench_generate $(ARGS)

# retrain the draft head for the embedded SmolLM2 (<= 30 min on 2 cores; the shipped one is in
# specdec/decode/heads/smollm2-135m); use it with --draft head:$(HEAD_OUT) or draft.path=...
HEAD_OUT ?= outputs/heads/smollm2-135m
head: $(STAMP)
	$(PY) -m specdec.train_head --model smollm2-135m --out $(HEAD_OUT) --minutes 28 --threads 2 --seed 0 --dtype auto --train-dtype auto --data-share 0.6 --vocab-top 4096

# regenerate the store of the embedded SmolLM2's own greedy replies (20 min on 2 cores; the
# shipped one is in specdec/decode/stores/smollm2-135m-replies); use it with draft=replies
# draft.path=$(REPLIES_OUT) or --draft datastore:$(REPLIES_OUT)
REPLIES_OUT ?= outputs/stores/smollm2-135m-replies
replies: $(STAMP)
	$(PY) -m specdec.build_datastore --model smollm2-135m --corpus replies --minutes 20 --threads 2 --seed 0 --out $(REPLIES_OUT)

# the store of Qwen2.5-Coder-0.5B's own plain-text completions of documented Python functions
# (HumanEval's style; 30 min on 2 cores; shipped in specdec/decode/stores/qwen25-coder-05b-replies)
QWEN_REPLIES_OUT ?= outputs/stores/qwen25-coder-05b-replies
qwen-replies: $(STAMP)
	$(PY) -m specdec.build_datastore --model qwen2.5-coder-0.5b --corpus replies --requests code --minutes 30 --replies 4000 --batch 32 --threads 2 --seed 0 --out $(QWEN_REPLIES_OUT)

gpu-check:
	bash benchmarks/gpu_check.sh

# wheels of the pure-Python dependencies a GPU image without network may lack, for
# `WHEELS=.whl bash benchmarks/gpu_check.sh` there (antlr4's runtime is an sdist: built here)
gpu-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform any -d .whl gguf==0.19.0 omegaconf==2.3.1 hydra-core==1.3.8 \
	  accelerate==1.16.0
	$(PY) -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3

# the embedded model for a GPU machine without network whose runner carries at most 64 MiB a
# call: two parts of .gpucache/ (carry one per call on a warm machine, `cat` them into
# $$SPECDEC_CACHE/smollm2-135m/ there; docs/gpu.md)
gpu-model-parts: $(STAMP)
	rm -rf .gpucache && mkdir -p .gpucache
	split -n 2 -d "$$($(PY) -c 'from specdec.models.registry import fetch_embedded; print(fetch_embedded("smollm2-135m"))')" .gpucache/smollm2-135m.part-
	ls -l .gpucache

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
