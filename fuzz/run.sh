#!/usr/bin/env bash
# Runs every fuzz target (or those named) for a number of inputs or seconds.
#
#   fuzz/run.sh short [TARGET...]   # FUZZ_SECONDS (default 10) per target: the CI run
#   fuzz/run.sh long  [TARGET...]   # FUZZ_RUNS (default 10,000,000) inputs per target
#
# Needs cargo-fuzz (installed here from crates.io when missing) and nothing else: with
# no sanitizer, cargo-fuzz's instrumentation is made of stable compiler flags
# (`-Cpasses=sancov-module` and LLVM options), so the machine's one stable toolchain
# builds it. Every run
# fails on a panic, a single allocation above MALLOC_LIMIT_MB or a resident size above
# RSS_LIMIT_MB; the input that failed is left in fuzz/artifacts/TARGET/.
set -euo pipefail
cd "$(dirname "$0")"
mode="${1:-short}"
shift || true
targets=("$@")
[ "${#targets[@]}" -gt 0 ] || targets=(wire store_records http_input node_config resp)
# The largest value the codec decodes is tally_core::codec::DECODE_BYTES_MAX = 64 MiB;
# no single allocation may exceed it (plus the allocator's slack).
MALLOC_LIMIT_MB="${MALLOC_LIMIT_MB:-80}"
RSS_LIMIT_MB="${RSS_LIMIT_MB:-1024}"

command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz

# No sanitizer: the workspace denies `unsafe`, so what the fuzzer looks for is panics,
# overflows (release builds keep overflow checks) and allocations; ASan would double the
# build and halve the speed for memory errors safe Rust cannot make.
flags=(-O -s none)
cargo fuzz build "${flags[@]}"
case "$mode" in
  short) limit=(-max_total_time="${FUZZ_SECONDS:-10}") ;;
  long) limit=(-runs="${FUZZ_RUNS:-10000000}") ;;
  *) echo "usage: fuzz/run.sh short|long [TARGET...]" >&2; exit 2 ;;
esac
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  echo "=== fuzz $t ($mode)"
  log="logs/$t.log"
  mkdir -p logs
  status=0
  cargo fuzz run "${flags[@]}" "$t" "corpus/$t" -- "${limit[@]}" \
    -malloc_limit_mb="$MALLOC_LIMIT_MB" -rss_limit_mb="$RSS_LIMIT_MB" -print_final_stats=1 >"$log" 2>&1 || status=$?
  # The figures (inputs run, inputs per second, peak memory); the whole output is in $log.
  grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb)' "$log" || true
  if [ "$status" -ne 0 ]; then
    tail -40 "$log" >&2
    echo "fuzz $t failed (status $status); the input is in fuzz/artifacts/$t/" >&2
    exit 1
  fi
done
