# The two commands of the README:
#   make book   set up (a virtual environment in .venv) and build the book into _build/html,
#               executing every page and lab at the profile of this machine (cpu without CUDA)
#   make test   set up and run every test: lint, unit/property/reference tests, and every lab
#               and page executed at the smoke profile; then the library's tests and every
#               lab again on the oldest torch the package supports (.venv/floor)
# Both start from nothing: the first run creates .venv from requirements.txt.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# One torch thread per process (FACTS.md: a second intra-op thread on a shared 2-core
# machine made small models' steps up to 100x slower); pytest runs two workers instead.
export OMP_NUM_THREADS ?= 1
export TQDM_DISABLE ?= 1
export PYDEVD_DISABLE_FILE_VALIDATION := 1

COLAB_BASE := $(VENV)/colab-base
FLOOR := $(VENV)/floor

.PHONY: setup book test test-main test-floor floor test-gpu gpu-wheels lint browser colab-base student bench bench-cost clean

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -r requirements.txt
	$(BIN)/python -m pip install -e .
	$(BIN)/python -c "import torch, lsdl_lab; print('torch', torch.__version__, '| lsdl_lab', lsdl_lab.__version__)"
	touch $(STAMP)

setup: $(STAMP)

book: $(STAMP)
	rm -rf _build/html _build/.doctrees
	$(BIN)/jupyter-book build . -W --keep-going

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Debian's chromium and chromium-driver for the browser test (tests/test_book.py), installed
# here when missing (CI runs as root); otherwise the command to run is printed.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	else \
		echo "make test needs chromium and chromium-driver: sudo apt-get install -y chromium chromium-driver" >&2; \
		exit 1; \
	fi

# A Colab-like Python (torch and Colab's usual packages, no lsdl_lab) for
# tests/test_colab_install.py, which layers a fresh venv over it for each run.
$(COLAB_BASE)/.installed: tests/colab-requirements.txt
	rm -rf $(COLAB_BASE)
	$(PYTHON) -m venv $(COLAB_BASE)
	$(COLAB_BASE)/bin/python -m pip install -r tests/colab-requirements.txt
	touch $@

colab-base: $(STAMP) $(COLAB_BASE)/.installed

# The oldest torch pyproject.toml admits, from the registry (a CUDA build; it runs on the
# CPU), with what the library's tests and the labs need: tests/floor-requirements.txt.
$(FLOOR)/.installed: tests/floor-requirements.txt pyproject.toml
	rm -rf $(FLOOR)
	$(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install -r tests/floor-requirements.txt
	$(FLOOR)/bin/python -m pip install --no-deps --no-build-isolation -e .
	$(FLOOR)/bin/python -c "import torch, lsdl_lab; print('floor: torch', torch.__version__)"
	touch $@

floor: $(FLOOR)/.installed

test: test-main test-floor

test-main: lint browser colab-base
	LSDL_SCALE=smoke $(BIN)/python -m pytest -n 2 --dist loadfile tests

# On the floor torch: the library's tests (not the book, the browser, nbgrader or the
# Colab install, which test the toolchain, not torch) and every lab executed by nbval.
FLOOR_SKIP := test_book.py test_labs_portable.py test_nbgrader.py test_nbgrader_later_labs.py \
	test_colab_install.py
test-floor: floor
	LSDL_SCALE=smoke $(FLOOR)/bin/python -m pytest -n 2 --dist loadfile -p no:cacheprovider \
		$(addprefix --ignore=tests/,$(FLOOR_SKIP)) tests --nbval-lax labs

# On a machine with a CUDA GPU and its own torch (Colab, a cloud GPU), not part of `make test`:
# every lab and chapter at gpu on CUDA, the library's tests with their CUDA half, the entry
# point with 1 and 2 ranks on the GPU, the optimizers on CUDA; its report goes to
# benchmarks/results/cuda/gpu_check.md (benchmarks/gpu_check.py). It uses the python on
# PATH (GPU_PYTHON), not .venv, whose torch is the CPU build of requirements.txt.
GPU_PYTHON ?= python3
test-gpu:
	$(GPU_PYTHON) -m pip install -q -r tests/gpu-requirements.txt
	$(GPU_PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	$(GPU_PYTHON) -m benchmarks.gpu_check

# The wheels of tests/gpu-requirements.txt for a GPU machine without internet (CPython 3.12,
# x86-64 Linux), into .whl/, but torch's own (the machine keeps its torch); there:
# pip install --no-index --find-links .whl -r tests/gpu-requirements.txt
gpu-wheels:
	$(PYTHON) -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d .whl -r tests/gpu-requirements.txt
	rm -f .whl/torch-* .whl/torchvision-* .whl/triton-* .whl/nvidia_*

# Not part of `make test`: minutes of timing, written to benchmarks/results/.
bench: $(STAMP)
	$(BIN)/python -m benchmarks

# The project's own cost: every lab at smoke and cpu, the test suite, the book build (long).
bench-cost: $(STAMP)
	$(BIN)/python -m benchmarks.project_cost

student: $(STAMP)
	$(BIN)/lsdl-student labs/*.ipynb -o student/

clean:
	rm -rf _build student .pytest_cache .ruff_cache
