# shoal: `make demo` runs the embedded default; `make test` installs what the tests need
# and runs everything CI runs.

CARGO  ?= cargo
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
SHOAL  := target/release/shoal

.PHONY: demo test build test-build lint rust-test prom-test py-test py-env py-sdk c-examples c-examples-test rust-examples deps bench clean

demo: build
	$(SHOAL) demo

# The binary and the source SDK's C library (target/release/libshoal.so).
build:
	$(CARGO) build --release --locked -p shoal -p shoal-ffi

# What the Python tests run is what `cargo test --workspace` builds anyway (the test
# profile, in target/debug): the binary, libshoal.so, the Rust examples and the Python
# module's library, here only built when `cargo test` has not run. A second, optimized
# build for pytest alone took 12 of a cold `make test`'s 33 minutes on the 2-core machine
# (7.5 the binary and libshoal.so, about 4 the module with maturin, 1 the Rust examples).
# The module is installed for the tests as a bare extension (target/py-test/shoal.abi3.so,
# on PYTHONPATH); maturin's packaging of it (`make py-sdk`) is checked by building its
# source distribution, which does not compile.
TEST_OUT := target/debug
PY_TEST_PATH := target/py-test
test-build: py-env
	$(CARGO) build --profile test --locked --workspace --lib --bins --examples
	mkdir -p $(PY_TEST_PATH)
	cp $(TEST_OUT)/libshoal_py.so $(PY_TEST_PATH)/shoal.abi3.so
	$(VENV)/bin/maturin sdist -m crates/shoal-py/Cargo.toml -o target/py-sdist

# The C examples (examples/c), built with the system cc against include/shoal.h and
# libshoal.so: `c-examples` against the release library into target/c (the benchmarks'),
# `c-examples-test` against the test build's into target/c-test (the Python tests').
CFLAGS ?= -O2 -g -Wall -Wextra -Werror -std=c11
c-examples: build
c-examples: LIB_DIR := target/release
c-examples: C_OUT := target/c
c-examples-test: test-build
c-examples-test: LIB_DIR := $(TEST_OUT)
c-examples-test: C_OUT := target/c-test
c-examples c-examples-test:
	mkdir -p $(C_OUT)
	cc $(CFLAGS) -Iinclude -Iexamples/c examples/c/readout.c -L$(LIB_DIR) -lshoal \
	  -Wl,-rpath,$(CURDIR)/$(LIB_DIR) -o $(C_OUT)/readout
	cc $(CFLAGS) -D_DEFAULT_SOURCE -Iexamples/c examples/c/unix_readout.c -o $(C_OUT)/unix_readout
	cc $(CFLAGS) -D_POSIX_C_SOURCE=199309L -Iinclude examples/c/submit_bench.c -L$(LIB_DIR) -lshoal -lpthread \
	  -Wl,-rpath,$(CURDIR)/$(LIB_DIR) -o $(C_OUT)/submit_bench
	cc $(CFLAGS) -shared -fPIC -Iinclude examples/c/filter/l1_filter.c -o $(C_OUT)/libl1_filter.so
	cc $(CFLAGS) -Iinclude examples/c/consumer.c -L$(LIB_DIR) -lshoal \
	  -Wl,-rpath,$(CURDIR)/$(LIB_DIR) -o $(C_OUT)/consumer
# Not an example: the connection-scaling benchmark's read-only receiver, built here so
# that it keeps compiling (scripts/conn_scaling.py builds its own).
	cc $(CFLAGS) scripts/tcp_sink.c -o $(C_OUT)/tcp_sink

test: deps lint rust-test prom-test py-test

# Debian packages the tests and benchmarks use, installed only when we are root and they
# are missing (CI runs as root on a fresh machine): chromium + chromium-driver for the
# browser test of the run-control UI, iproute2 + ethtool + nftables (injected loss) for the
# testbed tests (network namespaces; they skip when not root), prometheus (promtool for the
# alerting rules' tests, the server for tests/python/test_prometheus.py), valgrind for
# scripts/cost_instructions.py (callgrind's instruction counts), slurm-wlm + munge for
# the Slurm launch's test (crates/shoal/tests/slurm.rs), etcd-server for the Kubernetes
# launch's (crates/shoal/tests/k8s.rs), libucx-dev + ucx-utils for ucx-sys
# (it compiles without them and skips its test), xrootd-server + xrootd-client for the
# archive's XRootD destination (crates/shoal/tests/archive_xrootd.rs), the rest for the
# benchmarks' peers.
DEB_PACKAGES := chromium chromium-driver iproute2 ethtool nftables iperf3 jq redis-server bc openssh-server openssh-client iptables prometheus valgrind slurm-wlm munge etcd-server libucx-dev ucx-utils xrootd-server xrootd-client
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

# rustdoc's link check too: a link to a private or missing item is an error, as clippy's are.
# The shape checks (docs/architecture.md, "The runtime's shape"): no file circle in any
# crate, no function over 150 lines in crates/*/src.
lint:
	$(PYTHON) scripts/check_imports.py
	$(PYTHON) scripts/check_fn_length.py
	$(CARGO) fmt --all --check
	$(CARGO) clippy --locked --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --locked --no-deps --workspace

# The Python filter tests (crates/shoal-shm/tests/pyfilter.rs) run workers on the venv's
# Python (numpy).
# The Kubernetes test's kube-apiserver and kwok are built from the Go module proxy into a
# cache outside the repo (scripts/k8s_tools.sh: about 4.5 minutes cold, at once warm). With
# go on PATH (or in /usr/local/go, the upstream tarball's place) the test must run (a failed
# build fails make test); without, it says it skipped.
rust-test: py-env
	@export PATH="$$PATH:/usr/local/go/bin"; if command -v go >/dev/null; then bin=$$(scripts/k8s_tools.sh) || exit 1; require=1; \
	else echo "note: no go on PATH: the Kubernetes test (crates/shoal/tests/k8s.rs) skips"; bin=; require=0; fi; \
	echo "SHOAL_K8S_BIN=$$bin SHOAL_PYTHON=$(CURDIR)/$(PY) $(CARGO) test --locked --workspace"; \
	SHOAL_K8S_BIN=$$bin SHOAL_REQUIRE_K8S=$$require SHOAL_PYTHON=$(CURDIR)/$(PY) $(CARGO) test --locked --workspace

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

# The source SDK's Rust examples (crates/shoal-net/examples: readout, submit_bench), for
# the benchmarks (the tests run the test build's, in target/debug/examples).
rust-examples:
	$(CARGO) build --release --locked -p shoal-net --examples

# pytest exits 5 when it collects no test; that must fail loudly, not pass silently.
py-test: test-build py-env c-examples-test
	SHOAL_BIN=$(CURDIR)/$(TEST_OUT)/shoal SHOAL_C_EXAMPLES=$(CURDIR)/target/c-test \
	  SHOAL_RUST_EXAMPLES=$(CURDIR)/$(TEST_OUT)/examples PYTHONPATH=$(CURDIR)/$(PY_TEST_PATH) \
	  $(PY) -m pytest tests/python -q; \
	  rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; fi; exit $$rc

bench: build py-env
	scripts/bench-demo.sh
	scripts/bench-pubsub.sh
	scripts/bench-l1.sh

clean:
	$(CARGO) clean
	rm -rf $(VENV) shoal-out shoal-runs test-output
