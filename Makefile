# Two commands set everything up on a fresh machine:
#   make demo   virtual environment + install + ckptool on the bundled samples
#   make test   virtual environment + install + lint, types and the test suite
# torch is pinned to 2.13.0 through constraints.txt (a CPU build is served
# locally; any other version would pull gigabytes of CUDA packages).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-installed
STAMP  := $(VENV)/.installed
SOURCES := $(shell find ckptool -name '*.py')

.PHONY: demo test lint bench samples clean

# dependencies once (slow: torch), then ckptool itself as a regular install,
# redone whenever its source changes: an editable install adds an import
# hook that costs every `ckptool` run ~20 ms at start-up
$(DEPS): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet -c constraints.txt '.[test]'
	touch $(DEPS)

$(STAMP): $(DEPS) $(SOURCES)
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation --force-reinstall .
	touch $(STAMP)

DEMO_DIR := $(shell mktemp -d -u /tmp/ckptool-demo.XXXXXX)

demo: $(STAMP)
	@for f in samples/*.pth samples/*.ckpt samples/*.safetensors samples/*.pt; do \
	  echo; echo "\$$ ckptool inspect $$f"; $(BIN)/ckptool inspect "$$f" || exit $$?; \
	done
	@mkdir -p $(DEMO_DIR)
	@echo; echo "\$$ ckptool fix samples/dataparallel_cuda2.pth --strip-module --to cpu -o $(DEMO_DIR)/fixed.pth"
	@$(BIN)/ckptool fix samples/dataparallel_cuda2.pth --strip-module --to cpu -o $(DEMO_DIR)/fixed.pth
	@echo; echo "\$$ ckptool inspect $(DEMO_DIR)/fixed.pth --limit 3"
	@$(BIN)/ckptool inspect $(DEMO_DIR)/fixed.pth --limit 3
	@echo; echo "\$$ ckptool convert $(DEMO_DIR)/fixed.pth $(DEMO_DIR)/fixed.safetensors"
	@$(BIN)/ckptool convert $(DEMO_DIR)/fixed.pth $(DEMO_DIR)/fixed.safetensors
	@rm -rf $(DEMO_DIR)

lint: $(STAMP)
	$(BIN)/ruff check ckptool tests bench samples
	$(BIN)/mypy

test: $(STAMP) lint
	$(BIN)/python -m pytest -q

samples: $(STAMP)
	$(BIN)/python samples/make_samples.py

bench: $(STAMP)
	$(BIN)/python bench/bench_inspect.py
	$(BIN)/python bench/bench_fix.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
