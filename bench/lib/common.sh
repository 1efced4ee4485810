# shellcheck shell=bash
# Helpers shared by the benchmark scripts: logging, the registry of started servers
# (every one is stopped by PID on exit), free loopback ports, readiness waits.

PY=/usr/bin/python3 # Debian's Python, whatever else is first on PATH

log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

# PIDs of processes this run started, in start order. cleanup stops them in reverse.
STARTED_PIDS=()
register_pid() { STARTED_PIDS+=("$1"); }
# Forgets a PID once its process is gone, so a later cleanup cannot signal a
# different process that reused the number.
unregister_pid() {
  local keep=() p
  for p in "${STARTED_PIDS[@]}"; do
    [[ $p == "$1" ]] || keep+=("$p")
  done
  STARTED_PIDS=("${keep[@]}")
}

# True while PID runs (a zombie, exited but not yet reaped, does not count).
alive() {
  local pid=$1 stat
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [[ ${stat%% *} != Z ]]
}

# stop_pid PID [SIGNAL] [WAIT_S]: signal one process by PID, wait for it to exit,
# SIGKILL it after WAIT_S seconds.
stop_pid() {
  local pid=$1 sig=${2:-TERM} wait_s=${3:-30} i
  if alive "$pid"; then
    kill -"$sig" "$pid" 2>/dev/null || true
    for ((i = 0; i < wait_s * 10; i++)); do
      alive "$pid" || break
      sleep 0.1
    done
    if alive "$pid"; then
      log "pid $pid still running ${wait_s}s after SIG$sig: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  wait "$pid" 2>/dev/null || true
  unregister_pid "$pid"
}

# Stops every registered process that still runs, newest first.
stop_all() {
  local i
  for ((i = ${#STARTED_PIDS[@]} - 1; i >= 0; i--)); do
    stop_pid "${STARTED_PIDS[i]}" TERM 20
  done
}

# free_ports N: N distinct loopback TCP ports that nothing listens on right now.
free_ports() {
  "$PY" - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

# wait_until TIMEOUT_S DESCRIPTION CMD...: run CMD every 0.2 s until it succeeds.
wait_until() {
  local timeout_s=$1 what=$2 deadline
  shift 2
  deadline=$((SECONDS + timeout_s))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "$what not ready after ${timeout_s}s"
    sleep 0.2
  done
}

# The number of whole seconds a cell may run: its duration plus a margin.
cell_timeout() { echo $(($1 + 60)); }
