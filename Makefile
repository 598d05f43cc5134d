# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fxoffload-installed

.PHONY: demo test bench-smoke clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch tabulate
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m fxoffload.demo

test: $(STAMP)
	$(PY) -m pytest -q

bench-smoke: $(STAMP)
	$(PY) -m bench --preset tiny --steps 2

clean:
	rm -rf $(VENV) build *.egg-info
