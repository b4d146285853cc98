# Two entry points for a fresh machine: `make demo` and `make test`. Both install what
# they need (a virtualenv here, Debian packages via tests/install-deps when root).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1)

.PHONY: all venv deps demo test lint unit clean deb bench rehearsal rehearsal-clean rehearsal-shell

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

deps:
	tests/install-deps

# Only the Debian packages the demo uses (tests/install-deps demo), not the whole suite's.
demo: venv
	tests/install-deps demo
	$(BIN)/python tests/demo.py

lint: venv
	$(BIN)/ruff check guest tests bench
	$(BIN)/mypy

test: venv deps lint
	$(BIN)/pytest

# Performance benchmark (needs root; docs/performance.md): prints one summary line and
# writes bench/results.{json,md}. `$(BIN)/python bench/run.py --profile` shows the costs.
bench: venv deps
	$(BIN)/python bench/run.py

# The Debian package (docs/packaging.md): dist/unbounded-nvidia-setup_$(VERSION)_all.deb.
# VERSION defaults to the pyproject version (`make deb VERSION=0.1.0+1` builds a newer
# one); DIST=DIR writes the .deb elsewhere.
VERSION := $(shell sed -n 's/^version *= *"\(.*\)"$$/\1/p' pyproject.toml)
DIST := dist

# Only the build dependencies (tests/install-deps build: Build-Depends, build-essential,
# dpkg-dev), not the whole suite's.
deb:
	tests/install-deps build
	packaging/build-deb "$(VERSION)" "$(DIST)"

# A GPU node machine booted in systemd-nspawn without a GPU (root; docs/packaging.md,
# "Rehearsal"): the trixie rootfs, this .deb, a simulated driver; shows the gating and
# check's verdicts through late staging, a restart and a reload, and leaves the machine
# running. NVIDIA's nvidia-ctk from ../shared when it is there (NVIDIA_CTK= for the
# suite's stand-in).
REHEARSAL_DIR := /var/lib/unbounded-nvidia-setup-rehearsal
NVIDIA_CTK := $(abspath $(wildcard ../shared/nvidia-container-toolkit/bin/nvidia-ctk))

rehearsal: venv deb
	tests/install-deps rehearsal
	UNB_TEST_NVIDIA_CTK="$(NVIDIA_CTK)" PYTHONPATH=tests $(BIN)/python -m boot.rehearsal \
		--dir "$(REHEARSAL_DIR)" --deb "$(DIST)/unbounded-nvidia-setup_$(VERSION)_all.deb"

rehearsal-shell: venv
	PYTHONPATH=tests $(BIN)/python -m boot.rehearsal --dir "$(REHEARSAL_DIR)" --shell

rehearsal-clean: venv
	PYTHONPATH=tests $(BIN)/python -m boot.rehearsal --dir "$(REHEARSAL_DIR)" --clean

clean:
	rm -rf $(VENV) build dist debian .mypy_cache .ruff_cache .pytest_cache
