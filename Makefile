# The two commands of the README: `make phase1` and `make test`. Both create .venv if missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test phase1 phase2 report lint clean-venv

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c requirements.lock -e '.[pipeline,test]'
	@# PyPI's torchvision/torchaudio/torchcodec do not import beside the CPU torch: never keep them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest

phase1: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --cores 8 phase1

phase2: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --cores 8 phase2

report: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --cores 8 all
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --report report.html all

lint: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --lint

clean-venv:
	rm -rf $(VENV)
