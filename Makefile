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
SOURCES := $(shell find ckptool -name '*.py' -o -name '*.tcss')

.PHONY: demo test lint bench samples fuzz clean

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
	@for f in samples/*.pth samples/*.ckpt samples/*.safetensors samples/*.pt samples/dcp_tinynet samples/deepspeed_zero3; do \
	  echo; echo "\$$ ckptool inspect $$f"; $(BIN)/ckptool inspect "$$f" || exit $$?; \
	done
	@mkdir -p $(DEMO_DIR) && cp samples/dataparallel_cuda2.pth $(DEMO_DIR)/
	@echo; echo "\$$ cd $(DEMO_DIR) && ckptool diagnose dataparallel_cuda2.pth --model $(CURDIR)/samples/make_samples.py:TinyNet"
	@cd $(DEMO_DIR) && $(CURDIR)/$(BIN)/ckptool diagnose dataparallel_cuda2.pth \
	  --model $(CURDIR)/samples/make_samples.py:TinyNet; test $$? -eq 1
	@# run the one fix command diagnose printed, exactly as printed
	@cd $(DEMO_DIR) && cmd=$$($(CURDIR)/$(BIN)/ckptool diagnose --json dataparallel_cuda2.pth \
	  --model $(CURDIR)/samples/make_samples.py:TinyNet | $(CURDIR)/$(BIN)/python -c \
	  'import json, sys; print(json.load(sys.stdin)["fix_command"])') && \
	  echo && echo "\$$ $$cmd" && PATH=$(CURDIR)/$(BIN):$$PATH eval "$$cmd"
	@echo; echo "\$$ ckptool diagnose dataparallel_cuda2.fixed.pth --model $(CURDIR)/samples/make_samples.py:TinyNet"
	@cd $(DEMO_DIR) && $(CURDIR)/$(BIN)/ckptool diagnose dataparallel_cuda2.fixed.pth \
	  --model $(CURDIR)/samples/make_samples.py:TinyNet
	@echo; echo "\$$ ckptool convert dataparallel_cuda2.fixed.pth fixed.safetensors"
	@cd $(DEMO_DIR) && $(CURDIR)/$(BIN)/ckptool convert dataparallel_cuda2.fixed.pth fixed.safetensors
	@echo; echo "\$$ ckptool convert samples/deepspeed_zero3 zero3.safetensors"
	@$(BIN)/ckptool convert samples/deepspeed_zero3 $(DEMO_DIR)/zero3.safetensors
	@rm -rf $(DEMO_DIR)

lint: $(STAMP)
	$(BIN)/ruff check ckptool tests bench samples tools
	$(BIN)/mypy

test: $(STAMP) lint
	$(BIN)/python -m pytest -q -n auto --dist loadfile

samples: $(STAMP)
	$(BIN)/python samples/make_samples.py

# minutes of structure-aware fuzzing (the suite runs a few hundred mutants);
# FUZZ_SECONDS=... FUZZ_SEED=... to choose
fuzz: $(STAMP)
	$(BIN)/python tests/fuzzing.py --seconds $${FUZZ_SECONDS:-300} $${FUZZ_SEED:+--seed $$FUZZ_SEED}

bench: $(STAMP)
	$(BIN)/python bench/bench_inspect.py
	$(BIN)/python bench/bench_fix.py
	$(BIN)/python bench/bench_browse.py
	$(BIN)/python bench/bench_multifile.py
	$(BIN)/python bench/bench_hf_storage.py
	$(BIN)/python bench/bench_distributed.py
	$(BIN)/python bench/bench_verify.py
	$(BIN)/python bench/bench_safety.py
	$(BIN)/python bench/bench_remote.py
	$(BIN)/python bench/bench_megatron.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
