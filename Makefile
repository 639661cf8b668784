# Two commands on a fresh machine: `make demo` and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test campaign bench lint clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,onnx,cluster]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/virtaccel demo

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m mypy
	$(PY) -m pytest -q

# Long campaigns that make test leaves out: the whole hostile catalogue on every attachment,
# the suite's self-test on every attachment, virtaccel explore over 1000 seeds of tenants-8
# with every implemented fault action (and again with the driver's recovery broken on
# purpose: the failures must be found and shrunk), and the HTML report in headless
# Chromium where the machine has one (the project does not install it).
campaign: $(STAMP)
	$(PY) -m pytest -q -m campaign
	$(VENV)/bin/virtaccel hostile --self-test --attach mmio,pci,vfio,sriov
	@if command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null; then \
		$(PY) -m pytest -q tests/virtaccel/test_hostile_browser.py; \
	else echo "campaign: no chromium here, the HTML report's browser check is skipped"; fi

# Row (h) compares with onnxruntime: the `bench` extra, installed here only.
bench: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(VENV)/bin/virtaccel bench --json bench.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache
