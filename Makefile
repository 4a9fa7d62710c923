# One command each, on a fresh machine: `make demo` (main job on the digits default), `make test`.
# Both create .venv with the pinned environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# test workers (pytest-xdist): one per core of CI's 2-core machine; each test file runs on one worker
TEST_WORKERS ?= 2
STAMP := $(VENV)/.flowrl-installed

.PHONY: setup demo test clean-venv

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	@if ! (command -v tesseract && command -v chromium) >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && apt-get install -y -qq tesseract-ocr chromium >/dev/null) || echo "tesseract-ocr / chromium not installed: the tesseract OCR backend and headless-browser report tests will be skipped"; fi
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/flowrl pretrain-digits
	$(VENV)/bin/flowrl train --config recipes/digits.yaml --output-dir runs/demo --resume

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20

clean-venv:
	rm -rf $(VENV)
