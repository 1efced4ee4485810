#!/usr/bin/python3
"""One reader on one keep-alive HTTP connection: GET a counter's value as fast as it
answers for a fixed time, then print one JSON object with reads/s and the p50, p99
and p999 latency in microseconds.

    reader.py --url http://127.0.0.1:7070 --counter hot --consistency fresh --duration 5

Latency is measured around request + full answer, so it includes this client's own
cost (http.client and json parsing, tens of microseconds in CPython).
"""

import argparse
import http.client
import json
import math
import time
import urllib.parse


def percentile(sorted_values, q):
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--counter", required=True)
    ap.add_argument("--consistency", choices=["cached", "fresh"], required=True)
    ap.add_argument("--duration", type=float, required=True, help="seconds")
    args = ap.parse_args()

    url = urllib.parse.urlsplit(args.url)
    path = f"/v1/counters/{urllib.parse.quote(args.counter)}/value?consistency={args.consistency}"
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    latencies_ns = []
    errors = {}
    incomplete = 0
    stale_ms_max = 0
    last_value = None
    deadline = time.monotonic() + args.duration
    started = time.perf_counter_ns()
    while time.monotonic() < deadline:
        t0 = time.perf_counter_ns()
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as e:
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            conn.close()
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
            time.sleep(0.01)
            continue
        t1 = time.perf_counter_ns()
        if resp.status != 200:
            errors[str(resp.status)] = errors.get(str(resp.status), 0) + 1
            continue
        latencies_ns.append(t1 - t0)
        answer = json.loads(body)
        if not answer.get("complete", True):
            incomplete += 1
        stale_ms_max = max(stale_ms_max, answer.get("staleness_ms") or 0)
        last_value = answer.get("value")
    elapsed_s = (time.perf_counter_ns() - started) / 1e9
    conn.close()
    latencies_ns.sort()
    us = lambda ns: None if ns is None else round(ns / 1000, 1)  # noqa: E731
    print(
        json.dumps(
            {
                "reads": len(latencies_ns),
                "reads_per_s": round(len(latencies_ns) / elapsed_s, 1),
                "p50_us": us(percentile(latencies_ns, 0.50)),
                "p99_us": us(percentile(latencies_ns, 0.99)),
                "p999_us": us(percentile(latencies_ns, 0.999)),
                "errors": errors,
                "incomplete": incomplete,
                "staleness_ms_max": stale_ms_max,
                "last_value": last_value,
            }
        )
    )


if __name__ == "__main__":
    main()
