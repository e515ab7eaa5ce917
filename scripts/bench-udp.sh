#!/usr/bin/env bash
# UDP versus TCP through the embedded chain on loopback (issue 13), beside iperf3 measured in
# the same run: one TCP stream, and UDP at full speed with 1472-byte datagrams (the size of
# shoal's: 1420 bytes of piece plus its 52-byte header). For shoal: goodput (bytes the
# builders received per second of arrivals), CPU seconds per GB moved (the whole process:
# generation from a replay pool, both ends of the transport, assembly; no filter), slices
# complete, and the transport's own counts (recovered, damaged, lost). Each figure is the
# median of REPS runs; every run's ledger must balance. Prints a Markdown table.
#
# usage: scripts/bench-udp.sh [REPS] [SECONDS] [SOURCES] [BUILDERS]
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
SECS=${2:-5}
NSRC=${3:-30}
NBLD=${4:-10}
SHOAL=target/release/shoal
command -v iperf3 >/dev/null || { echo "iperf3 missing (apt-get install iperf3)"; exit 1; }
command -v jq >/dev/null || { echo "jq missing (apt-get install jq)"; exit 1; }
cargo build --release --locked -p shoal >/dev/null
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
m() { printf '%s\n' "$@" | median; }

port=$((20000 + RANDOM % 20000))
iperf3 -s -B 127.0.0.1 -p "$port" >/dev/null 2>&1 &
# The server is up when a client gets through (bounded).
for _ in $(seq 50); do iperf3 -c 127.0.0.1 -p "$port" -n 1K >/dev/null 2>&1 && break; sleep 0.1; done
iperf_tcp() { iperf3 -c 127.0.0.1 -p "$port" -t "$SECS" -J | jq '.end.sum_received.bits_per_second / 8 / 1e6'; }
iperf_udp() { # -> "MB/s lost%"; a UDP test at full speed now and then ends in an iperf3
  # error (its control connection starved): tried again, at most 3 times.
  local j
  for _ in 1 2 3; do
    j=$(iperf3 -c 127.0.0.1 -p "$port" -t "$SECS" -u -b 0 -l 1472 -J || true)
    if jq -e '.end.sum.bits_per_second' >/dev/null 2>&1 <<<"$j"; then
      jq -r '[.end.sum.bits_per_second * (1 - .end.sum.lost_percent / 100) / 8 / 1e6, .end.sum.lost_percent] | @tsv' <<<"$j"
      return
    fi
    echo "iperf3 UDP: $(jq -r '.error // "no result"' <<<"$j" 2>/dev/null); again" >&2
  done
  echo "iperf3 UDP failed 3 times" >&2
  exit 1
}

cfg="$tmp/bench.toml"
printf '[source]\nreplay_pool = 16\n[builder.filter]\nname = "none"\n' >"$cfg"
demo() { # transport -> "MBps complete% unaccounted recovered damaged lost_in_transport cpu_s_per_GB"
  local out="$tmp/out-$1"
  /usr/bin/time -f '%U %S' -o "$tmp/time" "$SHOAL" demo --seconds "$SECS" --sources "$NSRC" --builders "$NBLD" \
    --policy delayed:8 --transport "$1" --config "$cfg" --out "$out" --json >"$tmp/json" 2>/dev/null
  local cpu
  cpu=$(awk '{print $1 + $2}' "$tmp/time")
  jq -r --arg cpu "$cpu" '[.mbytes_per_s,
      (100 * .slices_complete / (.slices_complete + .slices_incomplete)),
      .ledger.unaccounted,
      (.ledger.buckets.recovered // 0), (.ledger.buckets.damaged // 0), (.ledger.buckets.lost_in_transport // 0),
      (($cpu | tonumber) / (.bytes_received / 1e9))] | @tsv' "$tmp/json"
}

declare -a it iu iul tm tc tcpu um uc ucpu urec udam ulost
for r in $(seq "$REPS"); do
  it+=("$(iperf_tcp)")
  read -r mb lost < <(iperf_udp)
  iu+=("$mb"); iul+=("$lost")
  read -r mb pct un _ _ _ cpu < <(demo tcp)
  [ "$un" = 0 ] || { echo "ledger unbalanced (tcp, run $r)"; exit 1; }
  tm+=("$mb"); tc+=("$pct"); tcpu+=("$cpu")
  read -r mb pct un rec dam lost cpu < <(demo udp)
  [ "$un" = 0 ] || { echo "ledger unbalanced (udp, run $r)"; exit 1; }
  um+=("$mb"); uc+=("$pct"); ucpu+=("$cpu"); urec+=("$rec"); udam+=("$dam"); ulost+=("$lost")
done
echo "| measurement (median of $REPS, ${SECS} s each) | MB/s | CPU s per GB | complete slices | recovered / damaged / lost fragments |"
echo "| --- | ---: | ---: | ---: | ---: |"
printf '| iperf3 loopback, 1 TCP stream | %.0f | - | - | - |\n' "$(m "${it[@]}")"
printf '| iperf3 loopback, UDP 1472-byte datagrams, full speed (%.1f%% lost) | %.0f | - | - | - |\n' "$(m "${iul[@]}")" "$(m "${iu[@]}")"
printf '| shoal demo %sx%s delayed:8 over TCP | %.0f | %.2f | %.1f%% | - |\n' "$NSRC" "$NBLD" "$(m "${tm[@]}")" "$(m "${tcpu[@]}")" "$(m "${tc[@]}")"
printf '| shoal demo %sx%s delayed:8 over UDP (NACK) | %.0f | %.2f | %.1f%% | %s / %s / %s |\n' "$NSRC" "$NBLD" "$(m "${um[@]}")" "$(m "${ucpu[@]}")" "$(m "${uc[@]}")" "$(m "${urec[@]}")" "$(m "${udam[@]}")" "$(m "${ulost[@]}")"
