# `make train` and `make test` work on a fresh clone: they create .venv and install into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# `make train` installs what training needs (trainkit, torch and its runtime dependencies);
# `make test`, `make lint` and `make bench` add the dev extra (pytest, ruff and the optional
# integrations the suite covers). pip shows its progress (no --quiet): a first install downloads
# gigabytes.
STAMP := $(VENV)/.installed-train
DEV_STAMP := $(VENV)/.installed-dev
# --no-compile, then COMPILE_SITE: pip byte-compiles what it installs on one core, compileall
# the same files on every core. A file written for a later Python (torch's py312 test helpers)
# does not compile, under pip as here, and is left to fail where it is imported.
PIP := $(PY) -m pip install --progress-bar on --no-compile
SITE = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
COMPILE_SITE = $(PY) -m compileall -q -q -j 0 $(SITE) || true
# pip is asked for these exact releases where they are available (this machine keeps them on
# disk); pyproject.toml itself admits any torch >= 2.11 (FLOOR_TORCH, tested by test-floor).
TORCH_PIN ?= torch==2.14.1 torchvision==0.29.1
# The oldest torch the suite passes on: pyproject.toml's floor. test-floor runs the unit tests
# on it in .venv-floor (torch and torchvision alone, ~0.5 GB of downloads, the CUDA libraries and
# other dependencies shared from .venv: .ci/floor_venv.sh; kept while FLOOR_TORCH is unchanged).
FLOOR_TORCH ?= torch==2.11.0 torchvision==0.26.0
FLOOR_VENV := .venv-floor
# An editable install leaves trainkit's own modules uncompiled, as a wheel's would not be; where
# PYTHONDONTWRITEBYTECODE is set, every run would compile them again (~0.1 s of each start).
COMPILE = $(PY) -m compileall -q trainkit benchmarks

.PHONY: install install-dev train test test-floor lint bench clean

# What training needs: torch, torchvision, then trainkit and its runtime dependencies.
install: $(STAMP)

$(STAMP): pyproject.toml .ci/constraints.txt
	@echo "make: installing into $(VENV) what training needs: torch and torchvision, then" \
	    "trainkit and its runtime dependencies (hydra-core, tensorboard, torchmetrics, psutil," \
	    "tqdm, safetensors); a first install downloads ~1-3 GB (torch's CUDA build on Linux)" \
	    "and takes ~2-6 minutes, a later one seconds"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH_PIN) || $(PIP) torch torchvision
	$(PIP) -c .ci/constraints.txt -e .
	$(COMPILE_SITE)
	$(COMPILE)
	touch $(STAMP)

# The dev extra on top: what `make test` needs (pyproject.toml lists it).
install-dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP)
	@echo "make: adding the dev extra to $(VENV): pytest, ruff and the optional integrations" \
	    "the tests cover (mlflow, wandb, transformers, peft, datasets, webdataset, s3fs, moto," \
	    "optuna, submitit, timm, scikit-image, Jupyter); a first install downloads ~2-4 GB" \
	    "and takes ~5-12 minutes, a later one seconds"
	$(PIP) -c .ci/constraints.txt -e '.[dev]'
	$(COMPILE_SITE)
	$(COMPILE)
	touch $(DEV_STAMP)

train: install
	$(PY) -m trainkit.train +exp=mnist $(ARGS)

# Most tests wait on processes they start (a Python, torch and torchvision start is ~5 s of one
# core), so two pytest workers share a 2-core machine well. Each worker, and each process its
# tests start, gets one intra-op thread (PARALLEL_ENV): with torch's default of a thread per core,
# the two workers' training processes spin-wait on each other's threads, which made a 188-step
# MNIST run cost ~60 CPU s instead of ~3 on this 2-core machine (thread counts are the same
# within a test, so what a test compares is unchanged). `--dist loadfile` gives each test file to
# one worker: a module's shared runs (its module-scoped fixtures: trained runs, torchrun jobs) are
# made once, where the default scheduling split 12 of 48 files across both workers, and each
# worker then made that file's runs again. The tests marked serial measure time (data waits,
# throughput, hang timeouts) and run alone after the rest, with torch's defaults.
# Exit 5 is "no test selected" (a PYTEST_ARGS that picks tests of one kind only).
WORKERS ?= 2
PARALLEL_ENV ?= OMP_NUM_THREADS=1
test: install-dev
	$(PY) -m ruff check .
	$(PARALLEL_ENV) $(PY) -m pytest -n $(WORKERS) -m "not serial" --dist loadfile $(PYTEST_ARGS); \
	rest=$$?; \
	$(PY) -m pytest -m serial $(PYTEST_ARGS); serial=$$?; \
	for status in $$rest $$serial; do [ $$status = 0 ] || [ $$status = 5 ] || exit $$status; done
	$(MAKE) test-floor

# The unit tests (not the timing ones) on pyproject.toml's torch floor.
test-floor: install-dev
	.ci/floor_venv.sh $(PYTHON) $(PY) $(FLOOR_VENV) "$(FLOOR_TORCH)"
	$(FLOOR_VENV)/bin/python -c "import torch; print('unit tests on torch', torch.__version__)"
	$(PARALLEL_ENV) $(FLOOR_VENV)/bin/python -m pytest tests/unit -q -n $(WORKERS) -m "not serial" \
	    --dist loadfile $(PYTEST_ARGS)

lint: install-dev
	$(PY) -m ruff check .

# Installs the optional Lightning comparison first; writes benchmarks/results.json.
bench: install-dev
	$(PIP) -e '.[bench]'
	$(COMPILE_SITE)
	$(COMPILE)
	$(PY) -m benchmarks $(ARGS)

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache .ruff_cache
