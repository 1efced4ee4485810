#!/usr/bin/python3
"""Runs one benchmark cell: a load client against server processes that are already
running, while sampling the servers' CPU time and resident memory from /proc.

    measure.py --out raw.jsonl --tool tally --server-pids "123 456" \
        --field system=Tally --field writers=64 --timeout 30 -- tally load ...

Appends one JSON object per cell to --out: the --field values, the client's figures
(increments/s, p50/p99/p999 acknowledgement latency in microseconds, acknowledged
count) parsed from its output, and the measured server CPU % and peak RSS.

Server CPU: every process in the tree under each --server-pids root (the root and
all its descendants, found through /proc/*/stat) is sampled every SAMPLE_INTERVAL_S.
Total CPU time at a sample = utime + stime of every live process in the tree plus
cutime + cstime of the roots (children that exited and were reaped by a root, such
as PostgreSQL backends, are counted there). CPU % = (total at the end - total at the
start) / client wall time * 100; 100 % is one core fully busy.

Server RSS: VmRSS of /proc/PID/status summed over the tree at each sample; the
largest sum seen during the run is reported. It counts memory shared between
processes (PostgreSQL's shared buffers) once per process that touched it, so the
proportional set size (Pss of /proc/PID/smaps_rollup, shared pages divided among the
processes sharing them), summed the same way every PSS_EVERY-th sample, is reported too.

Client CPU: the client's own user + system time (wait4 rusage, children included).
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time

SAMPLE_INTERVAL_S = 0.1
PSS_EVERY = 5
CLK_TCK = os.sysconf("SC_CLK_TCK")
# After the client exits, how long to wait for server-side session processes (PostgreSQL
# backends) to exit, so their CPU time is reaped into the root's cutime before the last
# sample.
SETTLE_S = 0.5
# A client that produced no figures (it could not even start its run) is run again once.
ATTEMPTS_RETRIED = 1


def read_stat(pid):
    """(ppid, utime+stime, cutime+cstime) in clock ticks, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = data[data.rindex(")") + 2 :].split()
    ppid = int(rest[1])
    utime, stime, cutime, cstime = (int(x) for x in rest[11:15])
    return ppid, utime + stime, cutime + cstime


def read_rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return 0  # kernel threads and zombies have no VmRSS line


def read_pss_kib(pid):
    """Proportional set size: shared pages divided among the processes sharing them."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return 0


def tree(roots):
    """The roots and all their live descendants."""
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = read_stat(int(name))
        if st is not None:
            children.setdefault(st[0], []).append(int(name))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def sample(roots, pss=False):
    """(total CPU ticks of the tree, RSS KiB of the tree, PSS KiB of the tree or None)."""
    cpu, rss, pss_kib = 0, 0, 0 if pss else None
    for pid in tree(roots):
        st = read_stat(pid)
        if st is None:
            continue
        cpu += st[1]
        if pid in roots:
            cpu += st[2]
        r = read_rss_kib(pid)
        rss += r or 0
        if pss:
            pss_kib += read_pss_kib(pid) or 0
    return cpu, rss, pss_kib


class Monitor(threading.Thread):
    def __init__(self, roots):
        super().__init__(daemon=True)
        self.roots = roots
        self.stop = threading.Event()
        self.rss_max_kib = 0
        self.pss_max_kib = 0
        self.samples = 0

    def run(self):
        while not self.stop.is_set():
            # PSS (smaps_rollup walks every mapping) is read on every PSS_EVERY-th sample only.
            _, rss, pss = sample(self.roots, pss=self.samples % PSS_EVERY == 0)
            self.rss_max_kib = max(self.rss_max_kib, rss)
            if pss is not None:
                self.pss_max_kib = max(self.pss_max_kib, pss)
            self.samples += 1
            self.stop.wait(SAMPLE_INTERVAL_S)


def percentile(sorted_values, q):
    """Nearest-rank percentile of a sorted list."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def parse_pgbench(text, log_prefix):
    m = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", text)
    tps = float(m.group(1)) if m else None
    m = re.search(r"number of failed transactions: (\d+)", text)
    failed = int(m.group(1)) if m else 0
    latencies = []
    directory, base = os.path.split(log_prefix)
    for name in sorted(os.listdir(directory or ".")):
        if not name.startswith(base + "."):
            continue
        with open(os.path.join(directory, name)) as f:
            for line in f:
                parts = line.split()
                # client_id transaction_no time script_no time_epoch time_us [...]
                if len(parts) >= 6 and parts[2].isdigit():
                    latencies.append(int(parts[2]))
        os.unlink(os.path.join(directory, name))
    latencies.sort()
    return {
        "incr_per_s": tps,
        "acknowledged": len(latencies),
        "failed": failed,
        "p50_us": percentile(latencies, 0.50),
        "p99_us": percentile(latencies, 0.99),
        "p999_us": percentile(latencies, 0.999),
    }


def parse_redis_benchmark(text):
    # Progress lines end in \r; keep the final report.
    text = text.replace("\r", "\n")
    out = {}
    m = re.search(r"(\d+) requests completed in ([0-9.]+) seconds", text)
    if m:
        out["acknowledged"] = int(m.group(1))
    m = re.search(r"throughput summary: ([0-9.]+) requests per second", text)
    out["incr_per_s"] = float(m.group(1)) if m else None
    m = re.search(
        r"avg\s+min\s+p50\s+p95\s+p99\s+max\s*\n\s*([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)",
        text,
    )
    if m:
        out["p50_us"] = round(float(m.group(3)) * 1000)
        out["p99_us"] = round(float(m.group(5)) * 1000)
    # The percentile distribution is printed at halving steps (…, 99.805 %, 99.902 %, …);
    # p99.9 is the first printed step at or above 99.9 %: an upper bound.
    dist = [
        (float(p), float(v))
        for p, v in re.findall(r"^\s*([0-9.]+)% <= ([0-9.]+) milliseconds", text, re.M)
    ]
    for p, v in dist:
        if p >= 99.9:
            out["p999_us"] = round(v * 1000)
            break
    out["failed"] = 0
    return out


WRK_UNITS_US = {"us": 1.0, "ms": 1000.0, "s": 1_000_000.0}


def parse_wrk(text):
    # wrk --latency: "N requests in Xs", "Requests/sec: R", the latency distribution
    # ("50%  1.23ms"), and "Non-2xx or 3xx responses: K" when some failed.
    out = {}
    m = re.search(r"(\d+) requests in ([0-9.]+)(us|ms|s|m)", text)
    total = int(m.group(1)) if m else None
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    failed = int(m.group(1)) if m else 0
    m = re.search(r"Requests/sec:\s+([0-9.]+)", text)
    rate = float(m.group(1)) if m else None
    if rate is not None and total:
        rate = rate * (total - failed) / total  # acknowledged increments only
    out["incr_per_s"] = rate
    if total is not None:
        out["acknowledged"] = total - failed
    out["failed"] = failed
    for q, key in (("50", "p50_us"), ("99", "p99_us")):
        m = re.search(rf"^\s*{q}(?:\.000)?%\s+([0-9.]+)(us|ms|s)\s*$", text, re.M)
        if m:
            out[key] = round(float(m.group(1)) * WRK_UNITS_US[m.group(2)])
    return out


def parse_tally(text):
    # With --json the report is the first JSON object; an error object may follow it.
    report, _ = json.JSONDecoder().raw_decode(text[text.index("{") :])
    lat = report["latency_us"]["per_request"]
    verify = report.get("verify")
    return {
        "incr_per_s": report["increments_per_s"],
        "acknowledged": report["acknowledged"],
        "failed": report["failed"],
        "errors": report["errors"],
        "p50_us": lat["p50"],
        "p99_us": lat["p99"],
        "p999_us": lat["p999"],
        "per_increment_p50_us": report["latency_us"]["per_increment"]["p50"],
        "verified": None if verify is None else bool(verify["pass"]),
        "grew": None if verify is None else verify["grew"],
        "verify_complete": None if verify is None else verify["complete"],
    }


def count(shell_cmd):
    """The integer a shell command prints (an empty answer is 0), or None on failure."""
    try:
        out = subprocess.run(shell_cmd, shell=True, capture_output=True, text=True, timeout=30, check=True)
        return int(out.stdout.strip() or 0)
    except (subprocess.SubprocessError, ValueError):
        return None


def run_once(args, cmd, roots):
    """Runs the client once while sampling the servers; the cell's figures."""
    record = {}
    before = count(args.count_cmd) if args.count_cmd else None
    cpu_start, _, _ = sample(roots)
    mon = Monitor(roots)
    mon.start()
    started = time.monotonic()
    full_cmd = ["timeout", "--kill-after=5", str(int(math.ceil(args.timeout)))] + cmd
    proc = subprocess.Popen(full_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.stdout.read()
    _, status, rusage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - started
    time.sleep(SETTLE_S)
    cpu_end, _, _ = sample(roots)
    mon.stop.set()
    mon.join()

    text = output.decode("utf-8", "replace")
    if args.log:
        # Keep what a terminal would show last on each line, not every progress redraw.
        shown = "\n".join(line.split("\r")[-1] for line in text.split("\n"))
        with open(args.log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{shown}\n[exit {proc.returncode}, {wall:.2f} s]\n\n")

    record.update(
        {
            "exit_code": proc.returncode,
            "wall_s": round(wall, 3),
            "server_cpu_pct": round((cpu_end - cpu_start) / CLK_TCK / wall * 100, 1),
            "server_rss_mib": round(mon.rss_max_kib / 1024, 1),
            "server_pss_mib": round(mon.pss_max_kib / 1024, 1),
            "client_cpu_pct": round((rusage.ru_utime + rusage.ru_stime) / wall * 100, 1),
        }
    )
    try:
        if args.tool == "pgbench":
            record.update(parse_pgbench(text, args.pglog_prefix))
        elif args.tool == "redis":
            record.update(parse_redis_benchmark(text))
        elif args.tool == "tally":
            record.update(parse_tally(text))
        elif args.tool == "wrk":
            record.update(parse_wrk(text))
        elif args.tool == "reader":
            record.update(json.JSONDecoder().raw_decode(text[text.index("{") :])[0])
    except (ValueError, KeyError, OSError) as e:
        record["parse_error"] = f"{type(e).__name__}: {e}"
        print(f"measure.py: could not parse the client's output: {e}", file=sys.stderr)
    for key in [k for k, v in record.items() if v is None]:
        del record[key]  # a figure the output lacked is absent, not null
    if before is not None and "acknowledged" in record:
        after = count(args.count_cmd)
        grew = None if before is None or after is None else after - before
        record["grew"] = grew
        # A client that stops mid-request (wrk at its deadline) may leave up to
        # `--verify-slack` requests applied but unacknowledged.
        record["verified"] = grew is not None and record["acknowledged"] <= grew <= record["acknowledged"] + args.verify_slack
    if proc.returncode == 124 or proc.returncode == 137:
        record["note"] = "client killed by timeout"
    return record


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tool", choices=["pgbench", "redis", "tally", "wrk", "reader", "none"], required=True)
    ap.add_argument("--server-pids", required=True, help="space-separated root PIDs")
    ap.add_argument("--field", action="append", default=[], help="key=value copied into the record")
    ap.add_argument("--timeout", type=float, required=True, help="seconds before the client is killed")
    ap.add_argument("--pglog-prefix")
    ap.add_argument("--log", help="file that receives the client's output")
    ap.add_argument(
        "--count-cmd",
        help="shell command printing the counter's total; run before and after the client to "
        "check that it grew by exactly the acknowledged increments",
    )
    ap.add_argument(
        "--verify-slack",
        type=int,
        default=0,
        help="requests the counter may have grown by beyond the acknowledged ones (in flight when the client stopped)",
    )
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    roots = [int(p) for p in args.server_pids.split()]

    record = {}
    for kv in args.field:
        key, _, value = kv.partition("=")
        record[key] = int(value) if value.lstrip("-").isdigit() else value

    first_failure = None
    for attempt in range(1 + ATTEMPTS_RETRIED):
        result = run_once(args, cmd, roots)
        if args.tool == "none" or "incr_per_s" in result or "reads_per_s" in result or attempt == ATTEMPTS_RETRIED:
            break
        # The client produced no figures at all (it could not start its run): say so, retry once.
        first_failure = result.get("parse_error") or f"exit {result['exit_code']}"
        print(f"measure.py: the client failed ({first_failure}); retrying once", file=sys.stderr)
        time.sleep(1)
    record.update(result)
    if first_failure:
        record["note"] = f"first attempt failed ({first_failure}), retried"

    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    shown = {k: record.get(k) for k in ("incr_per_s", "reads_per_s", "p50_us", "p99_us", "p999_us", "server_cpu_pct", "server_rss_mib", "server_pss_mib")}
    print("   ", " ".join(f"{k}={v}" for k, v in shown.items() if v is not None), flush=True)


if __name__ == "__main__":
    main()
