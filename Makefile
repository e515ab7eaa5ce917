# shoal: `make demo` runs the embedded default; `make test` installs what the tests need
# and runs everything CI runs.

CARGO  ?= cargo
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
SHOAL  := target/release/shoal

.PHONY: demo test build lint rust-test prom-test py-test py-env py-sdk c-examples rust-examples deps bench clean

demo: build
	$(SHOAL) demo

# The binary and the source SDK's C library (target/release/libshoal.so).
build:
	$(CARGO) build --release --locked -p shoal -p shoal-ffi

# The C examples (examples/c), built with the system cc against include/shoal.h and
# libshoal.so; the Python tests run them.
C_OUT  := target/c
CFLAGS ?= -O2 -g -Wall -Wextra -Werror -std=c11
c-examples: build
	mkdir -p $(C_OUT)
	cc $(CFLAGS) -Iinclude -Iexamples/c examples/c/readout.c -Ltarget/release -lshoal \
	  -Wl,-rpath,$(CURDIR)/target/release -o $(C_OUT)/readout
	cc $(CFLAGS) -D_DEFAULT_SOURCE -Iexamples/c examples/c/unix_readout.c -o $(C_OUT)/unix_readout
	cc $(CFLAGS) -D_POSIX_C_SOURCE=199309L -Iinclude examples/c/submit_bench.c -Ltarget/release -lshoal -lpthread \
	  -Wl,-rpath,$(CURDIR)/target/release -o $(C_OUT)/submit_bench
	cc $(CFLAGS) -shared -fPIC -Iinclude examples/c/filter/l1_filter.c -o $(C_OUT)/libl1_filter.so
	cc $(CFLAGS) -Iinclude examples/c/consumer.c -Ltarget/release -lshoal \
	  -Wl,-rpath,$(CURDIR)/target/release -o $(C_OUT)/consumer

test: deps lint rust-test prom-test py-test

# Debian packages the tests and benchmarks use, installed only when we are root and they
# are missing (CI runs as root on a fresh machine): chromium + chromium-driver for the
# browser test of the run-control UI, iproute2 + ethtool + nftables (injected loss) for the
# testbed tests (network namespaces; they skip when not root), prometheus (promtool for the
# alerting rules' tests, the server for tests/python/test_prometheus.py), the rest for the
# benchmarks' peers.
DEB_PACKAGES := chromium chromium-driver iproute2 ethtool nftables iperf3 jq redis-server bc openssh-server openssh-client iptables prometheus
deps:
	@missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	      || echo "warning: could not install$$missing (the browser test and benchmarks need them)"; \
	  else echo "note: not root, not installing$$missing (the browser test skips without chromium)"; fi; \
	fi

# deploy/prometheus: the configuration and alerting rules checked, the rules' unit tests run.
prom-test: deps
	@if command -v promtool >/dev/null; then \
	  cd deploy/prometheus && promtool check config prometheus.yml && promtool test rules shoal.rules.test.yml; \
	else echo "note: promtool missing (Debian prometheus, installed when root): rules not tested"; fi

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --locked --all-targets -- -D warnings

# The Python filter tests (crates/shoal-shm/tests/pyfilter.rs) run workers on the venv's
# Python (numpy).
rust-test: py-env
	SHOAL_PYTHON=$(CURDIR)/$(PY) $(CARGO) test --locked --workspace

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

py-env: $(VENV)/.installed

# The source SDK's Python module (`import shoal`, crates/shoal-py) into the test venv.
py-sdk: py-env
	VIRTUAL_ENV=$(CURDIR)/$(VENV) PATH=$(CURDIR)/$(VENV)/bin:$$PATH \
	  $(VENV)/bin/maturin develop --release --locked --quiet -m crates/shoal-py/Cargo.toml

# pytest exits 5 when it collects no test; that must fail loudly, not pass silently.
# The source SDK's Rust examples (crates/shoal-net/examples: readout, submit_bench).
rust-examples:
	$(CARGO) build --release --locked -p shoal-net --examples

py-test: build py-env py-sdk c-examples rust-examples
	SHOAL_BIN=$(CURDIR)/$(SHOAL) SHOAL_C_EXAMPLES=$(CURDIR)/$(C_OUT) SHOAL_RUST_EXAMPLES=$(CURDIR)/target/release/examples $(PY) -m pytest tests/python -q; \
	  rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; fi; exit $$rc

bench: build py-env
	scripts/bench-demo.sh
	scripts/bench-pubsub.sh
	scripts/bench-l1.sh

clean:
	$(CARGO) clean
	rm -rf $(VENV) shoal-out shoal-runs test-output
