#!/usr/bin/env bash
# The fuzzing campaign (issue 16): every target in fuzz/ (bodies in crates/shoal-fuzz) for
# RUNS executions (default 10 million) with libFuzzer, starting from and adding to the
# committed corpus (fuzz/corpus/<target>), which is then minimised (cargo fuzz cmin).
# Crashes land in fuzz/artifacts/<target>/; copy each into fuzz/regressions/<target>/ (the
# stable test in crates/shoal-fuzz replays them in `make test`) and fix the decoder.
# Prints a Markdown table: target, executions, seconds, exec/s, coverage (libFuzzer's
# `cov` edges and `ft` features), corpus size, findings.
#
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`).
# usage: scripts/fuzz.sh [RUNS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-10000000}
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  mapfile -t TARGETS < <(ls fuzz/fuzz_targets | sed 's/\.rs$//')
fi
cargo +nightly fuzz build -O >/dev/null 2>&1 || cargo +nightly fuzz build -O
echo "| target | executions | seconds | exec/s | cov | ft | corpus files | findings |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
for t in "${TARGETS[@]}"; do
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  log=$(mktemp)
  start=$(date +%s)
  # -rss_limit_mb: the decoders are bounded; a run that grows past 2 GB is a finding.
  cargo +nightly fuzz run -O "$t" "fuzz/corpus/$t" -- -runs="$RUNS" -rss_limit_mb=2048 \
    -max_len=4096 -print_final_stats=1 >"$log" 2>&1 || true
  secs=$(( $(date +%s) - start ))
  done_line=$(grep -E '^#[0-9]+.*DONE' "$log" | tail -1 || true)
  [ -n "$done_line" ] || done_line=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  execs=$(sed -E 's/^#([0-9]+).*/\1/' <<<"$done_line")
  cov=$(grep -oE 'cov: [0-9]+' <<<"$done_line" | awk '{print $2}')
  ft=$(grep -oE 'ft: [0-9]+' <<<"$done_line" | awk '{print $2}')
  findings=$(find "fuzz/artifacts/$t" -type f | wc -l)
  cargo +nightly fuzz cmin -O "$t" "fuzz/corpus/$t" >/dev/null 2>&1 || true
  files=$(find "fuzz/corpus/$t" -type f | wc -l)
  echo "| $t | ${execs:-?} | $secs | $(( ${execs:-0} / (secs > 0 ? secs : 1) )) | ${cov:-?} | ${ft:-?} | $files | $findings |"
  if [ "$findings" -gt 0 ]; then tail -40 "$log" >&2; fi
  rm -f "$log"
done
