# hfstream: two commands for a newcomer, `make demo` and `make test`.
# Both create .venv and install what they need. Without CUDA (no nvidia-smi) the CPU build of
# torch is installed first (TORCH_SPEC, overridable), so pip never pulls a multi-GB CUDA build.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_CUDA),torch,torch==2.13.0)
STAMP  := $(VENV)/.hfstream-installed

.PHONY: help venv demo test test-slow test-compat gpu-check gpu-check-here course course-grade clean

help:
	@echo "make demo       train the demo (2 CPU processes, or every GPU) and print the step report"
	@echo "make test       the default test suite (fast; no GPU needed)"
	@echo "make test-slow  the slow tests only (marked @pytest.mark.slow)"
	@echo "make test-compat  the parity and Trainer tests on the lowest torch/transformers/accelerate pyproject.toml allows (own venv, .venv-compat)"
	@echo "make gpu-check  everything that needs a GPU, one table + runs/gpu_check.json (machine's python, no venv); skips without a GPU"
	@echo "make gpu-check-here  the same (old name)"
	@echo "make course     install Jupyter, copy the lessons to course/work/ and say how to open them"
	@echo "make course-grade  grade your notebooks in course/work/ (all lessons) and show your progress"

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hfstream demo

test: $(STAMP)
	$(PY) -m pytest

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# The lower bounds of pyproject.toml, tested: a venv of its own with the lowest torch, transformers
# and accelerate of the declared ranges that install here, then the parity and Trainer tests.
# (Another set: make test-compat COMPAT_PINS="torch==... transformers==... accelerate==...".)
COMPAT_VENV  ?= .venv-compat
COMPAT_PY    := $(COMPAT_VENV)/bin/python
COMPAT_PINS  ?= torch==2.13.0 transformers==5.18.0 accelerate==1.14.0
COMPAT_TESTS ?= tests/test_trainer_parity.py tests/test_trainer_overlap.py tests/test_trainer_prefetch.py

test-compat:
	test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	$(COMPAT_PY) -m pip install -q $(word 1,$(COMPAT_PINS))
	$(COMPAT_PY) -m pip install -q -e . $(COMPAT_PINS) pytest pytest-timeout
	$(COMPAT_PY) -c "import torch, transformers as t, accelerate as a; print('on torch', torch.__version__, 'transformers', t.__version__, 'accelerate', a.__version__)"
	OMP_NUM_THREADS=1 $(COMPAT_PY) -m pytest $(COMPAT_TESTS)

gpu-check:
	PYTHONPATH=. $(PYTHON) -m dev.gpu_check --json $${OUT:-runs}/gpu_check.json $(GPU_CHECK_ARGS)

gpu-check-here: gpu-check

course: $(STAMP)
	$(PY) -m pip install -q -e ".[dev,course]"
	@# `course start` ends with "open them with: jupyter lab course/work", but jupyter is in
	@# $(VENV)/bin, which is not on PATH unless the venv is activated: print the path that exists.
	bash -o pipefail -c '$(PY) -m course start | sed "s|: jupyter lab |: $(VENV)/bin/jupyter lab |"'
	@echo "(lesson 00 first)"

course-grade: $(STAMP)
	-$(PY) -m course grade --all
	$(PY) -m course progress

clean:
	rm -rf $(VENV) $(COMPAT_VENV) runs build *.egg-info
