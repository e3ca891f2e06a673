# draftsmith: the two commands a user needs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines get the CPU build of torch (a plain `pip install torch` pulls a CUDA build of several GB);
# machines with nvidia-smi keep whatever CUDA torch the user installed, or take pip's default.
TORCH_CPU ?= torch==2.13.0
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: venv demo test test-loaded test-durations test-fast rehearse test-gpu lint clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet torch; \
	else \
		$(BIN)/pip install --quiet "$(TORCH_CPU)"; \
	fi
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

demo: venv
	$(BIN)/draftsmith demo

# Two workers (one per core of the machines the suite is sized for), each test file on one worker (its module fixtures
# built once), the heaviest files first (tests/conftest.py orders them); the trained session fixtures are built once
# for both (tests/shared_fixtures.py). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python -m pytest tests -m "not gpu and not rehearsal" -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The multi-process tests (marker multiprocess: rank faults, sharded saves, resume on another world size, sequence
# parallelism, the 2-process fits) once more, one at a time, beside one CPU-bound torch process (tests/cpu_load.py):
# CI shares its machine and cluster nodes are busy, and rank 0's death once reached its peer in an order only a busy
# core produced. CI runs it after `make test`.
test-loaded: venv
	DRAFTSMITH_TEST_LOAD=1 $(BIN)/python -m pytest tests -m "multiprocess and not gpu and not rehearsal" -q -p no:cacheprovider \
		--durations 8

# Rewrites tests/durations.json (seconds per test file), which orders the files for the workers; rerun after adding
# or changing a long test.
test-durations: venv
	$(BIN)/python -m pytest tests -m "not gpu and not rehearsal" -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--record-durations

# The real-shape rehearsal of every real-model recipe on CPU (tests/rehearsal/), one case at a time (several GB each;
# cut targets reused from .cache/rehearsal/targets), then its memory table, docs/benchmarks/rehearsal.md.
REHEARSAL_RESULTS ?= .cache/rehearsal/results
rehearse: venv
	rm -rf $(REHEARSAL_RESULTS)
	DRAFTSMITH_REHEARSAL_RESULTS=$(REHEARSAL_RESULTS) $(BIN)/python -m pytest tests/rehearsal -q -p no:cacheprovider; \
	status=$$?; \
	DRAFTSMITH_REHEARSAL_RESULTS=$(REHEARSAL_RESULTS) $(BIN)/python -m tests.rehearsal.table docs/benchmarks/rehearsal.md "make rehearse"; \
	exit $$status

# The GPU suite (tests/gpu, marker gpu; skipped without CUDA): every objective for 20 bf16 steps on a real-shape cut
# target, flex against dense attention, the engine on CUDA, ZeRO-2/3 and FSDP2 with a resume; about 8 minutes on one
# H200. Prints the summary table and writes gpu_results.json (DRAFTSMITH_GPU_RESULTS).
test-gpu: venv
	$(BIN)/python -m pytest tests/gpu -m gpu -q

test-fast: venv
	$(BIN)/python -m pytest tests -m "not gpu and not slow and not slurm" -q

lint: venv
	$(BIN)/ruff check trainer tests bench
	$(BIN)/ruff format --check trainer tests bench
	$(BIN)/lint-imports --no-cache  # the import contracts of pyproject.toml: layers, independent methods, no cycles

clean:
	rm -rf artifacts runs lightning_logs .pytest_cache
