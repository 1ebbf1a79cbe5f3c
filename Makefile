# Two commands a fresh clone needs: `make demo` and `make test`. Each builds .venv by itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch==2.13.0 (CPU build) comes from the local wheel cache; without the pin pip would fetch CUDA.
PIP_INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints-cpu.txt
# Python's default, bytecode cached (an environment may turn it off): the suite's processes (the workers, ranks,
# the console script) then compile memfit, the tests' rewritten asserts and torch's modules once, not each.
export PYTHONDONTWRITEBYTECODE :=
NEW_PIP := --quiet --disable-pip-version-check --no-compile 'pip>=25,<27'

.PHONY: demo test test-torch-next test-cuda gpu-check lint bench clean

# The venv without pip, then a newer pip put in by the system's pip (`pip --python`, pip >= 22.3) without bytecode:
# `venv` alone installs Python's bundled pip 23 and compiles all of it (5 s of CPU, 26 s wall on a busy 2-core VM),
# and pip 23 spends ~10 s of CPU weighing the wheel tags of the index's links; where the system's pip cannot, the
# bundled pip is put in and upgraded. Then no bytecode at install (pip would compile every module of torch,
# transformers, scipy...: ~35 s) but only what the suite's collection imports, once, which also caches pytest's
# rewritten test modules for the workers; torch's compiler and distributed packages, which the workers and ranks
# import after collection (every optimizer imports torch._dynamo), compiled first on both cores instead of by each
# worker at once. Only a warm-up: a test that fails to collect (its output to /dev/null) must not fail the install,
# or `make demo`, unexplained.
$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	@echo "Creating $(VENV) and installing memfit, torch (CPU build) and the test tools: a few minutes, once (quiet pip)."
	$(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(PY) install $(NEW_PIP) 2>/dev/null || \
	  { $(PY) -m ensurepip --default-pip > /dev/null && $(PY) -m pip install --upgrade $(NEW_PIP); }
	$(PIP_INSTALL) --no-compile -e '.[dev]'
	$(PY) -m compileall -q -j 0 $(addprefix $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/torch/,_dynamo _inductor distributed) > /dev/null 2>&1 || \
	  true  # bytecode only: a failure costs time, not results
	$(PY) -m pytest --collect-only -q -p no:cacheprovider > /dev/null || \
	  echo "(the collection that caches bytecode failed; the install is done: 'make test' says what fails)"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/memfit demo

# Two pytest worker processes on 2 cores (pytest-xdist, in the dev extra): the suite 3:53 against 4:24 with three
# and 5:27 with four on a quiet 2-core VM (once the tests waited less on ranks and subprocesses, a third worker only
# added its start-up and competed for the cores). A whole test file to each at a time, so that a file's module fixtures (one spawn of ranks shared by its checks) run
# once; `make test TEST_WORKERS=0` runs one. Ranks' ports are bound by the system as each group's store starts
# (memfit.testing.ranks), so workers never race.
TEST_WORKERS ?= 2
PYTEST_ARGS := -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

# The same suite on the newest torch release in pyproject's range, in a venv of its own (CI runs `make test` only).
# pip brings torch's default build (CUDA), which runs on a CPU; its wheels are GBs unless a local cache has them.
TORCH_NEXT ?= 2.14.1
NEXT_VENV := .venv-torch$(basename $(TORCH_NEXT))
NEXT_PY := $(NEXT_VENV)/bin/python
$(NEXT_VENV)/.installed: pyproject.toml
	@echo "Creating $(NEXT_VENV) with torch $(TORCH_NEXT) and the test tools: a few minutes, once (quiet pip)."
	$(PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_PY) -m pip install --quiet --disable-pip-version-check 'torch==$(TORCH_NEXT)' -e '.[dev]'
	touch $@

test-torch-next: $(NEXT_VENV)/.installed
	$(NEXT_PY) -c "import torch; print('torch', torch.__version__)"
	$(NEXT_PY) -m pytest $(PYTEST_ARGS)

# The CUDA-marked tests, then every benchmark on the GPU (--quick). .venv holds the CPU build of torch:
# run it with a CUDA build, e.g. `make test-cuda CUDA_PY=python` in an environment that has one.
CUDA_PY ?= $(PY)
test-cuda:
	@$(CUDA_PY) -c "import torch, sys; torch.cuda.is_available() or sys.exit('make test-cuda: torch ' + \
	torch.__version__ + ' sees no CUDA device; run it where one is, with a CUDA build: make test-cuda CUDA_PY=python')"
	$(CUDA_PY) -m pytest -q -m cuda -p no:cacheprovider
	for b in codecs loaders planner evaluate train; do \
	  if $(CUDA_PY) -m memfit bench $$b --help | grep -q -- --device; then dev="--device cuda"; else dev=""; fi; \
	  $(CUDA_PY) -m memfit bench $$b --quick $$dev || exit 1; \
	done
	$(CUDA_PY) -m memfit bench distributed --quick --device cuda \
	  --worlds $$($(CUDA_PY) -c "import torch; print('1,2' if torch.cuda.device_count() >= 2 else '1')")

# memfit's CUDA predictions against the GPU (docs/gpus.md): reserved bytes, the out-of-memory boundary, fit's plans
# and the loaders, one command under 8 minutes on one GPU, exit status 1 on a MISS. With a CUDA build of torch:
# `make gpu-check CUDA_PY=python`; without a GPU, `memfit bench gpu --dry-run` runs the same code on the CPU.
gpu-check:
	@$(CUDA_PY) -c "import torch, sys; torch.cuda.is_available() or sys.exit('make gpu-check: torch ' + \
	torch.__version__ + ' sees no CUDA device; run it where one is, with a CUDA build: make gpu-check CUDA_PY=python')"
	$(CUDA_PY) -m memfit bench gpu

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests

# Every benchmark, full size; each prints its table (save it under benchmarks/results/ with tee).
bench: $(VENV)/.installed
	for b in codecs loaders planner evaluate distributed train fit; do $(VENV)/bin/memfit bench $$b || exit 1; done
	$(VENV)/bin/memfit bench planner --real
	$(VENV)/bin/memfit bench loaders --augment
	$(VENV)/bin/memfit bench train --architectures

clean:
	rm -rf $(VENV) $(NEXT_VENV) memfit-demo .pytest_cache
