# Two commands a fresh clone needs: `make demo` and `make test`. Each builds .venv by itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch==2.13.0 (CPU build) comes from the local wheel cache; without the pin pip would fetch CUDA.
PIP_INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints-cpu.txt

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/memfit demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_codecs.py
	$(PY) benchmarks/bench_loaders.py
	$(PY) benchmarks/bench_planner.py
	$(PY) benchmarks/bench_evaluate.py
	$(PY) benchmarks/bench_distributed.py
	$(PY) benchmarks/bench_train.py

clean:
	rm -rf $(VENV) memfit-demo .pytest_cache
