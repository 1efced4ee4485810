#!/usr/bin/env bash
# Where a node's CPU goes on the hot paths: `perf record -g` on a release `tallyd`
# while one load generator drives it, then the top frames (self time, and children)
# of each run.
#
#   bench/profile.sh [--out DIR] [--seconds S] [--only resp,resp-pipe,http,http-sync,sync-r3]
#
# Workloads (each against a fresh node or cluster, 64 connections):
#   resp       redis-benchmark -c 64 INCR on a batched counter of 64 shards
#   resp-pipe  the same with -P 16
#   resp-new   redis-benchmark -c 64 INCR on never-seen counters (a random key each)
#   resp-many  the same over 1,000 counters that exist and are active
#   http       wrk: single POST /v1/counters/NAME/increments on a batched counter
#   http-sync  wrk: the same on a sync counter with event ids
#   sync-r3    tally load --writers 64 --batch 1 on a sync counter of 64 shards of a
#              3-node cluster with replicas = 3 (bench/run.sh's tally3r cluster),
#              writers spread over the nodes; node 1 is recorded (not run by default)
# Needs perf (Debian linux-perf), redis-benchmark (redis-tools) and wrk; builds
# `tallyd` and `tally` unless BENCH_NO_BUILD=1. Results: DIR/<workload>.txt (perf
# report) and DIR/<workload>.rate (the load generator's summary); DIR defaults to
# bench/results/profile. BENCH_PERF_RECORD replaces perf record's flags (default
# `-F 999 -g`; `-F 499 --call-graph dwarf,16384` for full stacks).
set -euo pipefail

BENCH=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$BENCH")
# shellcheck source=lib/common.sh
source "$BENCH/lib/common.sh"
# shellcheck source=lib/servers.sh
source "$BENCH/lib/servers.sh"

OUT=$BENCH/results/profile
SECONDS_PER_RUN=8
ONLY="resp resp-pipe resp-new resp-many http http-sync"
while (($#)); do
  case $1 in
    --out)
      OUT=$2
      shift
      ;;
    --seconds)
      SECONDS_PER_RUN=$2
      shift
      ;;
    --only)
      ONLY=${2//,/ }
      shift
      ;;
    -h | --help)
      sed -n "2,22p" "$0"
      exit 0
      ;;
    *) die "unknown argument $1 (try --help)" ;;
  esac
  shift
done
for tool in perf redis-benchmark redis-cli wrk curl; do
  command -v "$tool" >/dev/null || die "missing $tool (apt-get install linux-perf redis-tools wrk curl)"
done
target=${CARGO_TARGET_DIR:-$REPO/target}
if [[ ${BENCH_NO_BUILD:-0} != 1 ]]; then
  (cd "$REPO" && cargo build --release --bin tallyd --bin tally)
fi
TALLYD=$target/release/tallyd
TALLY=$target/release/tally
mkdir -p "$OUT"
TMP_ROOT=$(mktemp -d "${BENCH_TMPDIR:-/var/tmp}/tally-profile.XXXXXX")
trap 'stop_all; rm -rf "$TMP_ROOT"' EXIT

# One single node on fresh ports and a fresh data directory (`start_tally_single`).
start_node() {
  start_tally_single
  NODE_PID=$TALLY_PIDS
  URL=$TALLY_URLS
  RESP_PORT=$TALLY_RESP_PORT
}

# profile NAME CMD...: perf record on the node while CMD runs, then the report.
profile() {
  local name=$1
  shift
  log "$name: $*"
  # shellcheck disable=SC2086 # the flags are words
  perf record ${BENCH_PERF_RECORD:--F 999 -g} -p "$NODE_PID" -o "$TMP_ROOT/$name.data" -- sleep "$((SECONDS_PER_RUN + 1))" \
    2>"$TMP_ROOT/$name.perf.log" &
  local perf_pid=$!
  sleep 0.5
  "$@" >"$OUT/$name.rate" 2>&1 || true
  wait "$perf_pid" || true
  {
    echo "# $*"
    echo "## self time, by symbol"
    perf report -i "$TMP_ROOT/$name.data" --no-children --sort dso,symbol --stdio -g none 2>/dev/null |
      grep -v '^#' | grep -v '^$' | sed 's/[ -]*$//' | head -40 || true
    echo "## with children (inclusive), by symbol"
    perf report -i "$TMP_ROOT/$name.data" --children --sort symbol --stdio -g none 2>/dev/null |
      grep -v '^#' | grep -v '^$' | sed 's/[ -]*$//' | head -60 || true
    echo "## by shared object"
    perf report -i "$TMP_ROOT/$name.data" --no-children --sort dso --stdio -g none 2>/dev/null |
      grep -v '^#' | grep -v '^$' | sed 's/[ -]*$//' | head -12 || true
  } >"$OUT/$name.txt"
  tr '\r' '\n' <"$OUT/$name.rate" | grep -E 'rps=|requests per second|Requests/sec|Latency' | tail -n 3 >&2 || true
}

WRK_LUA=$BENCH/lib/wrk-increment.lua
WRK_SYNC_LUA=$BENCH/lib/wrk-increment-ids.lua

for w in $ONLY; do
  if [[ $w == sync-r3 ]]; then
    start_tally_cluster 3
    NODE_PID=${TALLY_PIDS%% *}
    tally_create "${TALLY_URLS%% *}" hot --shards 64 --durability sync
    profile "$w" timeout "$((SECONDS_PER_RUN + 30))" "$TALLY" --node "${TALLY_URLS%% *}" --timeout-ms 10000 \
      load hot --writers 64 --batch 1 --duration "${SECONDS_PER_RUN}s" --no-progress --nodes "${TALLY_URLS// /,}"
    stop_tally
    continue
  fi
  start_node "$w"
  case $w in
    resp | resp-pipe)
      redis-cli -p "$RESP_PORT" TALLY.CREATE hot SHARDS 64 DURABILITY batched >/dev/null
      pipe=1
      [[ $w == resp-pipe ]] && pipe=16
      # requests enough to outlast the recording; the recording is what is measured
      profile "$w" timeout "$SECONDS_PER_RUN" redis-benchmark -p "$RESP_PORT" -c 64 -P "$pipe" \
        -n 100000000 INCR hot
      ;;
    resp-new)
      profile "$w" timeout "$SECONDS_PER_RUN" redis-benchmark -p "$RESP_PORT" -c 64 -r 1000000000 \
        -n 100000000 INCR new:__rand_int__
      ;;
    resp-many)
      redis-benchmark -p "$RESP_PORT" -c 64 -r 1000 -n 200000 -q INCR many:__rand_int__ >/dev/null
      profile "$w" timeout "$SECONDS_PER_RUN" redis-benchmark -p "$RESP_PORT" -c 64 -r 1000 \
        -n 100000000 INCR many:__rand_int__
      ;;
    http)
      curl -fsS -X PUT "$URL/v1/counters/hot" -H 'content-type: application/json' \
        -d '{"shards": 64}' -o /dev/null
      profile "$w" wrk -t 2 -c 64 -d "${SECONDS_PER_RUN}s" --latency -s "$WRK_LUA" "$URL/v1/counters/hot/increments"
      ;;
    http-sync)
      curl -fsS -X PUT "$URL/v1/counters/hot" -H 'content-type: application/json' \
        -d '{"shards": 64, "durability": "sync"}' -o /dev/null
      profile "$w" wrk -t 2 -c 64 -d "${SECONDS_PER_RUN}s" --latency -s "$WRK_SYNC_LUA" \
        "$URL/v1/counters/hot/increments"
      ;;
    *) die "unknown workload $w" ;;
  esac
  stop_pid "$NODE_PID" TERM 30
done
log "done: $OUT/*.txt"
