#!/usr/bin/env bash
# Tally side by side with a PostgreSQL row counter and Redis INCR, measured on this
# machine in one run. See bench/README.md.
#
#   bench/run.sh            the full suite (about 12 minutes), results in bench/results/
#   bench/run.sh --quick    a smoke run (1-2 minutes), results in bench/results/quick/
#
# Options (mostly for working on the suite itself):
#   --only SECTIONS   comma-separated subset of: postgres,redis,tally1,tally3,tally3r,reads,
#                     sketch,resp (tally3r: the 3-node cluster with replicas = 3), or
#                     scale (memory, disk and restarts per retained event id, one copy
#                     and three; not in the default run: see bench/lib/scale.sh)
#   --out DIR         where results go
# Environment: BENCH_DURATION_S, BENCH_WRITERS ("1 8 64 256"), BENCH_TMPDIR (default
# /var/tmp; data directories must be on a real disk, fsync on tmpfs is free),
# BENCH_KEEP_TMP=1 keeps data directories and server logs, BENCH_NO_BUILD=1 skips
# `cargo build`, CARGO_TARGET_DIR picks the build directory, BENCH_RANGES_PER_NODE
# sets the clusters' `ranges_per_node` (range groups per node with replicas > 1).
set -euo pipefail

BENCH=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$BENCH")
# shellcheck source=lib/common.sh
source "$BENCH/lib/common.sh"
# shellcheck source=lib/servers.sh
source "$BENCH/lib/servers.sh"
# shellcheck source=lib/scale.sh
source "$BENCH/lib/scale.sh"

MODE=full
SECTIONS="postgres redis tally1 tally3 tally3r reads sketch resp"
OUT=""
while (($#)); do
  case $1 in
    --quick) MODE=quick ;;
    --only)
      SECTIONS=${2//,/ }
      shift
      ;;
    --out)
      OUT=$2
      shift
      ;;
    -h | --help)
      sed -n '2,18p' "$0"
      exit 0
      ;;
    *) die "unknown argument $1 (try --help)" ;;
  esac
  shift
done

# The scale section alone keeps its results apart (it writes no cells for the report).
if [[ $SECTIONS == scale && -z $OUT ]]; then OUT=$BENCH/results/scale; fi

# Cells stay shorter than a node's idle keep-alive limit (http.header_read_timeout_ms,
# 5 s): `tally load --verify` reuses its control connection after the run, and when
# the run lasts about as long as that limit, the node may close the connection just
# as the verifying request goes out ("connection closed before message completed").
if [[ $MODE == full ]]; then
  DURATION_S=${BENCH_DURATION_S:-4}
  WRITERS=${BENCH_WRITERS:-"1 8 64 256"}
  READ_DURATION_S=${BENCH_READ_DURATION_S:-4}
  READ_SHARDS="8 64 256"
  SKETCH_PLAN=${BENCH_SKETCH_PLAN:-"1000:5,10000:5,100000:5,1000000:3,10000000:1"}
  OUT=${OUT:-$BENCH/results}
else
  DURATION_S=${BENCH_DURATION_S:-2}
  WRITERS=${BENCH_WRITERS:-"64"}
  READ_DURATION_S=${BENCH_READ_DURATION_S:-1}
  READ_SHARDS="64"
  SKETCH_PLAN=${BENCH_SKETCH_PLAN:-"1000:2,10000:1,100000:1,1000000:1"}
  OUT=${OUT:-$BENCH/results/quick}
fi
# Increments per request in the pipelined and batched rows: redis-benchmark -P and
# tally load --batch.
PIPELINE=16
TALLY_SHARDS=64
READ_WRITERS=8
# Writers of the sync shard-count cells (the target's concurrency).
SWEEP_WRITERS=64
# Copies of every shard in the tally3r cluster (cluster.replicas).
REPLICAS=3

mkdir -p "$OUT/logs"
RAW=$OUT/raw.jsonl
SKETCH_RAW=$OUT/sketch.jsonl
rm -f "$RAW" "$SKETCH_RAW" "$OUT"/logs/*.log

TMP_ROOT=$(mktemp -d "${BENCH_TMPDIR:-/var/tmp}/tally-bench.XXXXXX")
chmod 755 "$TMP_ROOT" # the postgres user must reach its data directory inside
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  stop_all
  if [[ ${BENCH_KEEP_TMP:-0} == 1 ]]; then log "kept $TMP_ROOT"; else rm -rf "$TMP_ROOT"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------- set-up

install_deps() {
  local pkgs=()
  [[ -x $PY ]] || pkgs+=(python3)
  command -v curl >/dev/null || pkgs+=(curl)
  command -v redis-server >/dev/null || pkgs+=(redis-server)
  command -v redis-benchmark >/dev/null || pkgs+=(redis-tools)
  compgen -G "/usr/lib/postgresql/*/bin/pgbench" >/dev/null || pkgs+=(postgresql postgresql-contrib)
  "$PY" -c 'import matplotlib' 2>/dev/null || pkgs+=(python3-matplotlib)
  if ((${#pkgs[@]})); then
    [[ $(id -u) == 0 ]] || die "missing Debian packages: ${pkgs[*]} (run as root, or install them)"
    log "installing ${pkgs[*]} with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
  fi
}

build_tally() {
  local target=${CARGO_TARGET_DIR:-$REPO/target}
  if [[ ${BENCH_NO_BUILD:-0} != 1 ]]; then
    log "cargo build --release --bin tallyd --bin tally"
    (cd "$REPO" && cargo build --release --bin tallyd --bin tally)
  fi
  TALLYD=$target/release/tallyd
  TALLY=$target/release/tally
  [[ -x $TALLYD && -x $TALLY ]] || die "no tallyd/tally in $target/release"
}

write_meta() {
  "$PY" - "$OUT/meta.json" "$@" <<'EOF'
import json, os, platform, sys, time
path, args = sys.argv[1], sys.argv[2:]
meta = {}
if os.path.exists(path) and "start" not in args:
    meta = json.load(open(path))
now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
load1 = os.getloadavg()[0]
if "start" in args:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    mem = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal"))
    try:
        pressure = open("/proc/pressure/cpu").readline().split()[2].split("=")[1]
    except (OSError, IndexError):
        pressure = "?"
    meta.update(started=now, started_epoch=time.time(), load1_start=load1, cpu=cpu, cpu_pressure_start=pressure,
                cores=os.cpu_count(), mem_gib=round(mem / 2**20, 1), kernel=platform.release())
    for kv in args[1:]:
        k, _, v = kv.partition("=")
        meta[k] = v
else:
    meta.update(finished=now, load1_end=load1, elapsed_s=round(time.time() - meta["started_epoch"]))
json.dump(meta, open(path, "w"), indent=2)
EOF
}

versions() {
  local pg redis tally rev
  pg=$("$(pg_bin)/postgres" --version | awk '{print $3}')
  redis=$(redis-server --version | awk '{print $3}' | sed 's/^v=//')
  tally=$("$TALLY" --version | awk '{print $2}')
  # The last commit that changed Tally itself (anything outside bench/).
  rev=$(git -C "$REPO" log -1 --format=%h -- . ':!bench' 2>/dev/null || echo unknown)
  echo "postgres=$pg" "redis=$redis" "tally=$tally" "tally_rev=$rev"
}

fs_type() { df --output=fstype "$1" | tail -n 1; }

# measure ARGS... -- CMD...: one cell through lib/measure.py, appended to $RAW.
measure() {
  "$PY" "$BENCH/lib/measure.py" --out "$RAW" "$@"
}

# ---------------------------------------------------------------- writes
#
# Every server of the write cells runs for the whole phase, and the cells go writer
# count by writer count: at each concurrency, PostgreSQL, Redis and Tally are measured
# within a minute or two of each other. The disk is shared with other work and its
# fsync latency moves by 10x over minutes; measured system after system, the durable
# rows would compare different disks. Idle servers cost little (see README.md).

setup_postgres() {
  start_postgres
  psql_bench -d postgres -c "CREATE DATABASE bench"
  psql_bench -d bench -c "CREATE TABLE counters (id int PRIMARY KEY, c bigint NOT NULL DEFAULT 0);
    INSERT INTO counters (id) SELECT generate_series(1, $TALLY_SHARDS);"
  psql_bench -d bench -c "VACUUM ANALYZE counters"
  printf 'UPDATE counters SET c = c + 1 WHERE id = 1;\n' >"$TMP_ROOT/hot.sql"
  printf '\\set r random(1, %d)\nUPDATE counters SET c = c + 1 WHERE id = :r;\n' "$TALLY_SHARDS" >"$TMP_ROOT/sharded.sql"
  mkdir -p "$TMP_ROOT/pglog"
}

# pg_cell VARIANT WRITERS
pg_cell() {
  local variant=$1 w=$2 config
  if [[ $variant == hot ]]; then config="hot row UPDATE"; else config="$TALLY_SHARDS-row sharded UPDATE"; fi
  local count="$PG_BIN/psql -X -At -h 127.0.0.1 -p $PG_PORT -U postgres -d bench -c 'SELECT sum(c) FROM counters'"
  # pgbench's -T also runs while its connections open (one backend process each,
  # seconds for 256 of them on a loaded machine); its tps excludes that time, and the
  # longer -T leaves at least DURATION_S of transactions.
  log "PostgreSQL $config, $w writers"
  measure --tool pgbench --server-pids "$PG_PID" --timeout "$(cell_timeout "$DURATION_S")" \
    --pglog-prefix "$TMP_ROOT/pglog/tx" --log "$OUT/logs/postgres.log" --count-cmd "$count" \
    --field section=write --field system=PostgreSQL --field config="$config" \
    --field durability="synchronous_commit=on" --field requests=single --field batch=1 --field writers="$w" -- \
    "$PG_BIN/pgbench" -n -h 127.0.0.1 -p "$PG_PORT" -U postgres -c "$w" -j "$((w < 2 ? w : 2))" \
    -T "$((DURATION_S + 1 + w / 32))" -f "$TMP_ROOT/$variant.sql" --log --log-prefix="$TMP_ROOT/pglog/tx" bench
}

# redis_requests PORT WRITERS PIPELINE: a request count that lasts about DURATION_S,
# from a short probe run (redis-benchmark stops after a count, not a time).
redis_requests() {
  local port=$1 w=$2 pipe=$3 probe rps
  probe=$((w * pipe * 20))
  ((probe >= 2000)) || probe=2000
  rps=$(timeout 60 redis-benchmark -h 127.0.0.1 -p "$port" -c "$w" -n "$probe" -P "$pipe" -q INCR bench:hot |
    tr '\r' '\n' | grep -o '[0-9.]* requests per second' | tail -n 1 | awk '{print int($1)}')
  rps=${rps:-0}
  local n=$((rps * DURATION_S))
  echo $((n > probe ? n : probe))
}

# redis_cell FSYNC PIPELINE WRITERS
redis_cell() {
  local fsync=$1 pipe=$2 w=$3 port pid requests n
  if [[ $fsync == always ]]; then port=$REDIS_ALWAYS_PORT pid=$REDIS_ALWAYS_PID; else port=$REDIS_EVERYSEC_PORT pid=$REDIS_EVERYSEC_PID; fi
  if ((pipe == 1)); then requests=single; else requests="pipeline $pipe"; fi
  n=$(redis_requests "$port" "$w" "$pipe")
  log "Redis INCR appendfsync $fsync, $requests, $w writers, $n requests"
  measure --tool redis --server-pids "$pid" --timeout "$(cell_timeout "$((DURATION_S * 3))")" \
    --log "$OUT/logs/redis.log" --count-cmd "redis-cli -h 127.0.0.1 -p $port GET bench:hot" \
    --field section=write --field system=Redis --field config="INCR, appendfsync $fsync" \
    --field durability="appendfsync=$fsync" --field requests="$requests" --field batch="$pipe" \
    --field writers="$w" -- \
    redis-benchmark -h 127.0.0.1 -p "$port" -c "$w" -n "$n" -P "$pipe" INCR bench:hot
}

# tally_cell TOPO(1|3|3r) COUNTER CONFIG DURABILITY BATCH WRITERS [SECTION]
# (3: the 3-node cluster with one copy of every shard; 3r: with $REPLICAS copies)
tally_cell() {
  local topo=$1 name=$2 config=$3 dur=$4 batch=$5 w=$6 section=${7:-write} urls pids system requests
  case $topo in
    1) urls=$T1_URLS pids=$T1_PIDS system="Tally 1 node" ;;
    3) urls=$T3_URLS pids=$T3_PIDS system="Tally 3 nodes" ;;
    3r) urls=$T3R_URLS pids=$T3R_PIDS system="Tally 3 nodes, $REPLICAS replicas" ;;
    *) die "tally_cell: unknown topology $topo" ;;
  esac
  if ((batch == 1)); then requests=single; else requests="batch $batch"; fi
  log "$system, $config, $requests, $w writers"
  measure --tool tally --server-pids "$pids" --timeout "$(cell_timeout "$DURATION_S")" \
    --log "$OUT/logs/tally$topo.log" \
    --field section="$section" --field system="$system" --field config="$config" \
    --field durability="$dur" --field requests="$requests" --field batch="$batch" --field writers="$w" -- \
    "$TALLY" --node "${urls%% *}" --json --timeout-ms 10000 load "$name" --writers "$w" \
    --duration "${DURATION_S}s" --batch "$batch" --no-progress --verify --nodes "${urls// /,}"
}

# The write phase, for the systems named in $SECTIONS (postgres, redis, tally1, tally3,
# tally3r).
phase_writes() {
  local want_pg=0 want_redis=0 want_t1=0 want_t3=0 want_t3r=0 s
  for s in $SECTIONS; do
    case $s in
      postgres) want_pg=1 ;;
      redis) want_redis=1 ;;
      tally1) want_t1=1 ;;
      tally3) want_t3=1 ;;
      tally3r) want_t3r=1 ;;
    esac
  done
  ((want_pg + want_redis + want_t1 + want_t3 + want_t3r)) || return 0
  log "== writes: starting every server of the phase"
  if ((want_pg)); then setup_postgres; fi
  if ((want_redis)); then
    start_redis always
    REDIS_ALWAYS_PORT=$REDIS_PORT REDIS_ALWAYS_PID=$REDIS_PID
    start_redis everysec
    REDIS_EVERYSEC_PORT=$REDIS_PORT REDIS_EVERYSEC_PID=$REDIS_PID
  fi
  local dur shards
  if ((want_t1)); then
    start_tally_single
    T1_URLS=$TALLY_URLS T1_PIDS=$TALLY_PIDS
    for dur in sync batched; do
      tally_create "${T1_URLS%% *}" "bench-$dur" --shards "$TALLY_SHARDS" --durability "$dur"
    done
    for shards in 1 8; do
      tally_create "${T1_URLS%% *}" "sync-$shards" --shards "$shards" --durability sync
    done
  fi
  if ((want_t3)); then
    start_tally_cluster
    T3_URLS=$TALLY_URLS T3_PIDS=$TALLY_PIDS
    for dur in sync batched; do
      tally_create "${T3_URLS%% *}" "bench-$dur" --shards "$TALLY_SHARDS" --durability "$dur"
    done
  fi
  if ((want_t3r)); then
    # The same three nodes, every shard replicated by its range group: a sync
    # increment is acknowledged once a majority of the group has it on disk.
    start_tally_cluster "$REPLICAS"
    T3R_URLS=$TALLY_URLS T3R_PIDS=$TALLY_PIDS T3R_RESP_PORT=${TALLY_RESP_PORTS%% *}
    for dur in sync batched; do
      tally_create "${T3R_URLS%% *}" "bench-$dur" --shards "$TALLY_SHARDS" --durability "$dur"
    done
    tally_create "${T3R_URLS%% *}" resp-sync --shards "$TALLY_SHARDS" --durability sync
  fi

  # What the servers cost while idle, all together: the background of every cell.
  log "idle servers, 3 s"
  # shellcheck disable=SC2086 # word lists of PIDs
  measure --tool none --server-pids "${PG_PID:-} ${REDIS_ALWAYS_PID:-} ${REDIS_EVERYSEC_PID:-} ${T1_PIDS:-} ${T3_PIDS:-} ${T3R_PIDS:-}" \
    --timeout 30 --field section=idle --field system="all servers of the write phase" -- sleep 3

  local w variant fsync pipe topo batch
  for w in $WRITERS; do
    log "== writes, $w writers"
    "$PY" "$BENCH/lib/fsync_probe.py" --dir "$TMP_ROOT" --out "$RAW" --label "$w writer$( ((w == 1)) || echo s)"
    if ((want_pg)); then
      for variant in hot sharded; do pg_cell "$variant" "$w"; done
    fi
    if ((want_redis)); then
      for fsync in always everysec; do
        for pipe in 1 "$PIPELINE"; do redis_cell "$fsync" "$pipe" "$w"; done
      done
    fi
    for topo in 1 3 3r; do
      if [[ $topo == 1 ]] && ((!want_t1)); then continue; fi
      if [[ $topo == 3 ]] && ((!want_t3)); then continue; fi
      if [[ $topo == 3r ]] && ((!want_t3r)); then continue; fi
      for dur in sync batched; do
        for batch in 1 "$PIPELINE"; do
          tally_cell "$topo" "bench-$dur" "$dur counter, $TALLY_SHARDS shards" "$dur" "$batch" "$w"
        done
      done
    done
    if ((want_t3r)); then
      # The replicated sync counter through the Redis protocol (redis-benchmark,
      # every client on node 1, which forwards what other nodes lead): single
      # TALLY.INCRBY commands with a new event id each, as the HTTP sync cells.
      local fresh="redis-cli -h 127.0.0.1 -p $T3R_RESP_PORT TALLY.GET resp-sync FRESH | sed -n 2p"
      resp_cell "Tally 3 nodes, $REPLICAS replicas (RESP)" \
        "TALLY.INCRBY with event ids, sync counter, $TALLY_SHARDS shards" "$T3R_RESP_PORT" "$T3R_PIDS" \
        "$fresh" 1 "$w" TALLY.INCRBY resp-sync 1 ID "r$w-__rand_int__-__rand_int__"
    fi
    if ((want_t1)) && [[ $w == "$SWEEP_WRITERS" ]]; then
      # How a sync counter's shard count changes its rate: each commit cycle (one
      # fsync) carries one store write per shard that has increments waiting.
      for shards in 1 8; do
        tally_cell 1 "sync-$shards" "sync counter, $shards shard$( ((shards == 1)) || echo s)" sync 1 "$w" write-shards
      done
    fi
  done
  log "== writes: stopping the servers"
  stop_all
}

# ---------------------------------------------------------------- reads while writing

# read_cells SYSTEM URL NAME SHARDS WRITERS: one cached and one fresh read cell.
read_cells() {
  local system=$1 url=$2 name=$3 shards=$4 writers=$5 consistency
  for consistency in cached fresh; do
    log "$system, $shards shards, $consistency reads, $writers writers writing"
    measure --tool reader --server-pids "$TALLY_PIDS" --timeout "$(cell_timeout "$READ_DURATION_S")" \
      --log "$OUT/logs/reads.log" \
      --field section=read --field system="$system" --field shards="$shards" \
      --field consistency="$consistency" --field writers="$writers" -- \
      "$PY" "$BENCH/lib/reader.py" --url "$url" --counter "$name" --consistency "$consistency" \
      --duration "$READ_DURATION_S"
  done
}

section_reads() {
  local topo system first nodes shards name wpid
  for topo in 1 3; do
    if [[ $topo == 1 ]]; then
      system="Tally 1 node"
      log "== reads, single node"
      start_tally_single
    else
      system="Tally 3 nodes"
      log "== reads, 3-node cluster"
      start_tally_cluster
    fi
    first=${TALLY_URLS%% *}
    nodes=${TALLY_URLS// /,}
    for shards in $READ_SHARDS; do
      name=read-$shards
      tally_create "$first" "$name" --shards "$shards" --durability batched
      # Give shards a value before the idle reads.
      "$TALLY" --node "$first" load "$name" --writers "$shards" --duration 500ms --no-progress \
        --nodes "$nodes" >/dev/null
      sleep 0.3
      read_cells "$system" "$first" "$name" "$shards" 0
      # Writers run through both read cells (each: its duration plus the
      # measurement's settle time).
      local write_s=$((2 * READ_DURATION_S + 3))
      timeout "$((write_s + 30))" "$TALLY" --node "$first" --json load "$name" --writers "$READ_WRITERS" \
        --duration "${write_s}s" --no-progress --nodes "$nodes" >"$TMP_ROOT/readload.json" 2>&1 &
      wpid=$!
      register_pid "$wpid"
      sleep 1
      read_cells "$system" "$first" "$name" "$shards" "$READ_WRITERS"
      wait "$wpid" || log "background writers of $name exited with status $?"
      unregister_pid "$wpid"
      cat "$TMP_ROOT/readload.json" >>"$OUT/logs/reads.log"
      "$PY" - "$TMP_ROOT/readload.json" "$RAW" "$system" "$shards" <<'EOF'
import json, sys
src, raw, system, shards = sys.argv[1:]
text = open(src).read()
try:
    report, _ = json.JSONDecoder().raw_decode(text[text.index("{"):])
    rate = report["increments_per_s"]
except (ValueError, KeyError):
    rate = None
with open(raw, "a") as f:
    f.write(json.dumps({"section": "read-writers", "system": system, "shards": int(shards), "incr_per_s": rate}) + "\n")
EOF
    done
    stop_tally
  done
}

# ---------------------------------------------------------------- distinct counts

section_sketch() {
  log "== distinct counts: Tally HyperLogLog against Redis PFADD/PFCOUNT ($SKETCH_PLAN)"
  start_tally_single
  start_redis everysec
  timeout 1200 "$PY" "$BENCH/lib/sketch.py" --tally "${TALLY_URLS%% *}" --redis-port "$REDIS_PORT" \
    --plan "$SKETCH_PLAN" --shards 1,64 >"$SKETCH_RAW"
  stop_redis
  stop_tally
}

# ---------------------------------------------------------------- one client for both

# resp_requests PORT WRITERS PIPELINE COMMAND...: like redis_requests, for any command.
resp_requests() {
  local port=$1 w=$2 pipe=$3 probe rps
  shift 3
  probe=$((w * pipe * 20))
  ((probe >= 2000)) || probe=2000
  rps=$(timeout 60 redis-benchmark -h 127.0.0.1 -p "$port" -c "$w" -n "$probe" -P "$pipe" -r 1000000000 -q "$@" |
    tr '\r' '\n' | grep -o '[0-9.]* requests per second' | tail -n 1 | awk '{print int($1)}')
  rps=${rps:-0}
  local n=$((rps * DURATION_S))
  echo $((n > probe ? n : probe))
}

# resp_cell SYSTEM CONFIG PORT PID COUNT_CMD PIPELINE WRITERS COMMAND...: redis-benchmark
# running COMMAND (INCR KEY, or TALLY.INCRBY with a random event id per command).
resp_cell() {
  local system=$1 config=$2 port=$3 pid=$4 count_cmd=$5 pipe=$6 w=$7 requests n
  shift 7
  if ((pipe == 1)); then requests=single; else requests="pipeline $pipe"; fi
  n=$(resp_requests "$port" "$w" "$pipe" "$@")
  log "redis-benchmark $1 against $system ($config), $requests, $w writers, $n requests"
  # -r: each __rand_int__ becomes a random 12-digit number per command; event ids
  # carry two, so that no two of a cell (probe included) collide: 10^18 ids.
  measure --tool redis --server-pids "$pid" --timeout "$(cell_timeout "$((DURATION_S * 3))")" \
    --log "$OUT/logs/resp.log" --count-cmd "$count_cmd" \
    --field section=resp --field system="$system" --field config="$config" \
    --field requests="$requests" --field batch="$pipe" --field writers="$w" -- \
    redis-benchmark -h 127.0.0.1 -p "$port" -c "$w" -n "$n" -P "$pipe" -r 1000000000 "$@"
}

# wrk_cell CONFIG URL LUA COUNT_CMD WRITERS: single HTTP requests from wrk, a neutral
# load generator (C, one connection per writer), against the Tally node.
wrk_cell() {
  local config=$1 url=$2 lua=$3 count_cmd=$4 w=$5 threads=2 script=() count=()
  ((w >= 2)) || threads=1
  [[ -z $lua ]] || script=(-s "$lua")
  [[ -z $count_cmd ]] || count=(--count-cmd "$count_cmd")
  log "wrk against Tally 1 node ($config), $w writers"
  measure --tool wrk --server-pids "$TALLY_PIDS" --timeout "$(cell_timeout "$DURATION_S")" \
    --log "$OUT/logs/http.log" "${count[@]}" --verify-slack "$w" \
    --field section=http --field system="Tally 1 node (wrk)" --field config="$config" \
    --field requests=single --field batch=1 --field writers="$w" -- \
    wrk -t "$threads" -c "$w" -d "${DURATION_S}s" --latency "${script[@]}" "$url"
}

# The same client, redis-benchmark, against Redis (appendfsync everysec and always)
# and against a single Tally node's RESP port (a batched and a sync counter of
# $TALLY_SHARDS shards): INCR at every writer count, single and pipelined, and
# TALLY.INCRBY with a new event id per command on the sync counter (Redis `always`
# is its comparison). Then single HTTP increments from wrk beside `tally load`, and
# wrk on /healthz (the node's HTTP ceiling).
section_resp() {
  log "== one client for both: redis-benchmark INCR against Redis and Tally's RESP port"
  start_redis everysec
  local everysec_port=$REDIS_PORT everysec_pid=$REDIS_PID
  start_redis always
  local always_port=$REDIS_PORT always_pid=$REDIS_PID
  start_tally_single
  local dur
  for dur in batched sync; do
    tally_create "${TALLY_URLS%% *}" "resp-$dur" --shards "$TALLY_SHARDS" --durability "$dur"
  done
  local w pipe fresh
  for w in $WRITERS; do
    for pipe in 1 "$PIPELINE"; do
      resp_cell Redis "INCR, appendfsync everysec" "$everysec_port" "$everysec_pid" \
        "redis-cli -h 127.0.0.1 -p $everysec_port GET bench:resp" "$pipe" "$w" INCR bench:resp
      for dur in batched sync; do
        fresh="redis-cli -h 127.0.0.1 -p $TALLY_RESP_PORT TALLY.GET resp-$dur FRESH | sed -n 2p"
        resp_cell "Tally 1 node (RESP)" "INCR, $dur counter, $TALLY_SHARDS shards" "$TALLY_RESP_PORT" \
          "$TALLY_PIDS" "$fresh" "$pipe" "$w" INCR "resp-$dur"
      done
      fresh="redis-cli -h 127.0.0.1 -p $TALLY_RESP_PORT TALLY.GET resp-sync FRESH | sed -n 2p"
      resp_cell "Tally 1 node (RESP)" "TALLY.INCRBY with event ids, sync counter, $TALLY_SHARDS shards" \
        "$TALLY_RESP_PORT" "$TALLY_PIDS" "$fresh" "$pipe" "$w" \
        TALLY.INCRBY resp-sync 1 ID "e$w-$pipe-__rand_int__-__rand_int__"
      resp_cell Redis "INCR, appendfsync always" "$always_port" "$always_pid" \
        "redis-cli -h 127.0.0.1 -p $always_port GET bench:resp" "$pipe" "$w" INCR bench:resp
    done
  done
  # First increments to new counters (a new key per command, created with the default
  # spec) beside the INCR cells of an existing counter above: the same client and
  # writers. Verified by the node's count of delivered increments, read once every
  # buffered first increment has been drained (within `flush_ms`, 200 ms).
  local delivered="sleep 2; curl -fsS ${TALLY_URLS%% *}/metrics | awk '/^tally_increments_total/ {s += \$2} END {print s}'"
  for w in $WRITERS; do
    resp_cell "Tally 1 node (RESP)" "INCR, a new counter per command" "$TALLY_RESP_PORT" "$TALLY_PIDS" \
      "$delivered" 1 "$w" INCR "new$w:__rand_int__"
  done
  stop_pid "$everysec_pid" TERM 60
  stop_pid "$always_pid" TERM 60

  log "== HTTP single increments: wrk beside tally load"
  local url=${TALLY_URLS%% *} lua=$BENCH/lib/wrk-increment.lua lua_ids=$BENCH/lib/wrk-increment-ids.lua
  for dur in batched sync; do
    tally_create "$url" "http-$dur" --shards "$TALLY_SHARDS" --durability "$dur"
  done
  local value='import json,sys; print(json.load(sys.stdin)["value"])' ids config
  for w in $WRITERS; do
    wrk_cell "GET /healthz" "$url/healthz" "" "" "$w"
    wrk_cell "batched counter, $TALLY_SHARDS shards" "$url/v1/counters/http-batched/increments" "$lua" \
      "curl -fsS '$url/v1/counters/http-batched/value?consistency=fresh' | $PY -c '$value'" "$w"
    wrk_cell "sync counter with event ids, $TALLY_SHARDS shards" "$url/v1/counters/http-sync/increments" \
      "$lua_ids" "curl -fsS '$url/v1/counters/http-sync/value?consistency=fresh' | $PY -c '$value'" "$w"
    for dur in batched sync; do
      ids=()
      config="batched counter, $TALLY_SHARDS shards"
      if [[ $dur == sync ]]; then
        ids=(--event-ids)
        config="sync counter with event ids, $TALLY_SHARDS shards"
      fi
      log "tally load against Tally 1 node ($config), $w writers"
      measure --tool tally --server-pids "$TALLY_PIDS" --timeout "$(cell_timeout "$DURATION_S")" \
        --log "$OUT/logs/http.log" --field section=http --field system="Tally 1 node (tally load)" \
        --field config="$config" --field requests=single --field batch=1 --field writers="$w" -- \
        "$TALLY" --node "$url" --json --timeout-ms 10000 load "http-$dur" --writers "$w" \
        --duration "${DURATION_S}s" --batch 1 --no-progress --verify "${ids[@]}"
    done
  done
  stop_tally
}

# ---------------------------------------------------------------- main

install_deps
build_tally
log "mode $MODE: cells of ${DURATION_S}s, writers $WRITERS; results in $OUT; data under $TMP_ROOT"
# shellcheck disable=SC2046 # versions prints separate key=value words
write_meta start mode="$MODE" duration_s="$DURATION_S" writers="$WRITERS" read_duration_s="$READ_DURATION_S" \
  pipeline="$PIPELINE" tally_shards="$TALLY_SHARDS" replicas="$REPLICAS" read_writers="$READ_WRITERS" sketch_plan="$SKETCH_PLAN" \
  tmp_fs="$(fs_type "$TMP_ROOT")" $(versions)
[[ $(fs_type "$TMP_ROOT") != tmpfs ]] || log "warning: $TMP_ROOT is on tmpfs, where fsync costs nothing"

for section in $SECTIONS; do
  case $section in
    postgres | redis | tally1 | tally3 | tally3r | reads | sketch | resp | scale) ;;
    *) die "unknown section $section" ;;
  esac
done
phase_writes
for section in $SECTIONS; do
  case $section in
    reads)
      "$PY" "$BENCH/lib/fsync_probe.py" --dir "$TMP_ROOT" --out "$RAW" --label "before the reads"
      section_reads
      ;;
    sketch) section_sketch ;;
    resp) section_resp ;;
    scale) section_scale ;;
  esac
done

"$PY" "$BENCH/lib/fsync_probe.py" --dir "$TMP_ROOT" --out "$RAW" --label "at the end"
write_meta end
if [[ $SECTIONS == scale ]]; then
  log "done: the CSV files in $OUT"
  exit 0
fi
"$PY" "$BENCH/lib/report.py" "$OUT"
log "done: $OUT/results.md"
