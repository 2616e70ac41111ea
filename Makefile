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
	@echo "make gpu-check  the GPU tests (marked @pytest.mark.gpu); skip cleanly without a GPU"
	@echo "make gpu-check-here  the same with the machine's own python, no venv (a GPU box with torch installed)"
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

gpu-check: $(STAMP)
	$(PY) -m pytest -m gpu -v

gpu-check-here:
	PYTHONPATH=. $(PYTHON) -m pytest -m gpu -v -p no:cacheprovider

course: $(STAMP)
	$(PY) -m pip install -q -e ".[dev,course]"
	$(PY) -m course start
	@echo "then: $(VENV)/bin/jupyter lab course/work    (lesson 00 first)"

course-grade: $(STAMP)
	-$(PY) -m course grade --all
	$(PY) -m course progress

clean:
	rm -rf $(VENV) runs build *.egg-info
