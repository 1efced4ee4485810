#!/usr/bin/python3
"""Distinct counting, Tally's HyperLogLog against Redis's, on identical member streams.

For each stream size n and trial t, the members "u<t>-<i>" for i in 0..n go
  * to Tally: `POST /v1/increments` batches of items {"counter", "delta": 1, "member"}
    into a counter created with {"distinct": true, "shards": SHARDS}, then
    `GET /v1/counters/NAME/distinct` (after the batched flush window has passed);
  * to Redis: pipelined `PFADD key m1 … m1000`, then `PFCOUNT key` and
    `MEMORY USAGE key`.
The same stream goes to one Tally counter per shard count in --shards (1 and 64 by
default), so the bytes a counter costs can be compared at both. Prints one JSON
object per (n, trial) on standard output.

Tally's bytes come from the distinct endpoint itself: `sketch_bytes` is the stored
size of the merged sketch, `counter_bytes` the stored size of every shard's sketch
summed (what the counter costs). Redis's: `MEMORY USAGE` (the key with its object
overhead) and `STRLEN` (the HLL string alone).
"""

import argparse
import http.client
import json
import socket
import sys
import time
import urllib.parse

TALLY_BATCH_ITEMS = 5000  # items per POST /v1/increments (node limit 10,000; body ≤ 1 MiB)
REDIS_MEMBERS_PER_PFADD = 1000
REDIS_PIPELINE_COMMANDS = 50
FLUSH_WAIT_S = 0.5  # batched counters reach their shards within flush_ms (200) + a tick


def members(trial, start, stop):
    return [f"u{trial}-{i}" for i in range(start, stop)]


class Tally:
    def __init__(self, url):
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname, u.port
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)

    def call(self, method, path, body=None):
        headers = {"content-type": "application/json"} if body is not None else {}
        self.conn.request(method, path, body=body, headers=headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status >= 300:
            raise RuntimeError(f"{method} {path}: {resp.status} {data[:300]!r}")
        return json.loads(data) if data else None

    def create(self, name, shards):
        spec = {"shards": shards, "distinct": True, "durability": "batched"}
        self.call("PUT", f"/v1/counters/{name}", json.dumps(spec))

    def add(self, name, trial, n):
        head = '{"counter":"%s","delta":1,"member":"' % name
        for start in range(0, n, TALLY_BATCH_ITEMS):
            items = ",".join(head + m + '"}' for m in members(trial, start, min(n, start + TALLY_BATCH_ITEMS)))
            answer = self.call("POST", "/v1/increments", '{"increments":[' + items + "]}")
            bad = [r for r in answer["results"] if "error" in r]
            if bad:
                raise RuntimeError(f"{len(bad)} items refused, e.g. {bad[0]}")

    def distinct(self, name):
        # Wait until the estimate stops moving: batched buffers drain within flush_ms.
        time.sleep(FLUSH_WAIT_S)
        last = self.call("GET", f"/v1/counters/{name}/distinct")
        for _ in range(20):
            time.sleep(FLUSH_WAIT_S)
            now = self.call("GET", f"/v1/counters/{name}/distinct")
            if now["estimate"] == last["estimate"]:
                return now
            last = now
        return last


class Redis:
    """A minimal RESP client: enough for pipelined PFADD, PFCOUNT and MEMORY USAGE."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.buf = b""

    @staticmethod
    def encode(*args):
        parts = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(a), a))
        return b"".join(parts)

    def reply(self):
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError("Redis closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        kind, rest = line[:1], line[1:]
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RuntimeError(f"Redis error: {rest.decode()}")
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            while len(self.buf) < size + 2:
                self.buf += self.sock.recv(65536)
            data, self.buf = self.buf[:size], self.buf[size + 2 :]
            return data
        raise RuntimeError(f"unexpected Redis reply {line[:50]!r}")

    def command(self, *args):
        self.sock.sendall(self.encode(*args))
        return self.reply()

    def add(self, key, trial, n):
        self.command("DEL", key)
        pending = []
        for start in range(0, n, REDIS_MEMBERS_PER_PFADD):
            pending.append(self.encode("PFADD", key, *members(trial, start, min(n, start + REDIS_MEMBERS_PER_PFADD))))
            if len(pending) == REDIS_PIPELINE_COMMANDS:
                self.flush(pending)
                pending = []
        self.flush(pending)

    def flush(self, pending):
        if pending:
            self.sock.sendall(b"".join(pending))
            for _ in pending:
                self.reply()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tally", required=True, help="a node's base URL")
    ap.add_argument("--redis-port", type=int, required=True)
    ap.add_argument("--plan", required=True, help="n:trials,… e.g. 1000:5,10000:5,1000000:1")
    ap.add_argument("--shards", default="1,64", help="shard counts, one counter each, e.g. 1,64")
    args = ap.parse_args()
    shard_counts = [int(x) for x in args.shards.split(",")]

    tally, redis = Tally(args.tally), Redis(args.redis_port)
    for item in args.plan.split(","):
        n, trials = (int(x) for x in item.split(":"))
        for trial in range(trials):
            reads, insert_s = {}, {}
            for shards in shard_counts:
                name = f"hll-n{n}-t{trial}-s{shards}"
                t0 = time.monotonic()
                tally.create(name, shards)
                tally.add(name, trial, n)
                insert_s[shards] = round(time.monotonic() - t0, 3)
                reads[shards] = tally.distinct(name)
            first = reads[shard_counts[0]]
            key = f"hll-n{n}-t{trial}"
            t2 = time.monotonic()
            redis.add(key, trial, n)
            t3 = time.monotonic()
            pf = redis.command("PFCOUNT", key)
            mem = redis.command("MEMORY", "USAGE", key)
            enc = redis.command("OBJECT", "ENCODING", key)
            strlen = redis.command("STRLEN", key)
            record = {
                "n": n,
                "trial": trial,
                "tally_estimate": first["estimate"],
                "tally_error": (first["estimate"] - n) / n,
                "tally_stated_error": first["relative_error"],
                "tally_complete": all(r.get("complete", True) for r in reads.values()),
                # The merge is exact: every shard count must give the same estimate.
                "tally_same_estimate": all(r["estimate"] == first["estimate"] for r in reads.values()),
                "tally_sketch_bytes": first["sketch_bytes"],
                "tally_insert_s": insert_s[shard_counts[0]],
                "redis_estimate": pf,
                "redis_error": (pf - n) / n,
                "redis_memory_usage_bytes": mem,
                "redis_string_bytes": strlen,
                "redis_encoding": enc.decode() if isinstance(enc, bytes) else enc,
                "redis_insert_s": round(t3 - t2, 3),
            }
            for shards, r in reads.items():
                record[f"tally_counter_bytes_{shards}"] = r["counter_bytes"]
            print(json.dumps(record), flush=True)
            per_shards = ", ".join(f"{s} shards {reads[s]['counter_bytes']} B" for s in shard_counts)
            print(
                f"    n={n} trial={trial}: tally {first['estimate']} ({record['tally_error']:+.4%}, "
                f"{first['sketch_bytes']} B; {per_shards}), redis {pf} ({record['redis_error']:+.4%}, {mem} B)",
                file=sys.stderr,
                flush=True,
            )


if __name__ == "__main__":
    main()
