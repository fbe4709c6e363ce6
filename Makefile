# Everything a fresh machine needs (Python 3.10+ with pip; apt optional) is installed by these targets.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pin the CPU wheel (a bare `torch` may pull a multi-GB CUDA build); the package itself asks for a range
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install system-deps demo test test-all lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,vocabs,parquet,bench,hf,lmeval,multimodal,triton]"
	touch $(STAMP)

install: $(STAMP)

## Optional Debian packages (pydocs/WordNet validation sets, man-page corpora, emoji images): the script says
## what it installs and why, shows apt-get's progress, and only notes it where apt-get cannot run (not root).
## `make test SYSTEM_DEPS=no` (or demo) skips it; SYSTEM_DEPS=check only lists what is missing.
SYSTEM_DEPS ?= yes
system-deps:
	@SYSTEM_DEPS=$(SYSTEM_DEPS) bash scripts/install-system-deps.sh

## The main job: train + evaluate tiny-dense, tiny-smoe, tiny-mh3 on the KJV corpus, print a table.
## `make demo STEPS=10`: the same, 10 steps per model, into runs/demo-10steps (a quick look).
STEPS ?=
DEMO_OUT ?= runs/demo$(if $(STEPS),-$(STEPS)steps)
demo: install system-deps
	$(BIN)/mhmoe compare --presets tiny-dense tiny-smoe tiny-mh3 --out $(DEMO_OUT) $(if $(STEPS),--max-steps $(STEPS))

## The test suite (what CI runs).
test: install system-deps
	$(BIN)/python -m pytest -q -m "not slow"

test-all: install system-deps
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check src tests benchmarks

bench: install
	$(BIN)/python benchmarks/train_throughput.py

clean:
	rm -rf $(VENV) runs build *.egg-info
