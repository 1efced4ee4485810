"""Feeds unique idempotent increments to one counter over the Redis protocol and
samples the node's memory and data directory while the ids accumulate.

    dedup_feed.py --port P --pid PID --data-dir DIR --counter NAME --ids N
                  [--mode ids|seq] [--connections C] [--pipeline K] [--every S]

Each of C connections keeps one pipeline of K commands in flight:
  ids  TALLY.INCRBY NAME 1 ID e<run>-<conn>-<n>        (N unique event ids)
  seq  TALLY.INCRBY NAME 1 WRITER w<run>-<conn>-<slot> SEQ <round>
       (C*K writers, each one sequence per round: N increments, C*K marks)
  counters  INCR NAME<run>-<conn>-<n>  (N new counters, each created by its first
       increment with the default spec; acknowledged by the reply 1)
A CSV row every S seconds (and at the end): seconds, increments acknowledged,
duplicates, errors, the node's RSS (kB, /proc/PID/status) and the data directory's
size (bytes). Errors are counted, not retried: the run reports them.
"""

import argparse
import asyncio
import os
import sys
import time


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def command(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class Totals:
    def __init__(self):
        self.acked = 0
        self.duplicates = 0
        self.errors = 0
        self.first_error = None


async def connection(args, conn, share, totals, run):
    reader, writer = await asyncio.open_connection("127.0.0.1", args.port)
    key = args.counter.encode()
    sent = 0
    rounds = 0
    while sent < share:
        k = min(args.pipeline, share - sent)
        if args.mode == "counters":
            batch = b"".join(command(b"INCR", b"%s%s-%d-%d" % (key, run, conn, sent + i)) for i in range(k))
        elif args.mode == "ids":
            batch = b"".join(
                command(b"TALLY.INCRBY", key, b"1", b"ID", b"e%s-%d-%d" % (run, conn, sent + i)) for i in range(k)
            )
        else:
            rounds += 1
            batch = b"".join(
                command(b"TALLY.INCRBY", key, b"1", b"WRITER", b"w%s-%d-%d" % (run, conn, i), b"SEQ", b"%d" % rounds)
                for i in range(k)
            )
        writer.write(batch)
        await writer.drain()
        got = 0
        while got < k:
            line = await reader.readline()
            if not line:
                raise ConnectionError("the node closed the connection")
            got += 1
            if line.startswith(b"+applied") or (args.mode == "counters" and line == b":1\r\n"):
                totals.acked += 1
            elif line.startswith(b"+duplicate"):
                totals.duplicates += 1
            else:
                totals.errors += 1
                totals.first_error = totals.first_error or line.decode(errors="replace").strip()
        sent += k
    writer.close()


async def sampler(args, totals, started, done):
    while True:
        row(args, totals, started)
        try:
            await asyncio.wait_for(done.wait(), args.every)
            return
        except asyncio.TimeoutError:
            pass


def row(args, totals, started):
    print(
        "%.1f,%d,%d,%d,%d,%d"
        % (
            time.monotonic() - started,
            totals.acked,
            totals.duplicates,
            totals.errors,
            rss_kb(args.pid),
            dir_bytes(args.data_dir),
        ),
        flush=True,
    )


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--counter", required=True)
    p.add_argument("--ids", type=int, required=True)
    p.add_argument("--mode", choices=["ids", "seq", "counters"], default="ids")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--pipeline", type=int, default=64)
    p.add_argument("--every", type=float, default=10.0)
    args = p.parse_args()
    run = b"%x" % int(time.time())
    totals = Totals()
    started = time.monotonic()
    print("seconds,acked,duplicates,errors,rss_kb,disk_bytes", flush=True)
    done = asyncio.Event()
    sampling = asyncio.create_task(sampler(args, totals, started, done))
    base, extra = divmod(args.ids, args.connections)
    await asyncio.gather(
        *(connection(args, c, base + (1 if c < extra else 0), totals, run) for c in range(args.connections))
    )
    done.set()
    await sampling
    row(args, totals, started)
    if totals.errors:
        print(f"# {totals.errors} errors, the first: {totals.first_error}", file=sys.stderr)


asyncio.run(main())
