#!/usr/bin/env bash
# Which lines of Tally's production code the seeded simulator (tally-sim) executes.
#
# Builds tally-sim with LLVM source-based coverage (`-C instrument-coverage`), runs
# a few heavy-fault seed ranges of tier 2 (`--tier engine`) and tier 3
# (`--tier cluster`), one copy and three (plus tier 2 with `--small-snapshots`, the
# only way the simulator reaches range-group snapshot transfer), merges the profiles with LLVM 22's
# llvm-profdata and prints, per crate, lines covered / lines instrumented, then the
# files with the most unexecuted lines in each crate.
#
#   simulations/coverage.sh                       # defaults below, ~10 min on 2 cores
#   CLUSTER_SEEDS=0..100 ENGINE_R3_SEEDS= simulations/coverage.sh   # empty range = skip
#
# Environment (all optional):
#   REPO_ROOT        the Tally checkout (default: the parent of this script's directory)
#   LLVM_BIN         LLVM 22 tools (default /usr/lib/llvm-22/bin; installed with apt if missing)
#   COV_TARGET_DIR   cargo target dir of the instrumented build (default target/cov)
#   COV_OUT          fresh directory for profiles and reports (default $COV_TARGET_DIR/run; wiped)
#   CLUSTER_SEEDS    seeds of --tier cluster, one copy          (default 0..200, ~80 s)
#   CLUSTER_R3_SEEDS seeds of --tier cluster --replicas 3       (default 0..100, ~160 s)
#   ENGINE_SEEDS     seeds of --tier engine, one copy           (default 0..500, ~30 s)
#   ENGINE_R3_SEEDS  seeds of --tier engine --replicas 3        (default 0..80, ~90 s)
#   ENGINE_SNAP_SEEDS seeds of --tier engine --replicas 3 --small-snapshots (default 0..40, ~40 s)
#   CLUSTER_SNAP_SEEDS seeds of --tier cluster --replicas 3 --small-snapshots (default 0..20, ~40 s)
#   EMBEDDED_SEEDS   seeds of --embedded (one engine on its local catalog) (default 0..300, ~20 s)
#                    (times: instrumented, --threads 1, on a busy 2-core machine)
#   FAULTS           light|heavy (default heavy);  THREADS  simulator threads (default 1)
#   SIM_ARGS         extra arguments for every run (e.g. "--nodes 5")
#   CRATES           crates to tabulate (default: engine replica cluster raft, then
#                    raft-kit core store transport as extra rows)
#   EXCLUDE_REGEX    files left out of every count (default below: HTTP/RESP/TLS parsing)
#   TOP              least-covered files listed per crate (default 10)
#   COV_ALL_DEPS=1   instrument every dependency too (slower build and runs; the
#                    table is the same, since only Tally's own sources are counted)
#
# What "lines" means: llvm-cov's line count is the lines that carry a coverage
# region (code), not blank lines, comments or items without code. Test code is not
# counted: `#[cfg(test)]` modules and `tests/` are not compiled into a non-test
# build of the simulator, so their lines never appear as instrumented. Unused
# non-test functions still count (rustc emits zero-count records for them).
set -euo pipefail

# --- 0. Settings -------------------------------------------------------------------
REPO_ROOT=${REPO_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$REPO_ROOT"
[ -f simulations/Cargo.toml ] || { echo "coverage.sh: $REPO_ROOT is not a Tally checkout (set REPO_ROOT)" >&2; exit 2; }

LLVM_BIN=${LLVM_BIN:-/usr/lib/llvm-22/bin}
COV_TARGET_DIR=${COV_TARGET_DIR:-target/cov}
COV_OUT=${COV_OUT:-$COV_TARGET_DIR/run}
CLUSTER_SEEDS=${CLUSTER_SEEDS-0..200}
CLUSTER_R3_SEEDS=${CLUSTER_R3_SEEDS-0..100}
ENGINE_SEEDS=${ENGINE_SEEDS-0..500}
ENGINE_R3_SEEDS=${ENGINE_R3_SEEDS-0..80}
ENGINE_SNAP_SEEDS=${ENGINE_SNAP_SEEDS-0..40}
CLUSTER_SNAP_SEEDS=${CLUSTER_SNAP_SEEDS-0..20}
EMBEDDED_SEEDS=${EMBEDDED_SEEDS-0..300}
FAULTS=${FAULTS:-heavy}
THREADS=${THREADS:-1}
SIM_ARGS=${SIM_ARGS:-}
CRATES=${CRATES:-tally-engine tally-replica tally-cluster tally-raft tally-raft-kit tally-core tally-store tally-transport}
# Excluded from every count (none of these is simulator territory):
#   crates/tally-server/  HTTP API, RESP protocol, web UI (not linked into tally-sim anyway)
#   crates/tally-tls/     TLS config and handshake admission (linked, via raft/transport)
#   crates/tally-auth/, crates/tally-cli/, crates/tally-bench/  client/tooling crates
#   any file or directory named http*, resp*, tls* (none exists in the tabulated
#   crates today; the pattern guards future ones)
EXCLUDE_REGEX=${EXCLUDE_REGEX:-'/crates/tally-(server|tls|auth|cli|bench)/|/(http|resp|tls)[^/]*(/|\.rs$)'}
TOP=${TOP:-10}

# --- 1. LLVM 22 tools (rustc 1.95 writes LLVM 22 profiles; older llvm-cov can't read them)
if [ ! -x "$LLVM_BIN/llvm-cov" ] || [ ! -x "$LLVM_BIN/llvm-profdata" ]; then
  echo "== installing llvm-22 (apt-get)" >&2
  apt-get install -y llvm-22 >/dev/null || { apt-get update >/dev/null && apt-get install -y llvm-22 >/dev/null; }
fi

# --- 2. Instrumented build -----------------------------------------------------------
# `--cfg tokio_unstable` goes to every crate, as in the normal simulator build. By
# default `-C instrument-coverage` goes only to workspace crates, through cargo's
# RUSTC_WORKSPACE_WRAPPER: dependencies (tokio, sled, openraft, ...) run at full
# speed, and the final tally-sim link still pulls in the profiler runtime.
mkdir -p "$COV_TARGET_DIR"
export CARGO_TARGET_DIR=$COV_TARGET_DIR CARGO_INCREMENTAL=0
# Anything instrumented that runs during the build writes its profile here, not into the repo.
export LLVM_PROFILE_FILE=/tmp/tally-cov-build-%p.profraw
if [ "${COV_ALL_DEPS:-0}" = 1 ]; then
  export RUSTFLAGS='--cfg tokio_unstable -C instrument-coverage'
else
  export RUSTFLAGS='--cfg tokio_unstable'
  wrapper=$COV_TARGET_DIR/rustc-instrument-coverage.sh
  cat >"$wrapper.new" <<'EOF'
#!/bin/sh
# cargo calls: <this> <rustc> <args...>; add coverage instrumentation, except to build scripts.
case " $* " in
  *" --crate-name build_script_"*) exec "$@" ;;
  *) exec "$@" -C instrument-coverage ;;
esac
EOF
  chmod +x "$wrapper.new"
  # Replace it only when it changed, so cargo's fingerprints stay valid between runs.
  if cmp -s "$wrapper.new" "$wrapper"; then rm "$wrapper.new"; else mv "$wrapper.new" "$wrapper"; fi
  export RUSTC_WORKSPACE_WRAPPER=$(cd "$(dirname "$wrapper")" && pwd)/$(basename "$wrapper")
fi
echo "== building instrumented tally-sim into $COV_TARGET_DIR" >&2
build_start=$SECONDS
cargo build --release -p tally-sim --quiet
echo "   build: $((SECONDS - build_start)) s" >&2
unset LLVM_PROFILE_FILE RUSTFLAGS RUSTC_WORKSPACE_WRAPPER
bin=$COV_TARGET_DIR/release/tally-sim

# --- 3. Seeded runs, each writing its profiles into its own fresh directory ----------
rm -rf "$COV_OUT"
mkdir -p "$COV_OUT"
runs=()
# run NAME SEEDS ARGS...: one simulator process over SEEDS; a failing seed is reported
# but doesn't stop the script (its lines were executed all the same).
run() {
  local name=$1 seeds=$2
  shift 2
  [ -n "$seeds" ] || { echo "== $name: skipped (empty seed range)" >&2; return 0; }
  mkdir -p "$COV_OUT/$name"
  echo "== $name: --seeds $seeds $* --faults $FAULTS --threads $THREADS $SIM_ARGS" >&2
  local start=$SECONDS rc=0 pid
  # shellcheck disable=SC2086  # SIM_ARGS is split on purpose
  LLVM_PROFILE_FILE="$COV_OUT/$name/%p-%m.profraw" \
    "$bin" --seeds "$seeds" --faults "$FAULTS" --threads "$THREADS" "$@" $SIM_ARGS \
    >"$COV_OUT/$name.log" 2>&1 &
  pid=$!
  wait "$pid" || rc=$?
  # sled temporary databases that a crashed/abandoned node leaves in /dev/shm: sled names
  # them pagecache.tmp.<salt> with salt = now<<48 + pid<<16 + counter, so delete only
  # those whose pid field is this run's process.
  python3 - "$pid" <<'EOF'
import os, shutil, sys
pid = int(sys.argv[1])
for name in os.listdir("/dev/shm"):
    if name.startswith("pagecache.tmp."):
        try:
            salt = int(name[len("pagecache.tmp."):])
        except ValueError:
            continue
        if (salt >> 16) & 0xFFFFFFFF == pid:
            path = os.path.join("/dev/shm", name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
EOF
  echo "   $name: $((SECONDS - start)) s, exit $rc$([ $rc = 0 ] || echo " (see $COV_OUT/$name.log)")" >&2
  runs+=("$name")
}
run_start=$SECONDS
run cluster    "$CLUSTER_SEEDS"    --tier cluster
run cluster-r3 "$CLUSTER_R3_SEEDS" --tier cluster --replicas 3
run engine     "$ENGINE_SEEDS"     --tier engine
run engine-r3  "$ENGINE_R3_SEEDS"  --tier engine --replicas 3
run engine-snap "$ENGINE_SNAP_SEEDS" --tier engine --replicas 3 --small-snapshots
run cluster-snap "$CLUSTER_SNAP_SEEDS" --tier cluster --replicas 3 --small-snapshots
run embedded   "$EMBEDDED_SEEDS"   --embedded
echo "== seeds: $((SECONDS - run_start)) s in all" >&2
[ ${#runs[@]} -gt 0 ] || { echo "coverage.sh: every seed range is empty" >&2; exit 2; }

# --- 4. Merge and report -------------------------------------------------------------
# One profile per run (for the per-run columns) and one over all runs.
sources=()
for c in $CRATES; do sources+=("crates/$c/src"); done
for name in "${runs[@]}" all; do
  if [ "$name" = all ]; then
    inputs=()
    for r in "${runs[@]}"; do inputs+=("$COV_OUT/$r.profdata"); done
    "$LLVM_BIN/llvm-profdata" merge -sparse "${inputs[@]}" -o "$COV_OUT/all.profdata"
  else
    "$LLVM_BIN/llvm-profdata" merge -sparse "$COV_OUT/$name"/*.profraw -o "$COV_OUT/$name.profdata"
  fi
  # Per-file summaries of the tabulated crates' sources only.
  "$LLVM_BIN/llvm-cov" export "$bin" -instr-profile="$COV_OUT/$name.profdata" -summary-only \
    -ignore-filename-regex="$EXCLUDE_REGEX" "${sources[@]}" >"$COV_OUT/$name.json"
done
# llvm-cov's own per-file report of the merged profile, kept for reading.
"$LLVM_BIN/llvm-cov" report "$bin" -instr-profile="$COV_OUT/all.profdata" \
  -ignore-filename-regex="$EXCLUDE_REGEX" "${sources[@]}" >"$COV_OUT/report.txt"

# --- 5. Tables -----------------------------------------------------------------------
python3 - "$REPO_ROOT" "$COV_OUT" "$TOP" "$EXCLUDE_REGEX" "$CRATES" "${runs[@]}" <<'EOF'
import json, os, re, sys

root, out, top, exclude, crates = sys.argv[1], sys.argv[2], int(sys.argv[3]), re.compile(sys.argv[4]), sys.argv[5].split()
runs = sys.argv[6:]

def load(name):
    """{(crate, file under src/): (lines instrumented, lines covered)}"""
    files = {}
    for f in json.load(open(os.path.join(out, name + ".json")))["data"][0]["files"]:
        path = f["filename"]
        for c in crates:
            marker = f"/crates/{c}/src/"
            if marker in path:
                l = f["summary"]["lines"]
                files[(c, path.split(marker, 1)[1])] = (l["count"], l["covered"])
    return files

merged = load("all")
per_run = {r: load(r) for r in runs}
pct = lambda a, b: f"{100 * a / b:5.1f} %" if b else "    – "

print(f"\nLines executed by the simulator (non-test code; excluded: {exclude.pattern})\n")
head = f"{'crate':<16} {'covered':>8} {'total':>7} {'all runs':>8}" + "".join(f" {r:>11}" for r in runs)
print(head)
print("-" * len(head))
T = C = 0
for c in crates:
    keys = [k for k in merged if k[0] == c]
    total = sum(merged[k][0] for k in keys)
    cov = sum(merged[k][1] for k in keys)
    T += total; C += cov
    row = f"{c:<16} {cov:>8} {total:>7} {pct(cov, total):>8}"
    for r in runs:
        row += f" {pct(sum(per_run[r].get(k, (0, 0))[1] for k in keys), total):>11}"
    print(row)
print("-" * len(head))
print(f"{'total':<16} {C:>8} {T:>7} {pct(C, T):>8}")

print(f"\nLeast-covered files per crate (by lines not executed; {top} per crate)")
for c in crates:
    rows = sorted(((n - k, f, n) for (cc, f), (n, k) in merged.items() if cc == c), key=lambda r: (-r[0], r[1]))
    print(f"\n  {c}")
    for miss, f, n in rows[:top]:
        if miss:
            print(f"    {miss:>5} of {n:>5} missed ({pct(n - miss, n).strip():>7} covered)  src/{f}")
    # Source files with no instrumented line at all: declarations only, test-only,
    # or not compiled into the simulator (features, cfgs).
    src = os.path.join(root, "crates", c, "src")
    absent = sorted(os.path.relpath(os.path.join(d, n), src) for d, _, ns in os.walk(src) for n in ns
                    if n.endswith(".rs") and (c, os.path.relpath(os.path.join(d, n), src)) not in merged
                    and not exclude.search(os.path.join(d, n)))
    if absent:
        print(f"    (no instrumented lines: {', '.join(absent)})")
print(f"\nProfiles, logs and llvm-cov's per-file report: {out}/ (report.txt)")
EOF
