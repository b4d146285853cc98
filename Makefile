# Two entry points for a fresh machine: `make demo` and `make test`. Both install what
# they need (a virtualenv here, Debian packages via tests/install-deps when root).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1)

.PHONY: all venv deps demo test lint unit clean deb

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

deps:
	tests/install-deps

demo: venv deps
	$(BIN)/python tests/demo.py

lint: venv
	$(BIN)/ruff check guest tests
	$(BIN)/mypy

test: venv deps lint
	$(BIN)/pytest

# The Debian package (docs/packaging.md): dist/unbounded-nvidia-setup_$(VERSION)_all.deb.
# VERSION defaults to the pyproject version (`make deb VERSION=0.1.0+1` builds a newer
# one; the environment cannot change it); DIST=DIR writes the .deb elsewhere. Skipped when
# that .deb is newer than every source file; builds are serialised with a lock.
VERSION := $(shell sed -n 's/^version *= *"\(.*\)"$$/\1/p' pyproject.toml)
DIST := dist
DEB := unbounded-nvidia-setup_$(VERSION)_all.deb
DEB_TREE := build/deb/unbounded-nvidia-setup-$(VERSION)
DEB_SOURCES := pyproject.toml README.md guest units packaging $(wildcard docs LICENSE)

deb: deps
	@mkdir -p build/deb "$(DIST)"
	@flock build/deb/.lock sh -euc '\
	  out="$(DIST)/$(DEB)"; \
	  if [ -f "$$out" ] && [ -z "$$(find $(DEB_SOURCES) Makefile \( -name __pycache__ -o -name "*.egg-info" \) -prune -o -newer "$$out" -print)" ]; then \
	    echo "$$out is up to date"; exit 0; fi; \
	  rm -rf "$(DEB_TREE)" build/deb/$(DEB); mkdir -p "$(DEB_TREE)"; \
	  tar -c --exclude=__pycache__ --exclude="*.egg-info" --exclude="*.pyc" $(DEB_SOURCES) | tar -x -C "$(DEB_TREE)"; \
	  cp -r packaging/debian "$(DEB_TREE)/debian"; \
	  maint=$$(sed -n "s/^Maintainer: *//p" packaging/debian/control); \
	  when=$$(git log -1 --format=%cD 2>/dev/null || date -R); \
	  printf "%s (%s) unstable; urgency=medium\n\n  * Package of unbounded-nvidia-setup %s.\n\n -- %s  %s\n" \
	    unbounded-nvidia-setup "$(VERSION)" "$(VERSION)" "$$maint" "$$when" > "$(DEB_TREE)/debian/changelog"; \
	  (cd "$(DEB_TREE)" && env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$$HOME" LC_ALL=C.UTF-8 \
	    dpkg-buildpackage -us -uc -b); \
	  cp build/deb/$(DEB) "$(DIST)/.$(DEB).tmp"; mv "$(DIST)/.$(DEB).tmp" "$$out"; \
	  echo "wrote $$out"'

clean:
	rm -rf $(VENV) build dist debian .mypy_cache .ruff_cache .pytest_cache
