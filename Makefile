PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test bench lint clean

# Installs into .venv once; torch==2.13.0 is the CPU wheel that lies on this machine's disk,
# an unpinned torch would pull gigabytes of CUDA wheels.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python tools/demo.py

# three workers on two cores: many tests wait on child processes, the S3 server or a timeout
test: $(STAMP)
	$(BIN)/python -m pytest tests -n 3

bench: $(STAMP)
	$(BIN)/python -m tools.bench.run_all

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
