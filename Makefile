# Two set-up commands on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch is pinned to the local CPU wheel first so nothing pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,ray]'
	touch $(STAMP)

install: $(STAMP)

# A repeat-then-summarise request: text the drafters can copy from the prompt, so the
# statistics show speculation at work (the output is what plain decoding gives).
run: $(STAMP)
	$(BIN)/spekula generate --chat -n 128 --temp 0 --spec-type ngram-simple,ngram-mod -f docs/demo-prompt.txt

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
