#!/usr/bin/env bash
# Fresh reads of a replicated counter while sync writers run: a fresh 3-node cluster
# with `replicas = 3` (bench/lib/servers.sh), a sync counter of 64 shards, WRITERS
# `tally load` writers spread over the nodes, and one reader asking node 1 for the
# fresh total back to back for SECONDS; prints the reads' count and latency
# percentiles, then the writers' rate.
#
#   bench/replicated_fresh_reads.sh [--writers N] [--seconds S]
#
# Uses the release `tallyd` and `tally` of CARGO_TARGET_DIR (default target/); builds
# them unless BENCH_NO_BUILD=1.
set -euo pipefail

BENCH=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$BENCH")
# shellcheck source=lib/common.sh
source "$BENCH/lib/common.sh"
# shellcheck source=lib/servers.sh
source "$BENCH/lib/servers.sh"

WRITERS=16
SECONDS_READ=10
while (($#)); do
  case $1 in
    --writers)
      WRITERS=$2
      shift
      ;;
    --seconds)
      SECONDS_READ=$2
      shift
      ;;
    -h | --help)
      sed -n "2,11p" "$0"
      exit 0
      ;;
    *) die "unknown argument $1 (try --help)" ;;
  esac
  shift
done
target=${CARGO_TARGET_DIR:-$REPO/target}
if [[ ${BENCH_NO_BUILD:-0} != 1 ]]; then
  (cd "$REPO" && cargo build --release --bin tallyd --bin tally)
fi
TALLYD=$target/release/tallyd
TALLY=$target/release/tally
TMP_ROOT=$(mktemp -d "${BENCH_TMPDIR:-/var/tmp}/tally-fresh-reads.XXXXXX")
trap 'stop_all; rm -rf "$TMP_ROOT"' EXIT

start_tally_cluster 3
url=${TALLY_URLS%% *}
tally_create "$url" hot --shards 64 --durability sync
"$TALLY" --node "$url" load hot --writers "$WRITERS" --batch 1 --duration "$((SECONDS_READ + 4))s" \
  --no-progress --nodes "${TALLY_URLS// /,}" >"$TMP_ROOT/load.txt" 2>&1 &
load_pid=$!
sleep 2
"$PY" - "$url" "$SECONDS_READ" <<'PY'
import sys, time, urllib.request

url = sys.argv[1] + "/v1/counters/hot/value?consistency=fresh"
seconds = float(sys.argv[2])
lat = []
end = time.time() + seconds
while time.time() < end:
    t = time.time()
    with urllib.request.urlopen(url, timeout=10) as r:
        r.read()
    lat.append((time.time() - t) * 1000)
lat.sort()
q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
print(f"fresh reads: {len(lat)} in {seconds:g} s, p50 {q(0.5):.1f} ms, p99 {q(0.99):.1f} ms, max {lat[-1]:.1f} ms")
PY
wait "$load_pid" || true
grep -E "acknowledged|throughput" "$TMP_ROOT/load.txt"
