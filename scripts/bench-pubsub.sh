#!/usr/bin/env bash
# shoal dispatcher (ControlHost) versus Redis pub/sub and NATS core pub/sub, measured in
# the same run:
# 1 publisher to 1, 10 and 100 subscribers, payloads of 100 B, 10 kB and 1 MB.
# Same client structure for both (crates/shoal-bench); median of REPS runs per cell.
# Prints a Markdown table for docs/benchmarks.md.
#
# usage: scripts/bench-pubsub.sh [REPS]
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
command -v redis-server >/dev/null || { echo "redis-server missing (apt-get install redis-server)"; exit 1; }
command -v nats-server >/dev/null || { echo "nats-server missing (apt-get install nats-server)"; exit 1; }
command -v jq >/dev/null || { echo "jq missing (apt-get install jq)"; exit 1; }
cargo build --release --locked -p shoal -p shoal-bench >/dev/null
tmp=$(mktemp -d)
rport=$((20000 + RANDOM % 20000)); sport=$((rport + 1)); nport=$((rport + 2))
redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
  --logfile "$tmp/redis.log" --pidfile "$tmp/redis.pid"
target/release/shoal dispatcher --listen "127.0.0.1:$sport" --http off 2>"$tmp/dispatcher.log" &
dpid=$!
nats-server -a 127.0.0.1 -p "$nport" 2>"$tmp/nats.log" &
npid=$!
trap 'kill $dpid $npid 2>/dev/null || true; kill "$(cat "$tmp/redis.pid" 2>/dev/null)" 2>/dev/null || true; rm -rf "$tmp"' EXIT
sleep 0.5

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
run() { # target subs payload -> "msgs_per_s mb_per_s" medians
  local port=$rport; [ "$1" = shoal ] && port=$sport; [ "$1" = nats ] && port=$nport
  local m=() b=()
  for _ in $(seq "$REPS"); do
    read -r x y < <(target/release/pubsub-bench --target "$1" --addr "127.0.0.1:$port" \
      --subscribers "$2" --payload "$3" | jq -r '[.msgs_per_s, .delivered_mb_per_s] | @tsv')
    m+=("$x"); b+=("$y")
  done
  echo "$(printf '%s\n' "${m[@]}" | median) $(printf '%s\n' "${b[@]}" | median)"
}

echo "| subscribers | payload | shoal msgs/s | Redis msgs/s | NATS msgs/s | shoal MB/s delivered | Redis MB/s | NATS MB/s | shoal / Redis | shoal / NATS |"
echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
for subs in 1 10 100; do
  for payload in 100 10000 1000000; do
    read -r sm sb < <(run shoal "$subs" "$payload")
    read -r rm rb < <(run redis "$subs" "$payload")
    read -r nm nb < <(run nats "$subs" "$payload")
    printf '| %s | %s | %.0f | %.0f | %.0f | %.1f | %.1f | %.1f | %.2f | %.2f |\n' "$subs" "$payload" "$sm" "$rm" "$nm" \
      "$sb" "$rb" "$nb" "$(echo "$sm / $rm" | bc -l)" "$(echo "$sm / $nm" | bc -l)"
  done
done
echo
echo "machine: $(nproc) cores, $(uname -r), $(redis-server --version | cut -d' ' -f3), nats-server $(nats-server --version | cut -d' ' -f2), window min(64 messages, 8 MiB), $(date -u +%Y-%m-%d)"
