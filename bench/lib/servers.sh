# shellcheck shell=bash
# Starting the servers under test on 127.0.0.1, each with its own data directory
# under $TMP_ROOT and its own ports. Every process started here is registered
# (register_pid) so that the exit trap stops it by PID.
#
# Each start_* function sets the globals its section needs (ports, PIDs to measure).

# ---------------------------------------------------------------- PostgreSQL

pg_bin() {
  local dir
  dir=$(find /usr/lib/postgresql -mindepth 2 -maxdepth 2 -name bin -type d 2>/dev/null | sort -V | tail -n 1)
  [[ -n $dir && -x $dir/postgres ]] || die "PostgreSQL server binaries not found under /usr/lib/postgresql"
  echo "$dir"
}

# Runs a command as the postgres user when we are root (PostgreSQL refuses to run
# as root), as ourselves otherwise.
as_pg() {
  if [[ $(id -u) == 0 ]]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

# start_postgres: initdb in $TMP_ROOT/pg and start postgres in the foreground of a
# background job. Sets PG_PORT, PG_DIR, PG_PID (the postmaster) and PG_BIN.
start_postgres() {
  PG_BIN=$(pg_bin)
  PG_DIR=$TMP_ROOT/pg
  mkdir -p "$PG_DIR"
  [[ $(id -u) == 0 ]] && chown postgres: "$PG_DIR"
  as_pg "$PG_BIN/initdb" -D "$PG_DIR/data" -U postgres -A trust -E UTF8 --no-sync >"$PG_DIR/initdb.log" 2>&1 ||
    die "initdb failed: see $PG_DIR/initdb.log"
  PG_PORT=$(free_ports 1)
  # fsync and synchronous_commit are on (the defaults), spelled out: a commit is
  # acknowledged after its WAL is flushed to disk.
  as_pg "$PG_BIN/postgres" -D "$PG_DIR/data" \
    -c listen_addresses=127.0.0.1 -c port="$PG_PORT" -c unix_socket_directories="$PG_DIR" \
    -c max_connections=300 -c fsync=on -c synchronous_commit=on -c full_page_writes=on \
    -c shared_buffers=128MB -c logging_collector=off >"$PG_DIR/postgres.log" 2>&1 &
  PG_LAUNCHER=$!
  register_pid "$PG_LAUNCHER"
  wait_until 60 "PostgreSQL" "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT"
  PG_PID=$(head -n 1 "$PG_DIR/data/postmaster.pid")
  # Stop the postmaster itself first (fast shutdown), then its launcher.
  register_pid "$PG_PID"
  log "PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}') on 127.0.0.1:$PG_PORT (postmaster pid $PG_PID)"
}

psql_bench() {
  "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PG_PORT" -U postgres "$@"
}

stop_postgres() {
  stop_pid "$PG_PID" INT 60
  stop_pid "$PG_LAUNCHER" TERM 10
}

# ---------------------------------------------------------------- Redis

# start_redis FSYNC: a Redis with an append-only file fsynced `always` or `everysec`
# and no RDB snapshots. Sets REDIS_PORT, REDIS_PID.
start_redis() {
  local fsync=$1 dir
  dir=$(mktemp -d "$TMP_ROOT/redis-$fsync.XXXX")
  REDIS_PORT=$(free_ports 1)
  redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --dir "$dir" --daemonize no \
    --appendonly yes --appendfsync "$fsync" --save '' --auto-aof-rewrite-percentage 0 \
    --maxclients 4096 --logfile "$dir/redis.log" >/dev/null 2>&1 &
  REDIS_PID=$!
  register_pid "$REDIS_PID"
  wait_until 30 "Redis" redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping
  log "Redis $(redis-server --version | awk '{print $3}' | sed 's/^v=//') on 127.0.0.1:$REDIS_PORT, appendfsync $fsync (pid $REDIS_PID)"
}

stop_redis() {
  stop_pid "$REDIS_PID" TERM 60
}

# ---------------------------------------------------------------- Tally

tally_healthy() { curl -fsS -m 2 "$1/healthz"; }

# start_tally_single: one node, generated from cluster-config/single.toml with free
# ports and a data directory under $TMP_ROOT. Sets TALLY_URLS (one URL), TALLY_PIDS
# and TALLY_RESP_PORT (its Redis-protocol port).
start_tally_single() {
  local dir http peer raft resp
  # A new data directory each time: a node keeps the raft addresses of its first
  # start in its metadata, so a directory must not be reused with other ports.
  dir=$(mktemp -d "$TMP_ROOT/tally1.XXXX")
  read -r http peer raft resp <<<"$(free_ports 4)"
  sed -e "s/127\.0\.0\.1:7070/127.0.0.1:$http/" -e "s/127\.0\.0\.1:7170/127.0.0.1:$peer/" \
    -e "s/127\.0\.0\.1:7270/127.0.0.1:$raft/" -e "s/127\.0\.0\.1:6380/127.0.0.1:$resp/" \
    -e "s|^data_dir = .*|data_dir = \"$dir/data\"|" \
    "$REPO/cluster-config/single.toml" >"$dir/node1.toml"
  "$TALLYD" --config "$dir/node1.toml" --data-dir "$dir/data" >"$dir/node1.log" 2>&1 &
  TALLY_PIDS=$!
  register_pid "$TALLY_PIDS"
  TALLY_URLS="http://127.0.0.1:$http"
  TALLY_RESP_PORT=$resp
  wait_until 60 "tallyd" tally_healthy "$TALLY_URLS"
  log "tallyd single node on $TALLY_URLS, RESP on 127.0.0.1:$resp (pid $TALLY_PIDS)"
}

# start_tally_cluster [REPLICAS]: three nodes, generated from cluster-config/local3/
# with free ports (HTTP, peer, raft and RESP of each node) and data directories under
# $TMP_ROOT. REPLICAS (default 1, one copy of every shard; unset in the configs, three
# members would get 3) goes into every node's [cluster] section as `replicas`; with
# more, each shard lives in a range group
# replicated by raft, and /healthz answers 200 only once every range group of the
# node has a leader. BENCH_RANGES_PER_NODE, if set, goes in as `ranges_per_node`
# (how many range groups the ring is cut into per node; 4 by default). Sets
# TALLY_URLS (space-separated), TALLY_RESP_PORTS (the nodes' Redis-protocol ports,
# in the same order) and TALLY_PIDS.
start_tally_cluster() {
  local replicas=${1:-1} dir ports n i old new
  dir=$(mktemp -d "$TMP_ROOT/tally3r$replicas.XXXX") # new each time, as in start_tally_single
  read -r -a ports <<<"$(free_ports 12)"
  TALLY_URLS=""
  TALLY_RESP_PORTS=""
  TALLY_PIDS=""
  local subst=()
  for n in 1 2 3; do
    i=$((n - 1))
    for kind in 0 1 2; do # http 707n, peer 717n, raft 727n
      old="127\\.0\\.0\\.1:7${kind}7${n}"
      new="127.0.0.1:${ports[kind * 3 + i]}"
      subst+=(-e "s/$old/$new/")
    done
    subst+=(-e "s/127\\.0\\.0\\.1:638${n}/127.0.0.1:${ports[9 + i]}/") # RESP 638n
    TALLY_URLS+="${TALLY_URLS:+ }http://127.0.0.1:${ports[i]}"
    TALLY_RESP_PORTS+="${TALLY_RESP_PORTS:+ }${ports[9 + i]}"
  done
  # The same line in every node's [cluster] section: it is part of the fingerprint.
  subst+=(-e "/^\\[cluster\\]\$/a replicas = $replicas")
  local per_node=${BENCH_RANGES_PER_NODE:-}
  [[ -z $per_node ]] || subst+=(-e "/^\\[cluster\\]\$/a ranges_per_node = $per_node")
  for n in 1 2 3; do
    sed "${subst[@]}" -e "s|^data_dir = .*|data_dir = \"$dir/node$n\"|" \
      "$REPO/cluster-config/local3/node$n.toml" >"$dir/node$n.toml"
    grep -qx "replicas = $replicas" "$dir/node$n.toml" || die "no replicas line in $dir/node$n.toml"
    "$TALLYD" --config "$dir/node$n.toml" --data-dir "$dir/node$n" >"$dir/node$n.log" 2>&1 &
    register_pid "$!"
    TALLY_PIDS+="${TALLY_PIDS:+ }$!"
  done
  local url
  for url in $TALLY_URLS; do
    # A replicating node answers 503 until each of its range groups has elected a
    # leader: curl -f fails on it, so this waits for that too.
    wait_until 90 "tallyd at $url" tally_healthy "$url"
  done
  # /healthz answers per node; wait until every node sees all three up (node-to-node
  # sessions established) and a metadata leader, or early reads miss remote shards.
  for url in $TALLY_URLS; do
    wait_until 60 "the cluster view of $url" tally_cluster_ready "$url"
  done
  log "tallyd 3-node cluster, replicas = $replicas${per_node:+, ranges_per_node = $per_node}, on $TALLY_URLS (pids $TALLY_PIDS)"
}

tally_cluster_ready() {
  curl -fsS -m 2 "$1/v1/cluster" | "$PY" -c '
import json, sys
view = json.load(sys.stdin)
sys.exit(0 if view.get("leader") and all(n["state"] == "up" for n in view["nodes"]) else 1)'
}

tally_read_complete() {
  curl -fsS -m 5 "$1/v1/counters/$2/value?consistency=fresh" |
    "$PY" -c 'import json, sys; sys.exit(0 if json.load(sys.stdin).get("complete") else 1)'
}

# tally_create URL NAME ARGS...: create a counter, then wait until a fresh read
# through URL reaches every shard (on a cluster the spec reaches the other nodes
# through the replicated catalog).
tally_create() {
  local url=$1 name=$2
  shift 2
  "$TALLY" --node "$url" create "$name" "$@" >/dev/null
  wait_until 30 "counter $name on every node" tally_read_complete "$url" "$name"
}

stop_tally() {
  local pid
  for pid in $TALLY_PIDS; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in $TALLY_PIDS; do
    stop_pid "$pid" TERM 60
  done
}
