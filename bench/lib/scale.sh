# shellcheck shell=bash
# The `scale` section of bench/run.sh: memory, disk and restart time per retained
# event id, for one node keeping one copy and for three nodes keeping three copies,
# in one run. Each cell feeds N unique idempotent increments (`TALLY.INCRBY … ID`,
# bench/lib/dedup_feed.py) to one sync counter, lets the nodes settle for a minute,
# samples every node's RSS and data directory, then kills a node with SIGKILL and
# starts it again (time until healthy and, with copies, until its replicas hold
# the leaders' logs again), and with copies kills another, empties its data
# directory and starts it again (time until its new replicas are voters holding
# everything). Results: $OUT/<topology>-<ids>.csv (the feed's samples), one line
# per node in $OUT/scale.csv, one per restart in $OUT/restarts.csv ($OUT is
# bench/results/scale when the section runs alone); a summary on stderr. Before
# them, counters cells (scale_counters_cell): new counters created by their first
# INCR, per second, the nodes' CPU per counter, RAM and disk per counter.
#
# Not in the default sections (a cell of 1 M ids takes minutes, 10 M an hour):
#   bench/run.sh --only scale                      SCALE_IDS="1000000" by default
#   SCALE_IDS="1000000 10000000" bench/run.sh --only scale
#   SCALE_TOPOLOGIES=three (default "one three") runs one topology only
#   SCALE_COUNTERS="1000000" (default 200000) new counters per counters cell;
#   SCALE_COUNTERS= or SCALE_IDS= (empty) skips those cells, e.g. the counters
#   cells alone: SCALE_IDS= bench/run.sh --only scale --out bench/results/scale-counters

# scale_since START: seconds since START (a `date +%s.%N`), to a tenth.
scale_since() { awk -v s="$1" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }'; }

# scale_caught_up URLS NODE: whether every range that NODE's current store
# replicates is, as its leader reports it, a voter that holds the leader's whole log.
scale_caught_up() {
  local urls=$1 node=$2 url
  for url in $urls; do curl -fsS -m 5 "$url/v1/cluster" || echo '{}'; echo; done | "$PY" -c '
import json, sys
node = sys.argv[1]
ranges = {}
for line in sys.stdin:
    line = line.strip()
    if not line:
        continue
    for r in json.loads(line).get("ranges", []):
        if r.get("leader_last_log") is not None:  # the leader view
            ranges[r["range"]] = r
held = 0
for r in ranges.values():
    mine = [p for p in r["replicas"] if p["node"] == node and p.get("current") is not False]
    if not mine:
        continue
    held += 1
    p = mine[0]
    if p["role"] != "voter" or r["joint"] or (p.get("matched") or 0) < r["leader_last_log"]:
        sys.exit(1)
sys.exit(0 if held else 1)' "$node"
}

# scale_start TOPOLOGY: starts one node (one) or three nodes keeping three copies
# (three), and sets SCALE_URLS, SCALE_PIDS, SCALE_PORTS (RESP) and SCALE_DIRS (data
# directories), one word per node.
scale_start() {
  if [[ $1 == one ]]; then
    start_tally_single
    SCALE_PORTS=$TALLY_RESP_PORT
    SCALE_DIRS="$(ls -td "$TMP_ROOT"/tally1.* | head -n 1)/data"
  else
    start_tally_cluster 3
    SCALE_PORTS=$TALLY_RESP_PORTS
    local cdir
    cdir=$(ls -td "$TMP_ROOT"/tally3r3.* | head -n 1)
    SCALE_DIRS="$cdir/node1 $cdir/node2 $cdir/node3"
  fi
  SCALE_URLS=$TALLY_URLS
  SCALE_PIDS=$TALLY_PIDS
}

# scale_rss_kb PID: the process's resident memory, in kB.
scale_rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }

# scale_cell TOPOLOGY IDS: one cell (TOPOLOGY one: a single node, one copy; three:
# three nodes, three copies).
scale_cell() {
  local topo=$1 ids=$2 counter=scale:ids i start elapsed
  scale_start "$topo"
  local -a url_a pid_a port_a dir_a
  read -r -a url_a <<<"$SCALE_URLS"
  read -r -a pid_a <<<"$SCALE_PIDS"
  read -r -a port_a <<<"$SCALE_PORTS"
  read -r -a dir_a <<<"$SCALE_DIRS"
  curl -fsS -X PUT "${url_a[0]}/v1/counters/$counter" --json '{"durability": "sync", "shards": 16}' >/dev/null
  wait_until 30 "counter $counter" tally_read_complete "${url_a[0]}" "$counter"
  local -a rss0 disk0
  for i in "${!pid_a[@]}"; do
    rss0[i]=$(scale_rss_kb "${pid_a[i]}")
    disk0[i]=$(du -sb "${dir_a[i]}" | cut -f1)
  done
  log "scale $topo: feeding $ids ids to $counter through ${url_a[0]}"
  "$PY" "$BENCH/lib/dedup_feed.py" --port "${port_a[0]}" --pid "${pid_a[0]}" --data-dir "${dir_a[0]}" \
    --counter "$counter" --ids "$ids" --connections 32 --pipeline 64 --every 30 \
    >"$OUT/$topo-$ids.csv"
  local fed
  fed=$(tail -n 1 "$OUT/$topo-$ids.csv" | cut -d, -f1)
  # A quiet minute: sled's page-out and segment cleaning settle.
  sleep 60
  for i in "${!pid_a[@]}"; do
    local rss disk
    rss=$(scale_rss_kb "${pid_a[i]}")
    disk=$(du -sb "${dir_a[i]}" | cut -f1)
    echo "$topo,$ids,node$((i + 1)),${rss0[i]},$rss,${disk0[i]},$disk,$fed" >>"$OUT/scale.csv"
    log "scale $topo node$((i + 1)): RAM $(((rss - rss0[i]) * 1024 / ids)) B/id, disk $(((disk - disk0[i]) / ids)) B/id (RSS ${rss} kB, data ${disk} B)"
  done
  # A restart over the retained ids: SIGKILL, start again, time until it serves
  # (and, with copies, until its replicas hold the leaders' logs again).
  local victim=$((${#pid_a[@]} > 1 ? 1 : 0)) conf
  conf=${dir_a[victim]%/*}/node$((victim + 1)).toml
  [[ $topo == one ]] && conf=${dir_a[0]%/data}/node1.toml
  kill -KILL "${pid_a[victim]}"
  stop_pid "${pid_a[victim]}" KILL 30
  start=$(date +%s.%N)
  "$TALLYD" --config "$conf" --data-dir "${dir_a[victim]}" >>"${conf%.toml}.log" 2>&1 &
  pid_a[victim]=$!
  register_pid "${pid_a[victim]}"
  wait_until 600 "node$((victim + 1)) healthy again" tally_healthy "${url_a[victim]}"
  elapsed=$(scale_since "$start")
  if [[ $topo == three ]]; then
    wait_until 600 "node2's replicas caught up" scale_caught_up "${url_a[*]}" node2
    local caught
    caught=$(scale_since "$start")
    log "scale $topo: node2 restarted over $ids ids: healthy after ${elapsed}s, replicas caught up after ${caught}s"
    echo "$topo,$ids,restart,node2,$elapsed,$caught" >>"$OUT/restarts.csv"
    # An empty disk: node3 killed, its data directory deleted, started again.
    kill -KILL "${pid_a[2]}"
    stop_pid "${pid_a[2]}" KILL 30
    rm -rf "${dir_a[2]}"
    start=$(date +%s.%N)
    "$TALLYD" --config "${dir_a[2]%/*}/node3.toml" --data-dir "${dir_a[2]}" >>"${dir_a[2]%/*}/node3.log" 2>&1 &
    pid_a[2]=$!
    register_pid "${pid_a[2]}"
    wait_until 900 "node3 healthy again" tally_healthy "${url_a[2]}"
    elapsed=$(scale_since "$start")
    wait_until 900 "node3's new replicas voters holding everything" scale_caught_up "${url_a[*]}" node3
    caught=$(scale_since "$start")
    local disk3 rss3
    disk3=$(du -sb "${dir_a[2]}" | cut -f1)
    rss3=$(scale_rss_kb "${pid_a[2]}")
    log "scale $topo: node3 back with an empty disk: healthy after ${elapsed}s, replicas voters and caught up after ${caught}s (RSS ${rss3} kB, data ${disk3} B)"
    echo "$topo,$ids,empty-disk,node3,$elapsed,$caught,$rss3,$disk3" >>"$OUT/restarts.csv"
  else
    log "scale $topo: restarted over $ids ids: healthy after ${elapsed}s"
    echo "$topo,$ids,restart,node1,$elapsed,$elapsed" >>"$OUT/restarts.csv"
  fi
  local value
  value=$(curl -fsS "${url_a[0]}/v1/counters/$counter/value?consistency=fresh")
  log "scale $topo: value after the restarts: $value"
  TALLY_PIDS=${pid_a[*]}
  stop_tally
}

# scale_counters_cell TOPOLOGY COUNTERS: COUNTERS new counters, each created by its
# first increment (`INCR` of a new key, the default spec) over RESP, through one
# node; then 90 quiet seconds; then every node's RSS and data directory per counter.
# One line per node in $OUT/counters.csv; the feed's samples in
# $OUT/counters-<topology>-<n>.csv.
scale_counters_cell() {
  local topo=$1 n=$2 i
  scale_start "$topo"
  local -a url_a pid_a port_a dir_a rss0 disk0
  read -r -a url_a <<<"$SCALE_URLS"
  read -r -a pid_a <<<"$SCALE_PIDS"
  read -r -a port_a <<<"$SCALE_PORTS"
  read -r -a dir_a <<<"$SCALE_DIRS"
  for i in "${!pid_a[@]}"; do
    rss0[i]=$(scale_rss_kb "${pid_a[i]}")
    disk0[i]=$(du -sb "${dir_a[i]}" | cut -f1)
  done
  # Every node's CPU (user and system, clock ticks) over the feed: what one
  # creation costs the cluster, whatever the load generator's own limits.
  local pid_stats=() p
  for p in "${pid_a[@]}"; do pid_stats+=("/proc/$p/stat"); done
  local ticks0
  ticks0=$(cat "${pid_stats[@]}" | awk '{ s += $14 + $15 } END { print s }')
  log "scale $topo: creating $n counters by their first increment through ${url_a[0]}"
  "$PY" "$BENCH/lib/dedup_feed.py" --mode counters --port "${port_a[0]}" --pid "${pid_a[0]}" \
    --data-dir "${dir_a[0]}" --counter "new:" --ids "$n" --connections 32 --pipeline 64 --every 10 \
    >"$OUT/counters-$topo-$n.csv"
  local last fed acked errors cpu_us
  cpu_us=$(cat "${pid_stats[@]}" | awk -v t0="$ticks0" -v hz="$(getconf CLK_TCK)" -v n="$n" \
    '{ s += $14 + $15 } END { printf "%d", (s - t0) * 1e6 / hz / n }')
  last=$(tail -n 1 "$OUT/counters-$topo-$n.csv")
  fed=$(cut -d, -f1 <<<"$last")
  acked=$(cut -d, -f2 <<<"$last")
  errors=$(cut -d, -f4 <<<"$last")
  log "scale $topo: $acked of $n counters created in ${fed}s ($(awk -v a="$acked" -v s="$fed" 'BEGIN { printf "%d", a / s }')/s), $errors errors, ${cpu_us} µs of the nodes' CPU per counter"
  # Past the engine's idle eviction of counters (`counter_idle_evict_ms`, 60 s), so
  # what stays is what an idle counter costs.
  sleep 90
  for i in "${!pid_a[@]}"; do
    local rss disk
    rss=$(scale_rss_kb "${pid_a[i]}")
    disk=$(du -sb "${dir_a[i]}" | cut -f1)
    echo "$topo,$n,node$((i + 1)),$acked,$errors,$fed,$cpu_us,${rss0[i]},$rss,${disk0[i]},$disk" >>"$OUT/counters.csv"
    log "scale $topo node$((i + 1)): RAM $(((rss - rss0[i]) * 1024 / n)) B/counter, disk $(((disk - disk0[i]) / n)) B/counter (RSS ${rss} kB)"
  done
  stop_tally
}

section_scale() {
  local ids n topo
  if [[ -n ${SCALE_COUNTERS-200000} ]]; then
    echo "topology,counters,node,acked,errors,feed_seconds,cpu_us_per_counter,rss_kb_before,rss_kb_after,disk_bytes_before,disk_bytes_after" >"$OUT/counters.csv"
  fi
  for n in ${SCALE_COUNTERS-200000}; do
    for topo in ${SCALE_TOPOLOGIES:-one three}; do
      scale_counters_cell "$topo" "$n"
    done
  done
  if [[ -n ${SCALE_IDS-1000000} ]]; then
    echo "topology,ids,node,rss_kb_before,rss_kb_after,disk_bytes_before,disk_bytes_after,feed_seconds" >"$OUT/scale.csv"
    echo "topology,ids,event,node,healthy_s,caught_up_s,rss_kb,disk_bytes" >"$OUT/restarts.csv"
  fi
  for ids in ${SCALE_IDS-1000000}; do
    for topo in ${SCALE_TOPOLOGIES:-one three}; do
      scale_cell "$topo" "$ids"
    done
  done
}
