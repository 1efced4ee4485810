#!/usr/bin/python3
"""Turns one run's raw records into the results: results.md, results.csv, reads.csv,
sketch.csv and the PNG plots, all in the run's output directory.

    report.py bench/results
"""

import csv
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

WRITE_COLUMNS = [
    "system", "config", "requests", "writers", "incr_per_s", "p50_us", "p99_us", "p999_us",
    "server_cpu_pct", "server_cpu_us_per_incr", "server_rss_mib", "server_pss_mib", "client_cpu_pct", "acknowledged",
    "failed", "verified", "wall_s",
]
# The 3-node cluster with every shard replicated (bench/run.sh section tally3r), and the
# same cluster with one copy, which it is compared with.
REPLICATED = "Tally 3 nodes, 3 replicas"
UNREPLICATED = "Tally 3 nodes"
READ_COLUMNS = [
    "system", "shards", "consistency", "reads_per_s", "p50_us", "p99_us", "p999_us", "writers",
    "writes_per_s", "server_cpu_pct", "server_rss_mib", "server_pss_mib", "client_cpu_pct", "incomplete", "errors",
]
SKETCH_COLUMNS = [
    "n", "trial", "tally_estimate", "tally_error", "redis_estimate", "redis_error",
    "tally_sketch_bytes", "tally_counter_bytes_1", "tally_counter_bytes_64", "tally_same_estimate",
    "redis_string_bytes", "redis_memory_usage_bytes", "redis_encoding",
    "tally_stated_error", "tally_insert_s", "redis_insert_s",
]


def load_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def num(v, digits=0):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if digits == 0:
        return f"{v:,.0f}"
    return f"{v:,.{digits}f}"


def us(v):
    """Microseconds, readable: 1 decimal below 100 µs."""
    if v is None:
        return "–"
    return f"{v:,.1f}" if v < 100 else f"{v:,.0f}"


def mem(r):
    """Server RSS, with PSS in parentheses where they differ (memory shared between processes)."""
    rss, pss = r.get("server_rss_mib"), r.get("server_pss_mib")
    if rss is None:
        return "–"
    if pss is None or abs(rss - pss) < 0.1 * rss:
        return num(rss, 1)
    return f"{num(rss, 1)} ({num(pss, 1)})"


def write_csv(path, rows, columns):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})


def verified_text(r):
    v = r.get("verified")
    if v is None:
        return "–"
    if v:
        return "yes"
    grew, acked, failed = r.get("grew"), r.get("acknowledged"), r.get("failed") or 0
    if grew is None or acked is None:
        return "NO"
    if failed and acked <= grew <= acked + failed:
        # A failed request's outcome is unknown (it may have been applied): the total must
        # lie between the acknowledged count and that plus the failed ones.
        return f"within bounds: grew {num(grew)} = acked + {num(grew - acked)} of {num(failed)} failed"
    return f"NO (grew {num(grew)}, acked {num(acked)})"


def plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def resp_section(raw):
    """Markdown lines of the one-client cells: redis-benchmark INCR against Redis and Tally's RESP port."""
    rows = [r for r in raw if r.get("section") == "resp"]
    if not rows:
        return []
    out = [
        "## One client for both: redis-benchmark INCR against Redis and Tally's RESP port",
        "",
        "The same load generator (`redis-benchmark … INCR KEY`) against Redis and against a single Tally node's "
        "Redis-protocol port (and, in rows of the 3-node cluster with 3 replicas, against its node 1, which "
        "forwards what the other nodes lead). Pipelined rows send 16 commands per round trip (`-P 16`). Server CPU µs per "
        "increment = server CPU ÷ increments/s. ÷ Redis everysec and ÷ Redis always compare with the Redis "
        "row of the same writers and pipelining (a durable Tally row, `sync`, is to be read against "
        "`always`). `TALLY.INCRBY` rows carry a new event id per command (`-r`: redis-benchmark puts a random "
        "number in each). *verified*: the counter (Tally: a fresh `TALLY.GET`) grew by exactly the "
        "acknowledged increments.",
        "",
        "| system | counter | requests | writers | increments/s | ÷ Redis everysec | ÷ Redis always | p50 µs "
        "| p99 µs | server CPU % | server CPU µs / incr | verified |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def ratio(rate, config, r):
        base = find(rows, system="Redis", config=config, requests=r.get("requests"), writers=r.get("writers"))
        return f"{rate / base['incr_per_s']:.2f}×" if base and base.get("incr_per_s") and rate else "–"

    for r in rows:
        rate, cpu = r.get("incr_per_s"), r.get("server_cpu_pct")
        per = num(cpu / 100 * 1e6 / rate, 1) if rate and cpu is not None else "–"
        out.append(
            f"| {r['system']} | {r['config']} | {r['requests']} | {r['writers']} | {num(rate)} "
            f"| {ratio(rate, 'INCR, appendfsync everysec', r)} | {ratio(rate, 'INCR, appendfsync always', r)} "
            f"| {us(r.get('p50_us'))} | {us(r.get('p99_us'))} | {num(cpu)} | {per} | {verified_text(r)} |"
        )
    out.append("")
    # First increments to new counters ÷ increments to an existing batched counter.
    for r in [r for r in rows if r.get("config") == "INCR, a new counter per command"]:
        base = next(
            (
                b
                for b in rows
                if b.get("system") == r.get("system")
                and b.get("config", "").startswith("INCR, batched counter")
                and b.get("requests") == "single"
                and b.get("writers") == r.get("writers")
            ),
            None,
        )
        if base and base.get("incr_per_s") and r.get("incr_per_s"):
            q = r["incr_per_s"] / base["incr_per_s"]
            out.append(
                f"* new counters ÷ an existing counter, {plural(r['writers'], 'writer')}: {num(r['incr_per_s'])} ÷ "
                f"{num(base['incr_per_s'])} = **{q:.2f}×** — target ≥ 0.5×: {'PASS' if q >= 0.5 else 'MISS'}"
            )
    if out[-1] != "":
        out.append("")
    return out


def http_section(raw):
    """Markdown lines of the neutral-client HTTP cells: wrk beside tally load, and /healthz."""
    rows = [r for r in raw if r.get("section") == "http"]
    if not rows:
        return []
    out = [
        "## HTTP single increments: wrk beside tally load",
        "",
        "Single requests, one connection per writer: `wrk -t 2 -c W --latency` (a Lua script sets the body; "
        "a new event id per request on the sync counter) and `tally load --batch 1`, against the same node. "
        "`GET /healthz` is the node's HTTP ceiling on this machine; ÷ /healthz compares with it at the same "
        "writers. wrk may leave up to one request per connection applied but unacknowledged when it stops, so "
        "its rows verify acknowledged ≤ growth ≤ acknowledged + writers.",
        "",
        "| client | request | writers | requests/s | ÷ /healthz | p50 µs | p99 µs | server CPU % "
        "| server CPU µs / request | verified |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        base = find(rows, system="Tally 1 node (wrk)", config="GET /healthz", writers=r.get("writers"))
        rate, cpu = r.get("incr_per_s"), r.get("server_cpu_pct")
        ratio = f"{rate / base['incr_per_s']:.2f}×" if base and base.get("incr_per_s") and rate else "–"
        per = num(cpu / 100 * 1e6 / rate, 1) if rate and cpu is not None else "–"
        verified = verified_text(r) if r.get("config") != "GET /healthz" else "–"
        out.append(
            f"| {r['system']} | {r['config']} | {r['writers']} | {num(rate)} | {ratio} "
            f"| {us(r.get('p50_us'))} | {us(r.get('p99_us'))} | {num(cpu)} | {per} | {verified} |"
        )
    out.append("")
    return out


def find(rows, **kw):
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def cpu_per_incr(r):
    """Server CPU µs per acknowledged increment: server CPU ÷ increments/s (None if either is missing)."""
    rate, cpu = r.get("incr_per_s"), r.get("server_cpu_pct")
    if not rate or cpu is None:
        return None
    return cpu / 100 * 1e6 / rate


def replication_section(writes):
    """Markdown lines comparing the 3-node cluster with 3 copies of every shard against one copy, cell by cell."""
    rows = [r for r in writes if r.get("system") == REPLICATED]
    if not rows:
        return []
    out = [
        "### Replicated shards: 3 nodes, 3 copies against one copy",
        "",
        "The same cells on two 3-node clusters that run side by side: `cluster.replicas = 3` (every shard in a "
        "range group of all three nodes, served by its raft leader; a sync increment is acknowledged once two "
        "of the three have it on disk) and `replicas = 1` (one copy, on the node the ring assigns). "
        "÷ R=1 = the replicated rate ÷ the one-copy rate of the same cell. Server CPU is the three nodes' "
        "together.",
        "",
        "| counter | requests | writers | R=3 increments/s | R=1 increments/s | ÷ R=1 | R=3 p50 µs | R=3 p99 µs "
        "| R=1 p99 µs | R=3 CPU µs / incr | R=1 CPU µs / incr | R=3 verified |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        base = find(writes, system=UNREPLICATED, config=r.get("config"), requests=r.get("requests"),
                    writers=r.get("writers")) or {}
        ratio = (f"{r['incr_per_s'] / base['incr_per_s']:.2f}×"
                 if base.get("incr_per_s") and r.get("incr_per_s") else "–")
        out.append(
            f"| {r['config']} | {r['requests']} | {r['writers']} | {num(r.get('incr_per_s'))} "
            f"| {num(base.get('incr_per_s'))} | {ratio} | {us(r.get('p50_us'))} | {us(r.get('p99_us'))} "
            f"| {us(base.get('p99_us'))} | {num(cpu_per_incr(r), 1)} | {num(cpu_per_incr(base), 1)} "
            f"| {verified_text(r)} |"
        )
    out.append("")
    return out


# ---------------------------------------------------------------- targets


def shard_sweep(raw):
    """(shards, record) of the sync cells at 64 writers on one node, by shard count."""
    def shards(r):  # "sync counter, 8 shards"
        return int(r["config"].split(",")[1].split()[0])

    rows = [(shards(r), r) for r in raw if r.get("section") == "write-shards"]
    main = find(raw, section="write", system="Tally 1 node", durability="sync", requests="single", writers=64)
    if rows and main:
        rows.append((shards(main), main))
    return sorted(rows, key=lambda x: x[0])


def targets(writes, sketch_rows, raw):
    out = []

    def ratio_line(label, a, b):
        return f"{label}: {num(a['incr_per_s'])} ÷ {num(b['incr_per_s'])} = **{a['incr_per_s'] / b['incr_per_s']:.1f}×**"

    # 1. sync Tally ≥ 10× PostgreSQL's hot row at 64 writers, with lower p99.
    pg = find(writes, system="PostgreSQL", config="hot row UPDATE", writers=64)
    lines = []
    verdict = "MISS"
    why = ""
    for system in ("Tally 1 node", UNREPLICATED, REPLICATED):
        t = find(writes, system=system, durability="sync", requests="single", writers=64)
        if not (t and pg and t.get("incr_per_s") and pg.get("incr_per_s")):
            continue
        r = t["incr_per_s"] / pg["incr_per_s"]
        ok = r >= 10 and (t["p99_us"] or math.inf) < (pg["p99_us"] or 0)
        lines.append(
            f"  - {system}, sync, single increments, 64 writers ÷ PostgreSQL hot row, 64 writers: "
            f"{num(t['incr_per_s'])} ÷ {num(pg['incr_per_s'])} = **{r:.1f}×**; "
            f"p99 {us(t['p99_us'])} µs against {us(pg['p99_us'])} µs — {'PASS' if ok else 'MISS'}"
        )
        if system == "Tally 1 node":
            verdict = "PASS" if ok else "MISS"
            if not ok:
                why = (
                    f" (ratio {r:.1f}× < 10×)" if r < 10 else ""
                ) + (" (p99 not lower)" if (t["p99_us"] or math.inf) >= (pg["p99_us"] or 0) else "")
    if lines:
        out.append(f"1. **Sync Tally ≥ 10× the PostgreSQL hot row at 64 writers, with a lower p99: {verdict}**{why}")
        out.extend(lines)
        for shards, r in shard_sweep(raw):
            if pg and r.get("incr_per_s") and r is not find(writes, system="Tally 1 node", durability="sync",
                                                            requests="single", writers=64):
                out.append(
                    f"  - the same load on a sync counter with {shards} shard{'s' if shards > 1 else ''}: "
                    f"{num(r['incr_per_s'])} = {r['incr_per_s'] / pg['incr_per_s']:.1f}×, p99 {us(r['p99_us'])} µs"
                )
    else:
        out.append("1. Sync Tally ≥ 10× the PostgreSQL hot row at 64 writers: not measured in this run")

    # 1b. With every shard replicated on the 3 nodes: ≥ 10× the hot row at 64 writers, p99 reported.
    t = find(writes, system=REPLICATED, durability="sync", requests="single", writers=64)
    if t and pg and t.get("incr_per_s") and pg.get("incr_per_s"):
        r = t["incr_per_s"] / pg["incr_per_s"]
        line = (
            f"1b. **Sync Tally, 3 nodes, 3 replicas, ≥ 10× the PostgreSQL hot row at 64 writers: "
            f"{'PASS' if r >= 10 else 'MISS'}** — {num(t['incr_per_s'])} ÷ {num(pg['incr_per_s'])} = **{r:.1f}×**; "
            f"p99 {us(t['p99_us'])} µs (PostgreSQL {us(pg['p99_us'])} µs)"
        )
        one = find(writes, system=UNREPLICATED, durability="sync", requests="single", writers=64)
        if one and one.get("incr_per_s"):
            line += (
                f"; against one copy ({num(one['incr_per_s'])}, p99 {us(one['p99_us'])} µs): "
                f"{t['incr_per_s'] / one['incr_per_s']:.2f}×"
            )
        out.append(line)
    elif t or find(writes, system=REPLICATED):
        out.append("1b. Sync Tally, 3 nodes, 3 replicas, against the PostgreSQL hot row: no PostgreSQL row in this run")
    # The same counter kind over the Redis protocol (redis-benchmark TALLY.INCRBY with event ids).
    t = find(raw, section="resp", system=REPLICATED + " (RESP)", writers=64)
    if t and pg and t.get("incr_per_s") and pg.get("incr_per_s"):
        r = t["incr_per_s"] / pg["incr_per_s"]
        out.append(
            f"   - over RESP (`redis-benchmark` `TALLY.INCRBY` with event ids, every client on node 1): "
            f"{'PASS' if r >= 10 else 'MISS'} — {num(t['incr_per_s'])} ÷ {num(pg['incr_per_s'])} = **{r:.1f}×**; "
            f"p99 {us(t['p99_us'])} µs"
        )

    # 2 and 3: per concurrency.
    def per_writers(n, title, redis_kw, tally_kw):
        lines, verdicts = [], []
        for system in ("Tally 1 node", UNREPLICATED, REPLICATED):
            for w in sorted({r["writers"] for r in writes if r.get("system") == system}):
                t = find(writes, system=system, writers=w, **tally_kw)
                rd = find(writes, system="Redis", writers=w, **redis_kw)
                if not (t and rd and t.get("incr_per_s") and rd.get("incr_per_s")):
                    continue
                r = t["incr_per_s"] / rd["incr_per_s"]
                ok = t["incr_per_s"] >= rd["incr_per_s"]
                if system == "Tally 1 node":
                    verdicts.append((w, ok))
                lines.append(
                    f"  - {system}, {plural(w, 'writer')}: {num(t['incr_per_s'])} against {num(rd['incr_per_s'])} "
                    f"= {r:.2f}× (p99 {us(t['p99_us'])} µs against {us(rd['p99_us'])} µs) — {'PASS' if ok else 'MISS'}"
                )
        if not verdicts:
            out.append(f"{n}. {title}: not measured in this run")
            return
        missed = [w for w, ok in verdicts if not ok]
        verdict = "PASS" if not missed else "MISS"
        why = "" if not missed else f" (single node below Redis at {', '.join(map(str, missed))} writer{'s' if missed != [1] else ''})"
        out.append(f"{n}. **{title}: {verdict}**{why}")
        out.extend(lines)

    per_writers(
        2,
        "Batched Tally, single increments/s ≥ Redis INCR (appendfsync everysec, no pipelining) at the same concurrency",
        dict(durability="appendfsync=everysec", requests="single"),
        dict(durability="batched", requests="single"),
    )
    per_writers(
        3,
        "Batched Tally through the batch endpoint ≥ Redis INCR with pipelining (everysec) at the same concurrency",
        dict(durability="appendfsync=everysec", batch=16),
        dict(durability="batched", batch=16),
    )

    # 4. distinct error ≤ Redis's at equal or smaller memory.
    agg = sketch_summary(sketch_rows)
    if agg:
        lines, missed = [], []
        for a in agg:
            err_ok = a["tally_rms"] <= a["redis_rms"]
            mem_ok = a["tally_bytes"] <= a["redis_memory_usage"]
            ok = err_ok and mem_ok
            if not ok:
                missed.append(
                    f"10^{round(math.log10(a['n']))}: "
                    + ", ".join(
                        ([] if err_ok else ["larger error"]) + ([] if mem_ok else ["more bytes"])
                    )
                )
            lines.append(
                f"  - n = {num(a['n'])} ({a['trials']} trial{'s' if a['trials'] > 1 else ''}): RMS error "
                f"{a['tally_rms']:.3%} against {a['redis_rms']:.3%}; bytes {num(a['tally_bytes'])} against "
                f"{num(a['redis_memory_usage'])} (MEMORY USAGE) — {'PASS' if ok else 'MISS'}"
            )
        verdict = "PASS" if not missed else "MISS"
        why = "" if not missed else f" ({'; '.join(missed)})"
        out.append(f"4. **Distinct-count error ≤ Redis's at equal or smaller memory: {verdict}**{why}")
        out.extend(lines)
        dense = [r for r in sketch_rows if r["n"] >= 10_000]
        if dense:
            rms = lambda key: math.sqrt(sum(r[key] ** 2 for r in dense) / len(dense))  # noqa: E731
            out.append(
                f"  - all {len(dense)} trials with n ≥ 10,000 (both sketches dense) pooled: RMS error "
                f"{rms('tally_error'):.3%} against {rms('redis_error'):.3%} (standard error of 2^14 registers: 0.81 %)"
            )
        wide = [a for a in agg if a.get("tally_counter_64") is not None]
        if wide:
            over = [a for a in wide if a["tally_counter_64"] > 2 * a["redis_memory_usage"]]
            out.append(
                f"5. **Bytes per distinct counter at 64 shards ≤ 2× Redis's: {'PASS' if not over else 'MISS'}**"
                + ("" if not over else f" (at n = {', '.join(num(a['n']) for a in over)})")
            )
            for a in wide:
                out.append(
                    f"  - n = {num(a['n'])}: 64 shards {num(a['tally_counter_64'])} bytes, 1 shard "
                    f"{num(a['tally_counter_1'])}, Redis {num(a['redis_memory_usage'])} (MEMORY USAGE)"
                )
    else:
        out.append("4. Distinct-count error against Redis: not measured in this run")
    return out


def sketch_summary(rows):
    by_n = {}
    for r in rows:
        by_n.setdefault(r["n"], []).append(r)
    out = []
    for n in sorted(by_n):
        rs = by_n[n]
        rms = lambda key: math.sqrt(sum(r[key] ** 2 for r in rs) / len(rs))  # noqa: E731
        out.append(
            {
                "n": n,
                "trials": len(rs),
                "tally_rms": rms("tally_error"),
                "redis_rms": rms("redis_error"),
                "tally_max": max(abs(r["tally_error"]) for r in rs),
                "redis_max": max(abs(r["redis_error"]) for r in rs),
                "tally_bytes": max(r["tally_sketch_bytes"] for r in rs),
                "tally_counter_1": max((r.get("tally_counter_bytes_1") for r in rs), default=None, key=lambda v: v or 0),
                "tally_counter_64": max((r.get("tally_counter_bytes_64") for r in rs), default=None, key=lambda v: v or 0),
                "same_estimate": all(r.get("tally_same_estimate", True) for r in rs),
                "redis_string": max(r["redis_string_bytes"] for r in rs),
                "redis_memory_usage": max(r["redis_memory_usage_bytes"] for r in rs),
                "tally_stated": rs[0]["tally_stated_error"],
                "tally_insert_s": sum(r["tally_insert_s"] for r in rs) / len(rs),
                "redis_insert_s": sum(r["redis_insert_s"] for r in rs) / len(rs),
            }
        )
    return out


# ---------------------------------------------------------------- plots

STYLE = {
    "PostgreSQL": "tab:blue",
    "Redis": "tab:red",
    "Tally 1 node": "tab:green",
    "Tally 3 nodes": "tab:purple",
    REPLICATED: "tab:brown",
}


def series(writes):
    groups = {}
    for r in writes:
        key = (r["system"], r["config"], r["requests"])
        groups.setdefault(key, []).append(r)
    for key in groups:
        groups[key].sort(key=lambda r: r["writers"])
    return groups


def durable(config):
    """Acknowledged only once on disk: PostgreSQL, Redis appendfsync always, Tally sync."""
    return "UPDATE" in config or "always" in config or config.startswith("sync")


def line_style(system, config):
    return "-" if durable(config) else "--"


def marker(config):
    if "sharded" in config:
        return "^"
    return "o" if durable(config) else "s"


def plot_vs_writers(writes, metric, ylabel, path, title):
    groups = series(writes)
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), sharey=True)
    panels = [("one increment per request", lambda req: req == "single"),
              ("16 increments per request (pipeline / batch)", lambda req: req != "single")]
    for ax, (panel_title, want) in zip(axes, panels):
        for (system, config, requests), rs in sorted(groups.items()):
            if not want(requests):
                continue
            xs = [r["writers"] for r in rs if r.get(metric)]
            ys = [r[metric] for r in rs if r.get(metric)]
            if not xs:
                continue
            label = f"{system}: {config}" + ("" if requests == "single" else f" ({requests})")
            ax.plot(xs, ys, line_style(system, config), marker=marker(config), color=STYLE.get(system, "black"),
                    label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent writers (connections)")
        ax.set_title(panel_title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
        ws = sorted({r["writers"] for r in writes})
        if ws:
            ax.set_xticks(ws)
            ax.set_xticklabels([str(w) for w in ws])
    axes[0].set_ylabel(ylabel)
    fig.suptitle(f"{title} (solid: acknowledged once on disk; dashed: acknowledged from memory)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_reads(reads, path):
    if not reads:
        return
    writer_counts = sorted({r["writers"] for r in reads})
    fig, axes = plt.subplots(1, len(writer_counts), figsize=(7 * len(writer_counts), 5), sharey=True,
                             squeeze=False)
    combos = sorted({(r["system"], r["consistency"]) for r in reads})
    shard_counts = sorted({r["shards"] for r in reads})
    width = 0.8 / max(1, len(combos))
    for ax, writers in zip(axes[0], writer_counts):
        for i, (system, consistency) in enumerate(combos):
            xs, ys = [], []
            for j, s in enumerate(shard_counts):
                r = find(reads, system=system, consistency=consistency, shards=s, writers=writers)
                if r and r.get("p99_us"):
                    xs.append(j + i * width)
                    ys.append(r["p99_us"])
            ax.bar(xs, ys, width, label=f"{system}, {consistency}", color=STYLE.get(system),
                   alpha=1.0 if consistency == "fresh" else 0.45, edgecolor="black")
        ax.set_xticks([j + width * (len(combos) - 1) / 2 for j in range(len(shard_counts))])
        ax.set_xticklabels([f"{s} shards" for s in shard_counts])
        ax.set_yscale("log")
        ax.set_title("no writers" if writers == 0 else f"while {writers} writers write")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel("p99 read latency, µs (log)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(handles), fontsize=9)
    fig.suptitle("Read latency: cached rollup against fresh sum of shards")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sketch(rows, path):
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    for key, label, color, marker in (("tally_error", "Tally", STYLE["Tally 1 node"], "o"),
                                      ("redis_error", "Redis", STYLE["Redis"], "s")):
        xs = [r["n"] * (1.04 if key == "redis_error" else 0.96) for r in rows]
        ys = [abs(r[key]) * 100 for r in rows]
        ax.scatter(xs, ys, color=color, marker=marker, label=f"{label} (each trial)")
    ax.axhline(104 / 128, color="gray", linestyle=":", label="1.04/√16384 = 0.81 % (standard error)")
    ax.set_xscale("log")
    ax.set_xlabel("distinct members n")
    ax.set_ylabel("|relative error| %")
    ax.set_title("HyperLogLog error on the same member streams")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- Markdown


def main():
    out_dir = sys.argv[1]
    raw = load_jsonl(os.path.join(out_dir, "raw.jsonl"))
    sketch_rows = load_jsonl(os.path.join(out_dir, "sketch.jsonl"))
    meta = {}
    if os.path.exists(os.path.join(out_dir, "meta.json")):
        meta = json.load(open(os.path.join(out_dir, "meta.json")))
    order = {name: i for i, name in enumerate(STYLE)}
    # Measured one writer count at a time; shown system by system.
    writes = sorted(
        (r for r in raw if r.get("section") == "write"),
        key=lambda r: (order.get(r["system"], 99), r["config"], r["requests"] != "single", r["writers"]),
    )
    for r in writes:
        per = cpu_per_incr(r)
        r["server_cpu_us_per_incr"] = None if per is None else round(per, 2)
    reads = [r for r in raw if r.get("section") == "read"]
    for r in reads:
        w = find(raw, section="read-writers", system=r["system"], shards=r["shards"])
        r["writes_per_s"] = w.get("incr_per_s") if w and r.get("writers") else None
        r["errors"] = json.dumps(r.get("errors") or {})

    write_csv(os.path.join(out_dir, "results.csv"), writes, WRITE_COLUMNS)
    write_csv(os.path.join(out_dir, "reads.csv"), reads, READ_COLUMNS)
    write_csv(os.path.join(out_dir, "sketch.csv"), sketch_rows, SKETCH_COLUMNS)
    plot_vs_writers(writes, "incr_per_s", "acknowledged increments/s (log)",
                    os.path.join(out_dir, "throughput_vs_writers.png"), "Throughput against concurrent writers")
    plot_vs_writers(writes, "p99_us", "p99 acknowledgement latency, µs (log)",
                    os.path.join(out_dir, "p99_vs_writers.png"), "p99 latency against concurrent writers")
    plot_reads(reads, os.path.join(out_dir, "reads_p99.png"))
    plot_sketch(sketch_rows, os.path.join(out_dir, "sketch_error.png"))

    md = []
    md.append("# Tally beside PostgreSQL and Redis: results")
    md.append("")
    md.append(
        f"Produced by `bench/run.sh{' --quick' if meta.get('mode') == 'quick' else ''}` "
        f"({meta.get('mode', '?')} mode), {meta.get('started', '?')} to {meta.get('finished', '?')} "
        f"({num(meta.get('elapsed_s'))} s). What the columns mean and how they are measured: "
        "[`bench/README.md`](../README.md)."
    )
    md.append("")
    md.append(
        f"- machine: {meta.get('cores', '?')} cores ({meta.get('cpu', '?')}), {meta.get('mem_gib', '?')} GiB, "
        f"Linux {meta.get('kernel', '?')}; data directories on {meta.get('tmp_fs', '?')}"
    )
    md.append(
        f"- 1-minute load average {meta.get('load1_start', 0):.2f} at the start, {meta.get('load1_end', 0):.2f} "
        f"at the end; CPU pressure before the run (PSI `some avg60`, other work on this shared machine): "
        f"{meta.get('cpu_pressure_start', '?')} %; clients and servers share the same cores"
    )
    md.append(
        f"- PostgreSQL {meta.get('postgres', '?')}, Redis {meta.get('redis', '?')}, Tally {meta.get('tally', '?')} "
        f"(code at commit {meta.get('tally_rev', '?')}, release build)"
    )
    md.append(
        f"- write cells: {meta.get('duration_s', '?')} s each, writers {meta.get('writers', '?')}; "
        f"Tally counters have {meta.get('tally_shards', '?')} shards; pipelined/batched rows carry "
        f"{meta.get('pipeline', '?')} increments per request"
    )
    idle = find(raw, section="idle")
    if idle:
        md.append(
            f"- all servers of the write phase run together; idle, they used {num(idle.get('server_cpu_pct'), 1)} % CPU "
            f"and {num(idle.get('server_rss_mib'), 1)} MiB RSS in total"
        )
    probes = [r for r in raw if r.get("section") == "fsync"]
    if probes:
        md.append(
            "- fsync of a 4 KiB append on the data disk (`lib/fsync_probe.py`) before each block of cells, p50 / p99 µs: "
            + "; ".join(f"{r['label']} {num(r['p50_us'])} / {num(r['p99_us'])}" for r in probes)
        )
    md.append("")
    md.append("## Targets")
    md.append("")
    md.extend(targets(writes, sketch_rows, raw))
    md.append("")
    md.append("## Writes")
    md.append("")
    md.append(
        "Latency is per request, from sending it to its acknowledgement (for pipelined and batched rows "
        "the request carries 16 increments). CPU and RSS are the server's (all its processes), client CPU "
        "is the load generator's; 100 % = one core. *verified*: the counter grew by exactly the "
        "acknowledged increments."
    )
    md.append("")
    md.append(
        "| system | counter | requests | writers | increments/s | p50 µs | p99 µs | p999 µs | server CPU % "
        "| server CPU µs / incr | server RSS (PSS) MiB | client CPU % | verified |"
    )
    md.append("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in writes:
        errors = ""
        if r.get("failed"):
            errors = f" ({num(r['failed'])} failed)"
        if r.get("note"):
            errors += f" ({r['note']})"
        md.append(
            f"| {r['system']} | {r['config']} | {r['requests']} | {r['writers']} | {num(r.get('incr_per_s'))}{errors} "
            f"| {us(r.get('p50_us'))} | {us(r.get('p99_us'))} | {us(r.get('p999_us'))} "
            f"| {num(r.get('server_cpu_pct'))} | {num(r.get('server_cpu_us_per_incr'), 1)} | {mem(r)} "
            f"| {num(r.get('client_cpu_pct'))} | {verified_text(r)} |"
        )
    md.append("")
    md.extend(replication_section(writes))
    sweep = shard_sweep(raw)
    if sweep:
        md.append("### Sync counters: shard count at 64 writers, single node")
        md.append("")
        md.append(
            "The same load on sync counters with fewer shards (single increments; the 64-shard row is the one "
            "above). Every commit cycle of a node ends with one fsync and carries one store write per shard "
            "that has increments waiting."
        )
        md.append("")
        md.append("| shards | increments/s | p50 µs | p99 µs | p999 µs | server CPU % | ÷ PostgreSQL hot row | verified |")
        md.append("|---:|---:|---:|---:|---:|---:|---:|---|")
        pg = find(writes, system="PostgreSQL", config="hot row UPDATE", writers=64)
        for shards, r in sweep:
            ratio = f"{r['incr_per_s'] / pg['incr_per_s']:.1f}×" if pg and r.get("incr_per_s") else "–"
            md.append(
                f"| {shards} | {num(r.get('incr_per_s'))} | {us(r.get('p50_us'))} | {us(r.get('p99_us'))} "
                f"| {us(r.get('p999_us'))} | {num(r.get('server_cpu_pct'))} | {ratio} | {verified_text(r)} |"
            )
        md.append("")
    md.append("![throughput against writers](throughput_vs_writers.png)")
    md.append("")
    md.append("![p99 against writers](p99_vs_writers.png)")
    md.append("")
    md.extend(resp_section(raw))
    md.extend(http_section(raw))
    if reads:
        md.append("## Reads, idle and while writes run")
        md.append("")
        md.append(
            f"One reader on one keep-alive connection (Python `http.client`, to node 1) reads "
            f"`GET /v1/counters/NAME/value?consistency=cached|fresh` for {meta.get('read_duration_s', '?')} s, "
            f"first with no writers, then while {meta.get('read_writers', '?')} `tally load` writers add single "
            "increments to the same batched counter (spread over the nodes). Latency includes the Python "
            "client's own cost (tens of µs); with writers running, the two cores are saturated."
        )
        md.append("")
        md.append(
            "| system | shards | read | writers | reads/s | p50 µs | p99 µs | p999 µs | writes/s meanwhile "
            "| server CPU % | server RSS (PSS) MiB | incomplete reads |"
        )
        md.append("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in reads:
            md.append(
                f"| {r['system']} | {r['shards']} | {r['consistency']} | {r['writers']} | {num(r.get('reads_per_s'))} "
                f"| {us(r.get('p50_us'))} | {us(r.get('p99_us'))} | {us(r.get('p999_us'))} "
                f"| {num(r.get('writes_per_s'))} | {num(r.get('server_cpu_pct'))} | {mem(r)} "
                f"| {r.get('incomplete', '–')} |"
            )
        md.append("")
        md.append("![read p99](reads_p99.png)")
        md.append("")
    agg = sketch_summary(sketch_rows)
    if agg:
        md.append("## Distinct counts: HyperLogLog against Redis")
        md.append("")
        md.append(
            "The same member streams (`u<trial>-<i>`, i < n) go to Tally counters with `distinct` (1 and 64 "
            "shards, batch endpoint) and to a Redis key (pipelined `PFADD`). Error = (estimate − n) / n; the "
            "table gives the root mean square over the trials (the 1-shard counter's; every shard count gives "
            "the same estimate, the merge being exact). Tally's bytes are what `GET …/distinct` reports: "
            "`sketch_bytes` (the merged sketch, stored) and `counter_bytes` (every shard's sketch, summed). "
            "Redis: `STRLEN` (its HLL string) and `MEMORY USAGE` (with key and object overhead)."
        )
        md.append("")
        md.append(
            "| n | trials | Tally RMS error | Redis RMS error | Tally max abs error | Redis max abs error "
            "| Tally sketch bytes | Tally counter bytes, 1 shard | Tally counter bytes, 64 shards "
            "| Redis STRLEN | Redis MEMORY USAGE | same estimate at 1 and 64 shards | Tally insert s | Redis insert s |"
        )
        md.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for a in agg:
            md.append(
                f"| {num(a['n'])} | {a['trials']} | {a['tally_rms']:.3%} | {a['redis_rms']:.3%} "
                f"| {a['tally_max']:.3%} | {a['redis_max']:.3%} | {num(a['tally_bytes'])} "
                f"| {num(a['tally_counter_1'])} | {num(a['tally_counter_64'])} | {num(a['redis_string'])} "
                f"| {num(a['redis_memory_usage'])} | {'yes' if a['same_estimate'] else 'NO'} "
                f"| {a['tally_insert_s']:.2f} | {a['redis_insert_s']:.2f} |"
            )
        md.append("")
        md.append("![sketch error](sketch_error.png)")
        md.append("")
    notes = [r for r in raw if r.get("section", "").startswith("write") or r.get("section") == "read"]
    notes = [r for r in notes if r.get("failed") or r.get("errors") not in (None, {}, "{}") or r.get("note") or r.get("parse_error")
             or r.get("verified") is False]
    if notes:
        md.append("## Cells with errors")
        md.append("")
        for r in notes:
            what = f"{r['system']}, {r.get('config', str(r.get('shards')) + ' shards ' + r.get('consistency', ''))}"
            what += f", {r.get('requests', 'reads')}, {plural(r['writers'], 'writer')}"
            parts = []
            if r.get("failed"):
                parts.append(f"{num(r['failed'])} increments failed: {json.dumps(r.get('errors'))}")
            elif r.get("errors") not in (None, {}, "{}"):
                parts.append(f"errors {r['errors']}")
            if r.get("note"):
                parts.append(r["note"])
            if r.get("verified") is False:
                parts.append(f"verification: {verified_text(r)}")
            if r.get("parse_error"):
                parts.append(f"no figures ({r['parse_error']}; see logs/)")
            md.append(f"- {what}: {'; '.join(parts)}")
        md.append("")
    md.append("Raw records: `raw.jsonl`, `sketch.jsonl`; the clients' own output: `logs/`.")
    md.append("")
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(md))


if __name__ == "__main__":
    main()
