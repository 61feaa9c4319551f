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

.PHONY: setup book book-cached linkcheck pdf release test test-main test-floor floor test-labs \
	test-colab latest test-latest test-gpu gpu-wheels lint browser colab-base student bench \
	bench-cost clean edition-config book-edition student-edition pin-labs check-edition

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

# `make book`, but each page's executed notebook kept by jupyter-cache in _build/.jupyter_cache
# (_config.yml's execute_notebooks: cache, in a copy of it), so that a page whose code cells
# are unchanged is not run again. jupyter-cache hashes the code cells only, not the library,
# the packages or LSDL_SCALE: the site's workflows (.github/workflows/pages.yml, release.yml)
# restore the folder only for the same book, labs, library, requirements and profile.
CACHED_CONFIG := _build/_config.cached.yml
book-cached: $(STAMP)
	rm -rf _build/html _build/.doctrees
	$(BIN)/python _ext/book_config.py --cache -o $(CACHED_CONFIG)
	$(BIN)/jupyter-book build . --config $(CACHED_CONFIG) -W --keep-going

# Every external link of the book, fetched (Sphinx's linkcheck builder; fails on a dead link;
# .github/workflows/linkcheck.yml runs it weekly). The pages are executed at smoke: their
# outputs' links do not depend on the profile. Report: _build/linkcheck/_build/html/output.txt
linkcheck: $(STAMP)
	rm -rf _build/linkcheck
	LSDL_SCALE=smoke $(BIN)/jupyter-book build . --builder linkcheck --path-output _build/linkcheck

# The book as one PDF, _build/pdf/lsdl.pdf: every page of the built site (_build/html, built by
# `make book` when missing) printed by the system Chromium once its math is rendered, joined
# in reading order with an outline (_ext/book_pdf.py, which checks that the pages printed are
# _toc.yml's, in order). Nothing is downloaded. A copy goes into the site's folder, so that the
# site serves it: <site>lsdl.pdf (pages.yml), <site>vN/lsdl.pdf for an edition (release.yml).
pdf: $(STAMP) browser
	@test -f _build/html/index.html || $(MAKE) book
	$(BIN)/python _ext/book_pdf.py _build/html -o _build/pdf/lsdl.pdf
	cp _build/pdf/lsdl.pdf _build/html/lsdl.pdf

# What .github/workflows/release.yml publishes for a version tag EDITION (vN, required): the
# site, the PDF and the student versions of the labs, in _build/release/. The site is built
# as that edition (`make edition-config`, _ext/book_config.py): kept at <site>vN/, its Colab
# buttons and links to the repository open the tag's files, its canonical links and the
# PDF's are the edition's pages; the student labs link the tag and the edition's chapters,
# and install the library from the tag (lsdl-student --edition).
EDITION ?=
EDITION_CONFIG ?= _build/_config.$(EDITION).yml
CONFIG_VALUE = $(BIN)/python _ext/book_config.py --get
edition-config: $(STAMP)
	$(BIN)/python _ext/book_config.py --cache --edition "$(EDITION)" -o $(EDITION_CONFIG)

book-edition: edition-config
	rm -rf _build/html _build/.doctrees
	$(BIN)/jupyter-book build . --config $(EDITION_CONFIG) -W --keep-going

student-edition: edition-config
	rm -rf student
	$(BIN)/lsdl-student labs/*.ipynb -o student/ --edition "$(EDITION)" \
		--repository "$$($(CONFIG_VALUE) repository.url)" --site "$$($(CONFIG_VALUE) html.baseurl)"

# The labs themselves pinned to EDITION, in place (solutions kept): run before tagging vN
# (README, "Publishing"), so that what Colab opens from the tag installs the tag's library;
# check-edition, run by release, fails on a tag whose labs are not pinned to it.
PIN_ARGS = labs/*.ipynb --pin --edition "$(EDITION)" \
	--repository "$$($(CONFIG_VALUE) repository.url)" --site "$$($(CONFIG_VALUE) html.baseurl)"
pin-labs: edition-config
	$(BIN)/lsdl-student $(PIN_ARGS)

check-edition: edition-config
	$(BIN)/lsdl-student $(PIN_ARGS) --check

release: check-edition book-edition pdf student-edition
	rm -rf _build/release
	mkdir -p _build/release
	cp _build/pdf/lsdl.pdf _build/release/lsdl-$(EDITION).pdf
	$(BIN)/python -m zipfile -c _build/release/lsdl-student-labs-$(EDITION).zip student/
	$(BIN)/python -c "import yaml; c = yaml.safe_load(open('$(EDITION_CONFIG)')); \
		site, repo = c['html']['baseurl'], c['repository']['url']; \
		print(f'The book as of $(EDITION): {site} (its PDF and the student versions' \
		f' of its labs are attached). Pin the library to it: pip install git+{repo}@$(EDITION)')" \
		> _build/release/notes.md

# The workflows (.github/workflows) are checked by actionlint, their shell steps by shellcheck
# (both binaries from the package registry, in requirements.txt).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/actionlint -shellcheck=$(BIN)/shellcheck -pyflakes=

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

# Every lab executed at smoke by nbval, in .venv (.github/workflows/colab.yml, weekly).
test-labs: $(STAMP)
	LSDL_SCALE=smoke $(BIN)/python -m pytest -n 2 -p no:cacheprovider --nbval-lax labs/

# A lab installing itself in a Colab-like Python (tests/colab-requirements.txt, its newest
# packages; .github/workflows/colab.yml, weekly; part of `make test` too).
test-colab: colab-base
	LSDL_SCALE=smoke $(BIN)/python -m pytest -p no:cacheprovider tests/test_colab_install.py

# On the floor torch: the library's tests (not the book, the browser, nbgrader or the
# Colab install, which test the toolchain, not torch) and every lab executed by nbval.
FLOOR_SKIP := test_book.py test_labs_portable.py test_nbgrader.py test_nbgrader_later_labs.py \
	test_colab_install.py
test-floor: floor
	LSDL_SCALE=smoke $(FLOOR)/bin/python -m pytest -n 2 --dist loadfile -p no:cacheprovider \
		$(addprefix --ignore=tests/,$(FLOOR_SKIP)) tests --nbval-lax labs

# The newest torch and numpy (requirements.txt without their pins; the rest as pinned there),
# in .venv/latest, built anew each time, so that "newest" is the registry's of the day: the
# library's tests and every lab, as on the floor (.github/workflows/latest.yml, weekly, where
# PIP_EXTRA_INDEX_URL names the index of torch's CPU wheels).
LATEST := $(VENV)/latest
latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	sed -E 's/^(torch|numpy)[=<>!~ ].*$$/\1/' requirements.txt > $(LATEST)/requirements.txt
	$(LATEST)/bin/python -m pip install -r $(LATEST)/requirements.txt
	$(LATEST)/bin/python -m pip install -e .
	$(LATEST)/bin/python -c "import numpy, torch; print('latest: torch', torch.__version__, '| numpy', numpy.__version__)"

test-latest: latest
	LSDL_SCALE=smoke $(LATEST)/bin/python -m pytest -n 2 --dist loadfile -p no:cacheprovider \
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
