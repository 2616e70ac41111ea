# hfstream: two commands for a newcomer, `make demo` and `make test`.
# Both create .venv and install what they need. Without CUDA (no nvidia-smi) the CPU build of
# torch is installed first (TORCH_SPEC, overridable), so pip never pulls a multi-GB CUDA build.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_CUDA),torch,torch==2.13.0)
STAMP  := $(VENV)/.hfstream-installed

.PHONY: help venv demo test test-slow gpu-check gpu-check-here course course-grade clean

help:
	@echo "make demo       train the demo (2 CPU processes, or every GPU) and print the step report"
	@echo "make test       the default test suite (fast; no GPU needed)"
	@echo "make test-slow  the slow tests only (marked @pytest.mark.slow)"
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

gpu-check:
	PYTHONPATH=. $(PYTHON) -m hfstream.tools.gpu_check --json runs/gpu_check.json $(GPU_CHECK_ARGS)

gpu-check-here: gpu-check

course: $(STAMP)
	$(PY) -m pip install -q -e ".[dev,course]"
	$(PY) -m course start
	@echo "then: $(VENV)/bin/jupyter lab course/work    (lesson 00 first)"

course-grade: $(STAMP)
	-$(PY) -m course grade --all
	$(PY) -m course progress

clean:
	rm -rf $(VENV) runs build *.egg-info
