#!/usr/bin/env bash
# Which lines of tally-engine, tally-replica, tally-cluster and tally-raft the
# simulator's runs execute: tier 2 (engines and range groups) beside tier 3 (whole
# cluster nodes), each with one copy and with three, in a build instrumented for
# source-based coverage (LLVM's profile format; `llvm-cov` and `llvm-profdata` of
# LLVM 19 or newer read rustc's: `apt-get install llvm-19`).
#
#   simulations/coverage.sh              # 20 heavy seeds per run
#   SEEDS=100 simulations/coverage.sh
#
# Prints, per crate, its instrumented lines and the share each tier executed, then
# the files tier 3 leaves most untouched. Test code is not compiled into the
# simulator, so it is not counted.
set -euo pipefail
cd "$(dirname "$0")/.."

LLVM_BIN=${LLVM_BIN:-/usr/lib/llvm-19/bin}
SEEDS=${SEEDS:-20}
for tool in llvm-cov llvm-profdata; do
  if [ ! -x "$LLVM_BIN/$tool" ]; then
    echo "coverage.sh: $LLVM_BIN/$tool is missing (apt-get install llvm-19, or set LLVM_BIN)" >&2
    exit 2
  fi
done

target=target/coverage
RUSTFLAGS='-C instrument-coverage --cfg tokio_unstable' CARGO_TARGET_DIR=$target \
  cargo build --release -p tally-sim --quiet
bin=$target/release/tally-sim
prof=$target/profiles
rm -rf "$prof"
mkdir -p "$prof"

# run NAME ARGS...: runs the simulator and merges its profile into NAME.profdata.
run() {
  local name=$1
  shift
  mkdir -p "$prof/$name"
  LLVM_PROFILE_FILE="$prof/$name/%p-%m.profraw" "$bin" --seeds "0..$SEEDS" --nodes 5 --faults heavy "$@" >/dev/null
}
run tier2 --tier engine
run tier2 --tier engine --replicas 3
run tier3 --tier cluster
run tier3 --tier cluster --replicas 3
for tier in tier2 tier3; do
  "$LLVM_BIN/llvm-profdata" merge -sparse "$prof/$tier"/*.profraw -o "$prof/$tier.profdata"
  "$LLVM_BIN/llvm-cov" export "$bin" -instr-profile="$prof/$tier.profdata" -summary-only \
    -ignore-filename-regex='(/\.cargo/|/rustc/|/target/|/simulations/)' >"$prof/$tier.json"
done

python3 - "$prof/tier2.json" "$prof/tier3.json" "$SEEDS" <<'EOF'
import json, sys
from collections import defaultdict

CRATES = ["tally-engine", "tally-replica", "tally-cluster", "tally-raft"]

def files(path):
    out = {}
    for f in json.load(open(path))["data"][0]["files"]:
        name = f["filename"]
        for c in CRATES:
            marker = f"/crates/{c}/src/"
            if marker in name:
                lines = f["summary"]["lines"]
                out[(c, name.split(marker)[1])] = (lines["count"], lines["covered"])
    return out

t2, t3 = files(sys.argv[1]), files(sys.argv[2])
print(f"Lines executed by {sys.argv[3]} heavy seeds of 5 nodes per run (one copy and three copies):\n")
print("| crate | instrumented lines | tier 2 | tier 3 |")
print("| --- | --- | --- | --- |")
for c in CRATES:
    keys = sorted(set(k for k in t2.keys() | t3.keys() if k[0] == c))
    total = sum(max(t2.get(k, (0, 0))[0], t3.get(k, (0, 0))[0]) for k in keys)
    cov2 = sum(t2.get(k, (0, 0))[1] for k in keys)
    cov3 = sum(t3.get(k, (0, 0))[1] for k in keys)
    print(f"| {c} | {total} | {100 * cov2 / max(total, 1):.1f} % | {100 * cov3 / max(total, 1):.1f} % |")
print("\nFiles tier 3 executes least (lines missed):\n")
missed = sorted(((n - c, k, n) for k, (n, c) in t3.items()), reverse=True)[:15]
print("| file | lines | missed by tier 3 |")
print("| --- | --- | --- |")
for m, (c, f), n in missed:
    print(f"| {c}/src/{f} | {n} | {m} |")
EOF
