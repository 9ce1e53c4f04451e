# dptune: `make demo` installs and tunes a built-in example on the simulated cluster;
# `make test` installs, then lints (ruff), type-checks (mypy) and runs the test suite.
# Both work on a fresh machine without a GPU. The `dptune` command is installed in .venv:
# activate it (`. .venv/bin/activate`) or call `.venv/bin/dptune`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dptune-installed

DEMO   := reports/_scratch/TinyGPT-4x24GB

.PHONY: install demo example test test-slow lint bench validate-gpu constraints clean

install: $(STAMP)

# The venv sees the system site-packages, so a CUDA torch already installed there is kept.
# Without any torch, the CPU wheel torch==2.13.0 is taken (never a multi-GB CUDA build)
# unless an NVIDIA driver is present, in which case the default (CUDA) build is installed.
$(STAMP): pyproject.toml constraints/dev.txt
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	    echo "keeping installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(PY) -m pip install -q torch; \
	else \
	    $(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -c constraints/dev.txt -e ".[dev]"
	touch $(STAMP)
	@echo "dptune is installed in $(VENV): run '. $(VENV)/bin/activate' to use the dptune command (or call $(VENV)/bin/dptune)"

# The demo writes a scratch report (git-ignored), so running it never changes the committed
# example; `make example` regenerates the example under reports/ on purpose.
demo: install
	$(PY) -m dptune search --model dptune.examples.models:TinyGPT --batch-size 256 \
	    --simulate 4x24GB --objective max-batch --out $(DEMO)

example: install
	$(PY) -m dptune search --model dptune.examples.models:TinyGPT --batch-size 256 \
	    --simulate 4x24GB --objective max-batch --out reports/TinyGPT-4x24GB

lint: install
	$(PY) -m ruff check dptune tests benchmarks
	$(PY) -m mypy dptune
	@# a soft size warning: a long module is a hint to split it by concern, never a failure
	@find dptune -name '*.py' | xargs wc -l | awk '$$2 != "total" && $$1 > 600 \
	    {print "note: " $$2 " has " $$1 " lines (over 600: does it hold one concern?)"}'

# Both cores (pytest-xdist); tests marked `slow` are left to `make test-slow`, which CI also runs.
test: lint
	$(PY) -m pytest -q -p no:cacheprovider -p no:benchmark -n 2 -m "not slow"

test-slow: install
	$(PY) -m pytest -q -p no:cacheprovider -p no:benchmark -n 2 -m slow

# Move the pinned dev versions forward: a fresh venv without constraints, then the tests decide.
constraints:
	rm -rf .venv-constraints
	$(PYTHON) -m venv --system-site-packages .venv-constraints
	.venv-constraints/bin/python -m pip install -q torch==2.13.0 -e ".[dev]"
	.venv-constraints/bin/python -m pip freeze | grep "==" | grep -v -i -E "^(dptune|torch==|triton)" \
	    | grep -v -E "^nvidia-(cu|nccl|nvj|nvtx|cufft|curand|cusparse|cusolver|cublas|cudnn|nvshmem)" \
	    | sort -f > constraints/dev.txt.new
	rm -rf .venv-constraints
	mv constraints/dev.txt.new constraints/dev.txt
	@echo "constraints/dev.txt updated: run 'make clean test test-slow' before committing it"

bench: install
	$(PY) -m benchmarks
	$(PY) -m benchmarks.readme

validate-gpu: install
	$(PY) benchmarks/validate_gpu.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
