# dptune: `make demo` installs and tunes a built-in example on the simulated cluster;
# `make test` installs, then lints (ruff), type-checks (mypy) and runs the test suite.
# Both work on a fresh machine without a GPU. The `dptune` command is installed in .venv:
# activate it (`. .venv/bin/activate`) or call `.venv/bin/dptune`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dptune-installed

DEMO   := reports/_scratch/TinyGPT-4x24GB

.PHONY: install demo example test test-slow lint docs bench validate-gpu constraints clean

install: $(STAMP)

# The venv is isolated from the host's site-packages, and everything but torch is installed at
# the exact versions of constraints/dev.txt (a lock compiled from pyproject.toml: `make
# constraints`). torch==2.13.0 is installed first, chosen by TORCH:
#   TORCH=auto   (default) the CPU build, or PyPI's CUDA build where an NVIDIA driver answers
#   TORCH=cpu    the CPU build (a local wheel pip is configured with, else PyTorch's CPU index)
#   TORCH=cuda   PyPI's default build, with its CUDA libraries
#   TORCH=system the torch already installed on the host (any version >= 2.13), kept: only
#                this venv sees the host's site-packages (make clean first if .venv exists)
TORCH         ?= auto
TORCH_VERSION := 2.13.0
TORCH_CPU_URL ?= https://download.pytorch.org/whl/cpu
$(STAMP): pyproject.toml constraints/dev.txt
	@case "$(TORCH)" in auto|cpu|cuda|system) ;; \
	    *) echo "TORCH=$(TORCH): expected auto, cpu, cuda or system" >&2; exit 2;; esac
	test -x $(PY) || $(PYTHON) -m venv $(if $(filter system,$(TORCH)),--system-site-packages) $(VENV)
	@if [ "$(TORCH)" != system ] && grep -q "include-system-site-packages = true" $(VENV)/pyvenv.cfg; then \
	    echo "note: $(VENV) sees the host's site-packages (made by an older make): 'make clean install' makes it isolated"; fi
	@torch=$(TORCH); \
	if [ "$$torch" = auto ]; then \
	    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then torch=cuda; else torch=cpu; fi; \
	fi; \
	if [ "$$torch" = system ]; then \
	    $(PY) -c "import torch" || { echo "TORCH=system: no torch on this host's Python" >&2; exit 2; }; \
	    echo "keeping installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif $(PY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null; then \
	    echo "keeping torch $$($(PY) -c 'import torch; print(torch.__version__)') in $(VENV)"; \
	elif [ "$$torch" = cuda ]; then \
	    $(PY) -m pip install -q -c constraints/dev.txt torch==$(TORCH_VERSION); \
	else \
	    $(PY) -m pip install -q --no-deps --retries 1 --index-url $(TORCH_CPU_URL) torch==$(TORCH_VERSION); \
	fi
	$(PY) -m pip install -q -c constraints/dev.txt -e ".[dev,docs]"
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

# Move the pinned versions forward: compile constraints/dev.txt from pyproject.toml's extras in
# an isolated venv (uv pip compile), for Python 3.11 on Linux x86_64 with the CPU torch: the lock
# holds only dptune's dependency tree, without torch (installed by `make install`) and without
# the CUDA libraries that PyPI's Linux torch requires (constraints/torch-cpu-overrides.txt).
# The versions already locked are kept where they still fit; then the tests decide.
constraints:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q uv
	.venv-lock/bin/uv pip compile --no-config pyproject.toml --extra dev --extra hf --extra docs \
	    --override constraints/torch-cpu-overrides.txt --python-version 3.11 \
	    --python-platform x86_64-manylinux_2_28 --no-emit-package torch \
	    --custom-compile-command "make constraints" -o constraints/dev.txt $(if $(UPGRADE),--upgrade)
	rm -rf .venv-lock
	@echo "constraints/dev.txt compiled: run 'make clean test test-slow docs' before committing it"

# The documentation site, built strictly (a broken link or reference fails); the pages are in
# docs/, the CLI reference is generated from the argparse parsers at build time (docs/hooks.py).
docs: install
	$(VENV)/bin/mkdocs build --strict --site-dir site

bench: install
	$(PY) -m benchmarks
	$(PY) -m benchmarks.readme

validate-gpu: install
	$(PY) benchmarks/validate_gpu.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis .mypy_cache site
