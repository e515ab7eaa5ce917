#!/usr/bin/env bash
# The burst saver under full load: an embedded run of SOURCES x BUILDERS (default 100 x 30,
# delayed:8, physics fragments from a replay pool: each builder receives about 9 MB/s, the
# rate of an ANTARES builder, and the 2-core machine runs at its limit) with the saver
# off, on, and on with an alert near the end of the run for a window that ended LAG
# seconds before. Slice completeness must not change with the alert, and resident memory
# must stay within the configured bounds (the saver's history: saver.embedded_max_mb =
# HISTORY_MB shared by the builders of the process).
#
# Each figure is the median of REPS runs. Prints a Markdown table.
#
# usage: SOURCES=100 BUILDERS=30 LAG=5 scripts/bench-alert.sh [REPS] [SECONDS] [HISTORY_MB]
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
SECS=${2:-30}
HISTORY_MB=${3:-3072}
SOURCES=${SOURCES:-100}
BUILDERS=${BUILDERS:-30}
LAG=${LAG:-5}
SHOAL=target/release/shoal
command -v jq >/dev/null || { echo "jq missing (apt-get install jq)"; exit 1; }
cargo build --release --locked -p shoal >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

printf '[source]\nreplay_pool = 16\n[saver]\nenabled = false\n' >"$tmp/off.toml"
printf '[source]\nreplay_pool = 16\n[saver]\nembedded_max_mb = %s\n' "$HISTORY_MB" >"$tmp/on.toml"
# The alert: 5 s before the end, for a 4-s window that ended LAG s earlier.
AT=$(echo "$SECS - 5" | bc)
demo() { # config extra-args -> "MBps complete_pct rss_mb held_max_mb alert_fragments evicted unaccounted"
  local cfg=$1
  shift
  "$SHOAL" demo --config "$tmp/$cfg.toml" --seconds "$SECS" --sources "$SOURCES" --builders "$BUILDERS" --policy delayed:8 \
    --out "$tmp/out" --json "$@" 2>/dev/null |
    jq -r '[.mbytes_per_s, (100 * .slices_complete / (.slices_complete + .slices_incomplete)), .peak_rss_mb,
            ([.builder_reports[].saver.held_bytes_max // 0] | add / 1e6),
            ([.writer.alerts[]?.fragments_saved] | add // 0),
            ([.writer.alerts[]? | select(.partly_evicted)] | length),
            .ledger.unaccounted] | @tsv'
}
declare -A mb pct rss held frag ev
for r in $(seq "$REPS"); do
  for mode in off on alert; do
    case $mode in
      off) line=$(demo off) ;;
      on) line=$(demo on) ;;
      alert) line=$(demo on --alert-at "$AT" --alert-window 4 --alert-lag "$LAG") ;;
    esac
    read -r a b c d e f un <<<"$line"
    [ "$un" = 0 ] || { echo "ledger unbalanced ($mode, run $r)"; exit 1; }
    mb[$mode]+="$a "; pct[$mode]+="$b "; rss[$mode]+="$c "; held[$mode]+="$d "; frag[$mode]+="$e "; ev[$mode]+="$f "
  done
done
m() { printf '%s\n' $1 | median; }
echo "| ${SOURCES}x${BUILDERS} delayed:8, ${SECS} s (median of $REPS) | MB/s | complete slices | peak resident MB | history held (max, MB) | alert: fragments saved | alerts partly evicted |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
for mode in off on alert; do
  case $mode in
    off) name="saver off" ;;
    on) name="saver on (history bound ${HISTORY_MB} MiB)" ;;
    alert) name="saver on, alert at ${AT} s for 4 s ending ${LAG} s before" ;;
  esac
  printf '| %s | %.0f | %.1f%% | %.0f | %.0f | %s | %s |\n' "$name" "$(m "${mb[$mode]}")" "$(m "${pct[$mode]}")" \
    "$(m "${rss[$mode]}")" "$(m "${held[$mode]}")" "$(m "${frag[$mode]}")" "$(m "${ev[$mode]}")"
done
