# Two set-up commands on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install lint clean drafter

# The C sources are prerequisites too: a checkout that changed them rebuilds the extensions.
$(STAMP): pyproject.toml setup.py $(wildcard backends/native/csrc/*.[ch] drafters/draftless/csrc/*.[ch])
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

# The shipped SmolLM2 heads, from scratch: self-distillation data (cached under ~/.cache/spekula/train),
# then both heads trained side by side on one thread each, in bfloat16 products (results are reproducible
# for a fixed seed and thread count), converted to Q8_0 GGUFs and installed into drafters/model/heads/ with
# their recipe.
# An interrupted run continues where it stopped: `make drafter RESUME=--resume`.
DRAFTER_DIR ?= build/drafters
DRAFTER_ARGS ?= --tokens 560000 --seed 0 -t 1 --outtype q8_0 --precision bf16
drafter: $(STAMP)
	$(BIN)/spekula fetch-default
	$(BIN)/spekula train-drafter eagle3 -o $(DRAFTER_DIR)/eagle3 $(DRAFTER_ARGS) --distill-only
	$(BIN)/spekula train-drafter eagle3 -o $(DRAFTER_DIR)/eagle3 $(DRAFTER_ARGS) --steps 700 --lr 1e-3 $(RESUME) & e=$$!; \
	$(BIN)/spekula train-drafter dflash -o $(DRAFTER_DIR)/dflash $(DRAFTER_ARGS) --steps 1000 --lr 2e-3 $(RESUME) & d=$$!; \
	wait $$e; a=$$?; wait $$d; b=$$?; test $$a -eq 0 -a $$b -eq 0
	$(BIN)/python -m spekula.training.install_head $(DRAFTER_DIR)/eagle3 $(DRAFTER_DIR)/dflash

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
