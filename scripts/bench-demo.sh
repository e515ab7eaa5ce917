#!/usr/bin/env bash
# Throughput of the embedded chain at full ANTARES shape (300 sources x 100 builders,
# delayed:8; the live generator also as it completes: delayed:8:2 with the run's memory
# mapped before it, run.prefault_mb) beside the physical references measured in the same run:
#   - the nominal detector rate (300 boards x 3 MB/s = 900 MB/s);
#   - iperf3 over loopback, one TCP stream and 8 parallel streams, on this machine now.
# Each figure is the median of REPS runs. Prints a Markdown table for docs/benchmarks.md.
#
# usage: scripts/bench-demo.sh [REPS] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
SECS=${2:-5}
SHOAL=target/release/shoal
command -v iperf3 >/dev/null || { echo "iperf3 missing (apt-get install iperf3)"; exit 1; }
command -v jq >/dev/null || { echo "jq missing (apt-get install jq)"; exit 1; }
cargo build --release --locked -p shoal >/dev/null
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

port=$((20000 + RANDOM % 20000))
iperf3 -s -B 127.0.0.1 -p "$port" >/dev/null 2>&1 &
sleep 0.5
iperf() { # streams -> MB/s
  iperf3 -c 127.0.0.1 -p "$port" -t "$SECS" -P "$1" -J | jq '.end.sum_received.bits_per_second / 8 / 1e6'
}

# 100 builders in one process: each builder's default 512 MiB would make the plan 50 GiB,
# over the memory budget (half of this machine). 64 MiB each holds a slice's 300 fragments
# many times over and is what every earlier row ran with (left unset, the demo would give
# each builder a share of its budget: 48 MiB on a 24-GiB machine). Nothing is mapped before
# the run except where the row says so (left unset, the demo would map 6 s of the offered
# data: shoal_net::budget::auto_prefault).
live_cfg="$tmp/live.toml"
printf '[run]\nprefault_mb = 0\n[builder]\nmemory_budget_mb = 64\n' >"$live_cfg"
pool_cfg="$tmp/pool.toml"
printf '[run]\nprefault_mb = 0\n[source]\nreplay_pool = 16\n[builder]\nmemory_budget_mb = 64\n' >"$pool_cfg"
live_pf_cfg="$tmp/live-prefault.toml"
printf '[run]\nprefault_mb = 4096\n[builder]\nmemory_budget_mb = 64\n' >"$live_pf_cfg"
nofilter_cfg="$tmp/nofilter.toml"
printf '[run]\nprefault_mb = 0\n[source]\nreplay_pool = 16\n[builder]\nmemory_budget_mb = 64\n[builder.filter]\nname = "none"\n' >"$nofilter_cfg"
demo() { # policy, extra args -> "MBps complete_pct unaccounted"
  local policy=$1
  shift
  "$SHOAL" demo --seconds "$SECS" --sources 300 --builders 100 --policy "$policy" \
    --out "$tmp/out" --json "$@" 2>"$tmp/stderr" |
    jq -r '[.mbytes_per_s, (100 * .slices_complete / (.slices_complete + .slices_incomplete)), .ledger.unaccounted] | @tsv'
}

check() { # the run's summary came and its ledger balanced, or stop with why
  [ -n "${mb:-}" ] || { echo "shoal demo failed in run $1:"; tail -5 "$tmp/stderr"; exit 1; }
  [ "$un" = 0 ] || { echo "ledger unbalanced in run $1"; exit 1; }
}
declare -a i1 i8 live pool livec poolc nof nofc livepf livepfc
for r in $(seq "$REPS"); do
  i1+=("$(iperf 1)")
  i8+=("$(iperf 8)")
  mb=""; read -r mb pct un < <(demo delayed:8 --config "$live_cfg") || true
  check "$r"
  live+=("$mb"); livec+=("$pct")
  mb=""; read -r mb pct un < <(demo delayed:8:2 --config "$live_pf_cfg") || true
  check "$r"
  livepf+=("$mb"); livepfc+=("$pct")
  mb=""; read -r mb pct un < <(demo delayed:8 --config "$pool_cfg") || true
  check "$r"
  pool+=("$mb"); poolc+=("$pct")
  mb=""; read -r mb pct un < <(demo delayed:8 --config "$nofilter_cfg") || true
  check "$r"
  nof+=("$mb"); nofc+=("$pct")
done
m() { printf '%s\n' "$@" | median; }
echo "| measurement (median of $REPS, ${SECS} s each) | MB/s | complete slices |"
echo "| --- | ---: | ---: |"
printf '| nominal ANTARES 10-string rate (300 x 3 MB/s) | 900 | - |\n'
printf '| iperf3 loopback, 1 TCP stream | %.0f | - |\n' "$(m "${i1[@]}")"
printf '| iperf3 loopback, 8 TCP streams | %.0f | - |\n' "$(m "${i8[@]}")"
printf '| shoal demo 300x100 delayed:8, live generator | %.0f | %.1f%% |\n' "$(m "${live[@]}")" "$(m "${livec[@]}")"
printf '| shoal demo 300x100 delayed:8:2, live generator, prefault_mb 4096 | %.0f | %.1f%% |\n' "$(m "${livepf[@]}")" "$(m "${livepfc[@]}")"
printf '| shoal demo 300x100 delayed:8, replay pool (no generator cost) | %.0f | %.1f%% |\n' "$(m "${pool[@]}")" "$(m "${poolc[@]}")"
printf '| shoal demo 300x100 delayed:8, replay pool, filter none (transport + assembly only) | %.0f | %.1f%% |\n' "$(m "${nof[@]}")" "$(m "${nofc[@]}")"
echo
echo "machine: $(nproc) cores, $(uname -r), $(date -u +%Y-%m-%d)"
