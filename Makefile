# Two commands on a fresh machine:
#   make demo   - install, calibrate SmolLM2-135M (from PyPI), generate with OscarCache, compare with BF16
#   make test   - install, run the test-suite
#   make check-newest-transformers - the repository-root smoke test on transformers' newest release (CI runs it)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch: a plain `torch` would pull several GB of CUDA packages. Override on a GPU machine.
TORCH ?= torch==2.13.0

$(VENV)/.installed: setup.py setup.cfg constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile "$(TORCH)"  # (no bytecode up front: Python compiles what it imports)
	$(BIN)/pip install -q --no-compile -c constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/oscar-hf demo

# One worker per core (CI has 2), each test file on one worker (a file's fixtures, such as the calibrated SmolLM2,
# are built once), files handed out in collection order (tests/conftest.py puts the ones that take minutes first).
test: install
	$(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# Re-executes the quickstart notebook and stores its outputs (what a reader on GitHub sees), on one thread as each of
# `make test`'s two workers runs it (the calibration's float sums, hence its last bits, follow the thread count).
notebook: install
	OMP_NUM_THREADS=1 OSCAR_HF_UPDATE_NOTEBOOK=1 $(BIN)/pytest -q tests/test_notebook.py

# transformers' newest release (setup.cfg allows < 6, so a plain `pip install` gets it; constraints.txt pins the one
# the suite runs on) with the dependencies it needs beyond the venv's (resolved by pip against the venv, e.g.
# Hugging Face's `kernels`), in a throwaway folder put on PYTHONPATH; then tests/test_repo_root.py from the repository
# root, whose folder kernels/ shares its import name with that package. The venv is left as it is. CI fetches while
# the suite runs (fetch-newest-transformers, mostly waiting on the network), then runs smoke-newest-transformers.
NEWEST := .cache/transformers-newest
check-newest-transformers: fetch-newest-transformers
	$(MAKE) smoke-newest-transformers

fetch-newest-transformers: install
	rm -rf $(NEWEST) && mkdir -p $(NEWEST)
	$(BIN)/pip install -q --dry-run --upgrade --report $(NEWEST)/report.json "transformers<6"
	$(BIN)/python -c "import json, sys; items = json.load(open(sys.argv[1]))['install']; \
	print('\n'.join(i['metadata']['name'] + '==' + i['metadata']['version'] for i in items))" \
	    $(NEWEST)/report.json > $(NEWEST)/requirements.txt
	! grep -qi '^torch==' $(NEWEST)/requirements.txt  # the CPU torch of the venv stays
	$(BIN)/pip install -q --no-compile --no-deps --target $(NEWEST)/site -r $(NEWEST)/requirements.txt
	cat $(NEWEST)/requirements.txt

smoke-newest-transformers:
	@test -d $(NEWEST)/site || { echo "$(NEWEST)/site is missing: run make fetch-newest-transformers first"; exit 1; }
	PYTHONPATH=$(NEWEST)/site OSCAR_HF_EXPECT_TRANSFORMERS=$$(grep -i '^transformers==' $(NEWEST)/requirements.txt | cut -d= -f3) \
	    $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_repo_root.py

.PHONY: install demo test notebook check-newest-transformers fetch-newest-transformers smoke-newest-transformers
