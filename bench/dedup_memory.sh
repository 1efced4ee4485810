#!/usr/bin/env bash
# Memory and disk per retained idempotency record: a release `tallyd` (one node)
# takes N unique idempotent increments on one `sync` counter over the Redis
# protocol, and its RSS and data directory are sampled as the records accumulate.
#
#   bench/dedup_memory.sh [--ids N] [--mode ids|seq] [--shards S] [--connections C]
#                         [--pipeline K] [--every SECONDS] [--out FILE] [--tallyd PATH]
#
#   --mode ids  every increment carries a new event id (N records retained)
#   --mode seq  C*K writers each send their next sequence number (C*K marks)
#
# Defaults: 10,000,000 ids, 16 shards, 32 connections, pipelines of 64, a sample
# every 10 s, CSV to stdout. Builds `tallyd` unless BENCH_NO_BUILD=1 or --tallyd is
# given. Prints a summary (bytes per retained record in RAM and on disk) at the end.
# Run it under `nice -n 10` on a shared machine.
set -euo pipefail

BENCH=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$BENCH")
# shellcheck source=lib/common.sh
source "$BENCH/lib/common.sh"
# shellcheck source=lib/servers.sh
source "$BENCH/lib/servers.sh"

IDS=10000000
MODE=ids
SHARDS=16
CONNECTIONS=32
PIPELINE=64
EVERY=10
OUT=/dev/stdout
TALLYD=""
while (($#)); do
  case $1 in
    --ids) IDS=$2; shift ;;
    --mode) MODE=$2; shift ;;
    --shards) SHARDS=$2; shift ;;
    --connections) CONNECTIONS=$2; shift ;;
    --pipeline) PIPELINE=$2; shift ;;
    --every) EVERY=$2; shift ;;
    --out) OUT=$2; shift ;;
    --tallyd) TALLYD=$2; shift ;;
    -h | --help)
      sed -n "2,15p" "$0"
      exit 0
      ;;
    *) die "unknown argument $1 (try --help)" ;;
  esac
  shift
done
for tool in curl; do
  command -v "$tool" >/dev/null || die "missing $tool"
done
if [[ -z $TALLYD ]]; then
  target=${CARGO_TARGET_DIR:-$REPO/target}
  if [[ ${BENCH_NO_BUILD:-0} != 1 ]]; then
    (cd "$REPO" && cargo build --release --bin tallyd)
  fi
  TALLYD=$target/release/tallyd
fi

TMP_ROOT=$(mktemp -d "${BENCH_TMPDIR:-/var/tmp}/tally-dedup.XXXXXX")
trap 'stop_all; rm -rf "$TMP_ROOT"' EXIT

start_tally_single
DATA=$(echo "$TMP_ROOT"/tally1.*/data)
COUNTER=bench:dedup
curl -fsS -X PUT "$TALLY_URLS/v1/counters/$COUNTER" \
  --json "{\"durability\": \"sync\", \"shards\": $SHARDS}" >/dev/null
log "feeding $IDS increments ($MODE) to $COUNTER ($SHARDS shards, sync) over $CONNECTIONS connections"
"$PY" "$BENCH/lib/dedup_feed.py" --port "$TALLY_RESP_PORT" --pid "$TALLY_PIDS" --data-dir "$DATA" \
  --counter "$COUNTER" --ids "$IDS" --mode "$MODE" --connections "$CONNECTIONS" \
  --pipeline "$PIPELINE" --every "$EVERY" | tee "$TMP_ROOT/samples.csv" >"$OUT"
# A quiet minute: background work (sled's page-out, segment cleaning) settles.
sleep 60
value=$(curl -fsS "$TALLY_URLS/v1/counters/$COUNTER/value?consistency=fresh")
final_rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$TALLY_PIDS/status")
final_disk=$(du -sb "$DATA" | cut -f1)
"$PY" - "$TMP_ROOT/samples.csv" "$IDS" "$MODE" "$final_rss" "$final_disk" "$value" "$((CONNECTIONS * PIPELINE))" <<'PYEOF'
import csv, json, sys
path, ids, mode, rss, disk, value, writers = sys.argv[1:]
rows = list(csv.DictReader(open(path)))
first, last = rows[0], rows[-1]
ids, rss, disk, writers = int(ids), int(rss), int(disk), int(writers)
peak = max(int(r["rss_kb"]) for r in rows)
records = ids if mode == "ids" else writers
secs = float(last["seconds"])
print(f"# mode={mode} increments={ids} records_retained={records} seconds={secs:.0f} rate={ids / secs:,.0f}/s")
print(f"# acked={last['acked']} duplicates={last['duplicates']} errors={last['errors']} value={json.loads(value)['value']}")
print(f"# rss_kb start={first['rss_kb']} peak={peak} end={last['rss_kb']} after_60s={rss}")
print(f"# disk_bytes start={first['disk_bytes']} end={last['disk_bytes']} after_60s={disk}")
ram = (rss - int(first["rss_kb"])) * 1024
print(f"# per increment: RAM {ram / ids:.1f} B, disk {(disk - int(first['disk_bytes'])) / ids:.1f} B")
print(f"# per retained record: RAM {ram / records:.1f} B, disk {(disk - int(first['disk_bytes'])) / records:.1f} B")
PYEOF
