# Two commands on a fresh clone: `make demo` and `make test`. Each creates .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stageplan-installed

.PHONY: demo test test-all lint bench bench-large figures notebooks jupyter clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test,hf]'
	touch $(STAMP)

demo: $(STAMP)
	PYTHONUNBUFFERED=1 $(PY) benchmarks/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check stageplan tests benchmarks
	$(VENV)/bin/mypy

# Two tiers (tests/unit: one file per module, in this process; tests/integration: ranks, torchrun, fresh
# interpreters, marked slow) and a timing marker for assertions on millisecond windows or speed ratios, which
# hold only on a quiet machine. `make test` is the fast tier on two workers that steal tests from each other
# (worksteal: 155 s, where one worker per module took 173 s on a 2-core host); `make test-all` runs everything,
# the timing tests last and alone. Each pytest call below collects tests (exit 5, "no tests", would fail).
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

test: lint
	$(PYTEST) -n 2 --dist worksteal tests/unit -m "not slow and not timing"

test-all: lint
	$(PYTEST) -n 2 --dist worksteal tests/unit -m "not slow and not timing"
	$(PYTEST) tests/integration -m "not timing"
	$(PYTEST) tests -m timing

bench: $(STAMP)
	PYTHONUNBUFFERED=1 $(PY) benchmarks/run_all.py

# Models bigger than the machine (minutes each): a 4-rank run's memory against one model's, LLaMA-2-7B profiled
# layer at a time here, LLaMA-2-70B estimated for an H100.
bench-large: $(STAMP)
	PYTHONUNBUFFERED=1 $(PY) benchmarks/bench_memory.py
	PYTHONUNBUFFERED=1 $(PY) benchmarks/bench_large.py

figures: $(STAMP)
	$(PY) benchmarks/figures.py

notebooks: $(STAMP)
	$(PY) benchmarks/build_notebooks.py

jupyter: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[notebooks]'
	$(VENV)/bin/jupyter lab notebooks/

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
