#!/usr/bin/env bash
# L1 and full-trigger throughput on one core (divan) beside the numpy baseline, same run.
# Usage: scripts/bench-l1.sh   (needs the .venv of `make test` for numpy)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
echo "== numpy baseline (global sort + neighbour differences)"
"$PY" scripts/l1_numpy.py
echo "== shoal (cargo bench -p shoal-trigger --bench trigger)"
cargo bench --locked -p shoal-trigger --bench trigger 2>&1 | grep -v "^\s*Compiling\|^\s*Finished\|^\s*Running"
echo "== numpy baseline again (the machine is shared: compare the two numpy runs too)"
"$PY" scripts/l1_numpy.py
