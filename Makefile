# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fxoffload-installed

.PHONY: demo test test-torch211 bench-smoke clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch tabulate
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m fxoffload.tools.demo

# Two workers (pytest-xdist, the `test` extra): a cold-cache run on two cores took 9.5-10.6 min on
# one machine and 15-16 min on a slower one, both 2026-12-01; CI's, its Inductor cache warm, 7.5 min
# (docs/results.md, the thirty-first and thirty-second sessions; tests/conftest.py sets what speeds it).
test: $(STAMP)
	$(PY) -m pytest -q -n 2

# The other supported torch version, in its own environment (PyPI's 2.11 wheel is the CUDA build,
# several GB, but runs on a CPU). Not part of CI for that download's sake.
test-torch211:
	test -x .venv-211/bin/python || $(PYTHON) -m venv .venv-211
	grep -v '^torch==' constraints.txt > .venv-211/constraints.txt
	.venv-211/bin/python -m pip install -q torch==2.11.0
	.venv-211/bin/python -m pip install -q -c .venv-211/constraints.txt -e '.[test]'
	.venv-211/bin/python -m pytest -q -n 2

bench-smoke: $(STAMP)
	$(PY) -m bench --preset tiny --device cpu --steps 1 --warmup 0 --threads 1 --inner aot_eager --methods eager,fxoffload-all,fxoffload-budget=0.5,save_on_cpu,streamed,checkpoint

clean:
	rm -rf $(VENV) .venv-211 build *.egg-info
