#!/usr/bin/env bash
# Starts, stops or reports the 3-node local cluster of cluster-config/local3/.
#
#   scripts/local-cluster.sh start    # build tallyd (release), start 3 nodes, wait until healthy
#   scripts/local-cluster.sh status   # pid, health and the cluster view of each node
#   scripts/local-cluster.sh stop     # SIGTERM each node by PID, wait for a clean exit
#
# Data, logs and PID files live under ./data (DATA_DIR to change it).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA_DIR=${DATA_DIR:-./data}
TALLYD=${TALLYD:-target/release/tallyd}
NODES=(1 2 3)
HEALTH_WAIT_S=${HEALTH_WAIT_S:-60}

http_port() { echo $((7070 + $1)); }

healthy() {
  curl -fsS -m 2 "http://127.0.0.1:$(http_port "$1")/healthz" >/dev/null 2>&1
}

pid_of() {
  local f="$DATA_DIR/node$1.pid"
  [[ -f $f ]] && kill -0 "$(cat "$f")" 2>/dev/null && cat "$f"
}

start() {
  [[ -x $TALLYD ]] || cargo build --release --bin tallyd
  mkdir -p "$DATA_DIR"
  for n in "${NODES[@]}"; do
    if pid=$(pid_of "$n"); then echo "node$n already running (pid $pid)"; continue; fi
    "$TALLYD" --config "cluster-config/local3/node$n.toml" --data-dir "$DATA_DIR/node$n" \
      >>"$DATA_DIR/node$n.log" 2>&1 &
    echo $! >"$DATA_DIR/node$n.pid"
    echo "node$n started (pid $!), log $DATA_DIR/node$n.log"
  done
  local deadline=$((SECONDS + HEALTH_WAIT_S))
  for n in "${NODES[@]}"; do
    until healthy "$n"; do
      if ((SECONDS > deadline)); then echo "node$n is not healthy after ${HEALTH_WAIT_S}s; see $DATA_DIR/node$n.log" >&2; exit 1; fi
      sleep 0.2
    done
  done
  echo "cluster healthy: http://127.0.0.1:7071 http://127.0.0.1:7072 http://127.0.0.1:7073"
}

stop() {
  for n in "${NODES[@]}"; do
    if pid=$(pid_of "$n"); then
      kill -TERM "$pid"
      for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      if kill -0 "$pid" 2>/dev/null; then echo "node$n (pid $pid) did not stop; killing" >&2; kill -KILL "$pid"; fi
      echo "node$n stopped"
    fi
    rm -f "$DATA_DIR/node$n.pid"
  done
}

status() {
  for n in "${NODES[@]}"; do
    if pid=$(pid_of "$n"); then
      if healthy "$n"; then h=healthy; else h=unhealthy; fi
      echo "node$n pid $pid $h"
    else
      echo "node$n stopped"
    fi
  done
  curl -fsS -m 2 "http://127.0.0.1:7071/v1/cluster" 2>/dev/null && echo || true
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
