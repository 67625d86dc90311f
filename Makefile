# One place for the commands a user and CI run. `make serve` sets up and serves; `make test` tests.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1

.PHONY: setup serve test bench protos clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) ./scripts/setup.sh
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/kvcascade serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m protos.generate --check
	$(BIN)/python -m pytest -q $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/ablation.py $(ARGS)

protos: $(STAMP)
	$(BIN)/python -m protos.generate

clean:
	rm -rf $(VENV)
