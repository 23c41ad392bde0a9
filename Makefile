# Two commands on a fresh machine:  make serve   |   make test
# (each creates .venv/ first if needed, via scripts/install.sh)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: serve test test-fast lint install bench check-wheel
serve: $(STAMP)
	$(VENV)/bin/pagedserve serve $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy api scheduler engine benchmarks tests

check-wheel: $(STAMP)
	bash scripts/check_wheel.sh

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not slow" $(ARGS)

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $(STAMP)
