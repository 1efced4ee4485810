#!/usr/bin/python3
"""Measures what one small durable write costs on the disk under the data directories
right now: write 4 KiB at the end of a file, fsync, repeat, for at most MAX_S seconds
or COUNT writes. Appends one JSON record to --out.

The machine's disk is shared, and every durable acknowledgement in the suite
(PostgreSQL commits, Redis `appendfsync always`, Tally `sync`) waits for an fsync, so
this figure, taken before each section, says what the disk allowed at that moment.
"""

import argparse
import json
import math
import os
import time

COUNT = 200
MAX_S = 1.5
BLOCK = b"\0" * 4096


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", required=True)
    args = ap.parse_args()
    path = os.path.join(args.dir, "fsync-probe")
    lat_us = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        deadline = time.monotonic() + MAX_S
        while len(lat_us) < COUNT and time.monotonic() < deadline:
            t0 = time.perf_counter()
            os.write(fd, BLOCK)
            os.fsync(fd)
            lat_us.append((time.perf_counter() - t0) * 1e6)
    finally:
        os.close(fd)
        os.unlink(path)
    lat_us.sort()
    pick = lambda q: round(lat_us[min(len(lat_us), max(1, math.ceil(q * len(lat_us)))) - 1])  # noqa: E731
    record = {"section": "fsync", "label": args.label, "count": len(lat_us), "p50_us": pick(0.5), "p99_us": pick(0.99)}
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"    fsync of 4 KiB: p50 {record['p50_us']} µs, p99 {record['p99_us']} µs ({len(lat_us)} writes)", flush=True)


if __name__ == "__main__":
    main()
