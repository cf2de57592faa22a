# kvtier: `make demo` serves the built-in demo model with the tiered cache and sends it a
# request; `make test` runs every check CI runs. Both create .venv and install what they need.

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.kvtier-installed

.PHONY: setup demo serve test lint unit e2e bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[vllm,dev,bench]'
	# PyPI's torchvision breaks `import transformers` next to the CPU torch build.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/kvtier serve --demo-request

serve: setup
	$(VENV)/bin/kvtier serve

lint: setup
	$(VENV)/bin/ruff check kvtier tests
	$(VENV)/bin/mypy

unit: setup
	$(VENV)/bin/pytest -q -m "not vllm"

e2e: setup
	$(VENV)/bin/pytest -q -m vllm

test: lint
	$(VENV)/bin/pytest -q

bench: setup
	$(VENV)/bin/kvtier bench micro

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
