#!/usr/bin/env python3
"""Writes crates/tally-server/openapi.json, the OpenAPI 3.1 document of tallyd's
public HTTP API. Edit this file, run it, and commit both: the process tests check
every answer they see against the schemas of the written document."""
import json, pathlib

def ref(name): return {"$ref": f"#/components/schemas/{name}"}
def obj(props, required=(), additional=False, desc=None):
    o = {"type": "object", "properties": props, "required": list(required)}
    if not additional: o["additionalProperties"] = False
    if desc: o["description"] = desc
    return o
INT = {"type": "integer"}
UINT = {"type": "integer", "minimum": 0}
NUM = {"type": "number"}
STR = {"type": "string"}
BOOL = {"type": "boolean"}
NAME = {"type": "string", "minLength": 1, "maxLength": 1536,
        "description": "A counter name: any bytes, 1 to 512 (percent-encoded in a path); shown as itself when it is UTF-8, else in its escaped form."}
# A name's escaped form: the bytes of [A-Za-z0-9._:-] as they are, every other byte as %XX.
ESCAPED = {"type": "string", "minLength": 1, "maxLength": 1536, "pattern": "^([A-Za-z0-9._:-]|%[0-9A-F]{2})+$"}
def nullable(s): return {"anyOf": [s, {"type": "null"}]}
def json_body(schema): return {"content": {"application/json": {"schema": schema}}}

schemas = {
 "Error": obj({"error": obj({"code": {"type": "string", "pattern": "^[a-z0-9_]+$"}, "message": STR}, ["code", "message"])}, ["error"],
              desc="Every error answer: a stable snake_case code and a human-readable message."),
 "Durability": {"type": "string", "enum": ["sync", "batched"]},
 "Router": {"type": "string", "enum": ["event", "writer", "round_robin", "random"]},
 "Frequency": obj({"epsilon": {"type": "number", "minimum": 1e-4, "maximum": 0.5}, "delta": {"type": "number", "minimum": 1e-6, "maximum": 0.5}},
   ["epsilon", "delta"], desc="Per-item frequencies: estimates exceed the truth by more than epsilon × total weight with probability at most delta. "
   "At most 131072 count-min counters per shard (width ⌈e/epsilon⌉ × depth ⌈ln(1/delta)⌉); fixed once set."),
 "CounterSpec": obj({"shards": {"type": "integer", "minimum": 1, "maximum": 1024}, "durability": ref("Durability"),
   "flush_ms": UINT, "rollup_ms": UINT, "router": ref("Router"), "distinct": BOOL, "dedup_window_s": UINT, "frequency": nullable(ref("Frequency")),
   "windows": ref("Windows"),
   "min": nullable({**INT, "description": "The lowest value the counter may take (bounded counters, docs/SEMANTICS.md); null for none."}),
   "max": nullable({**INT, "description": "The highest value the counter may take; null for none."}),
   "limit": nullable(ref("WindowLimit")),
   "replicas": nullable({"type": "integer", "minimum": 1, "maximum": 5,
     "description": "Copies of each shard the counter states; null: the cluster's `replicas`. Set on create only."})},
   ["shards", "durability", "flush_ms", "rollup_ms", "router", "distinct", "dedup_window_s", "frequency", "windows", "min", "max", "limit", "replicas"]),
 "WindowLimit": obj({"window": {"type": "string", "pattern": "^[0-9]+[smhd]$", "maxLength": 16},
   "max": {"type": "integer", "minimum": 1, "maximum": 9223372036854775807}}, ["window", "max"],
   desc="A rate limit: at most `max` counted in any span of `window` (one of the counter's windows), across every shard and node. "
   "Set on create with `durability: sync`, without min and max; only positive increments; never changes (docs/SEMANTICS.md, \"Window limits\")."),
 "Windows": {"type": "array", "items": {"type": "string", "pattern": "^[0-9]+[smhd]$", "maxLength": 16}, "maxItems": 4,
   "description": "Sliding windows the shards keep in 60 buckets each (1/60 of the window wide): each from 1m to 30d, "
   "whole milliseconds per bucket, each once, at most 4; answered shortest first in their shortest form (\"24h\" is \"1d\")."},
 "AutoShards": obj({"min_shards": {"type": "integer", "minimum": 1, "maximum": 1024}, "max_shards": {"type": "integer", "minimum": 1, "maximum": 1024}},
   ["min_shards", "max_shards"], desc="The bounds of a counter whose shard count follows contention (`shards: \"auto\"`)."),
 "SpecPatch": obj({"shards": {"anyOf": [{"type": "integer"}, {"const": "auto"}],
   "description": "A fixed count, or \"auto\": the count follows contention within min_shards..=max_shards (a new auto counter starts at min_shards; defaults 1 and 64)."},
   "min_shards": INT, "max_shards": INT, "durability": ref("Durability"), "flush_ms": INT, "rollup_ms": INT,
   "router": ref("Router"), "distinct": BOOL, "dedup_window_s": INT, "frequency": nullable(ref("Frequency")),
   "windows": {"type": "array", "items": STR, "description": "Sliding windows such as [\"1m\", \"1h\", \"24h\"] ([] for none); windows kept keep their buckets."},
   "min": {**INT, "description": "On create (with `durability: sync`): an increment that would take the value lower is refused with 409 `bound_exceeded`. Must be ≤ 0; never changes."},
   "max": {**INT, "description": "On create (with `durability: sync`): an increment that would take the value higher is refused. Must be ≥ 0; never changes."},
   "limit": ref("WindowLimit"),
   "replicas": {**INT, "description": "On create: copies of each shard, 1-5, in range groups shared with the counters that state the same "
     "(above 1 only where shards are replicated, `cluster.replicas` > 1). Never changes."},
   "ttl_ms": {"type": "integer", "minimum": 1, "maximum": 3153600000000,
     "description": "The counter expires this many milliseconds from now, as Redis's EXPIRE (see PUT .../expiry)."}},
   desc="Fields to set; all optional."),
 "Expiry": obj({"ttl_ms": {"type": "integer", "minimum": 1, "maximum": 3153600000000, "description": "Milliseconds from now."},
   "expires_at_ms": {**UINT, "description": "A deadline in milliseconds since the Unix epoch; one already passed deletes the counter at once."},
   "when": {"type": "string", "enum": ["nx", "xx", "gt", "lt"],
     "description": "Set only if the counter has no deadline (nx), has one (xx), the new one is later (gt) or earlier (lt); absent: always."}},
   desc="When the counter expires: exactly one of ttl_ms or expires_at_ms."),
 "Namespace": obj({"prefix": {"type": "string", "minLength": 1, "maxLength": 1536},
   "spec": {"type": "object", "description": "The spec fields the namespace names (null: the default)."},
   "auto": nullable(ref("AutoShards")), "ttl_ms": nullable(UINT)}, ["prefix", "spec", "auto", "ttl_ms"],
   desc="What counters created implicitly under the prefix take (their first increment, SET, after DEL); the longest matching prefix wins."),
 "Namespaces": obj({"namespaces": {"type": "array", "items": ref("Namespace")}}, ["namespaces"]),
 "ExpiryView": obj({"expires_at_ms": nullable(UINT), "ttl_ms": {"type": "integer", "minimum": -1, "description": "Milliseconds left; -1 for never."},
   "changed": {**BOOL, "description": "PUT: whether the deadline was set; DELETE: whether there was one to remove."}},
   ["expires_at_ms", "ttl_ms"], desc="A counter's deadline: from it on the counter does not exist (reads answer 404; an increment creates it anew)."),
 "CounterInfo": obj({"name": NAME, "spec": ref("CounterSpec"), "generation": UINT, "layout_shards": UINT,
   "resharding": nullable(UINT), "created_at_ms": UINT, "auto": nullable(ref("AutoShards")),
   "expires_at_ms": nullable({**UINT, "description": "When the counter expires, in milliseconds since the Unix epoch; null for never."})},
   ["name", "spec", "generation", "layout_shards", "resharding", "created_at_ms", "auto"]),
 "Increment": obj({"delta": {"type": "integer", "not": {"const": 0}}, "event_id": STR, "writer": STR, "seq": {"type": "integer", "minimum": 0, "maximum": 9223372036854775807, "description": "The writer's sequence number (needs `writer`, excludes `event_id`): idempotent by sequence, see docs/SEMANTICS.md."}, "member": STR, "item": STR}, ["delta"],
   desc="On a counter with `frequency`, `item` (or `member` without one) is counted with the delta as its weight; the delta must then be positive."),
 "BatchItem": obj({"counter": {**NAME, "description": "The counter's name as text."},
   "counter_encoded": {"type": "string", "minLength": 1, "maxLength": 1536,
     "description": "The counter's name percent-encoded as in a path (`a%20b`, `%FF`): any bytes, such as a name that is not UTF-8, which listings show in this form. Exactly one of counter and counter_encoded."},
   "delta": {"type": "integer", "not": {"const": 0}}, "event_id": STR, "writer": STR, "seq": {"type": "integer", "minimum": 0, "maximum": 9223372036854775807, "description": "The writer's sequence number (needs `writer`, excludes `event_id`): idempotent by sequence, see docs/SEMANTICS.md."}, "member": STR, "item": STR}, ["delta"],
   desc="An increment and its counter, named by exactly one of `counter` and `counter_encoded`."),
 "Batch": obj({"increments": {"type": "array", "items": ref("BatchItem")}}, ["increments"]),
 "IncrOutcome": obj({"applied": BOOL, "duplicate": BOOL}, ["applied"]),
 "BatchResults": obj({"results": {"type": "array", "items": {"oneOf": [ref("IncrOutcome"), ref("Error")]}}}, ["results"]),
 "ValueRead": obj({"value": INT, "consistency": {"type": "string", "enum": ["cached", "fresh"]}, "as_of_ms": UINT,
   "staleness_ms": UINT, "complete": BOOL, "missing_shards": {"type": "array", "items": UINT}},
   ["value", "consistency", "as_of_ms", "staleness_ms", "complete", "missing_shards"]),
 "DistinctRead": obj({"estimate": UINT, "relative_error": NUM, "sketch_bytes": UINT, "counter_bytes": UINT,
   "complete": BOOL, "missing_shards": {"type": "array", "items": UINT}},
   ["estimate", "relative_error", "sketch_bytes", "counter_bytes", "complete", "missing_shards"]),
 "WindowRead": obj({"window": STR, "window_ms": UINT, "bucket_ms": UINT, "start_ms": UINT, "end_ms": UINT, "value": INT,
   "limit": nullable(UINT), "remaining": nullable(UINT), "estimate": nullable(UINT), "relative_error": nullable(NUM), "window_bytes": UINT, "window_bytes_bound": UINT,
   "complete": BOOL, "missing_shards": {"type": "array", "items": UINT}},
   ["window", "window_ms", "bucket_ms", "start_ms", "end_ms", "value", "limit", "remaining", "estimate", "relative_error", "window_bytes", "window_bytes_bound",
    "complete", "missing_shards"],
   desc="A sliding window, merged over every shard at the answering node's clock: `value` is the exact sum of the increments the shards stamped "
   "in [start_ms, end_ms], which is the nominal window [end_ms - window_ms, end_ms] less its oldest bucket's part (less than `bucket_ms`); "
   "`estimate` the distinct members of that span (counters with `distinct`). `window_bytes` is what the counter's buckets hold in memory "
   "over every shard that answered, never above `window_bytes_bound`. For the window a counter's `limit` caps, `limit` is its max, `value` "
   "at most that, and `remaining` what is left to spend; null otherwise. See docs/SEMANTICS.md (clock skew moves each edge by the skew)."),
 "FrequencyRead": obj({"item": STR, "estimate": UINT, "lower_bound": UINT, "error_bound": UINT, "confidence": NUM, "epsilon": NUM,
   "total": UINT, "complete": BOOL, "missing_shards": {"type": "array", "items": UINT}},
   ["item", "estimate", "lower_bound", "error_bound", "confidence", "epsilon", "total", "complete", "missing_shards"],
   desc="An item's summed weight: `estimate` is never below it and exceeds it by at most `error_bound` (epsilon × total) with probability `confidence`; "
   "`lower_bound` is a weight it certainly has."),
 "TopEntry": obj({"item": STR, "estimate": UINT, "lower_bound": UINT}, ["item", "estimate", "lower_bound"]),
 "TopRead": obj({"k": UINT, "items": {"type": "array", "items": ref("TopEntry"), "maxItems": 256}, "error_bound": UINT, "confidence": NUM,
   "undercount": UINT, "total": UINT, "complete": BOOL, "missing_shards": {"type": "array", "items": UINT}},
   ["k", "items", "error_bound", "confidence", "undercount", "total", "complete", "missing_shards"],
   desc="The heaviest items, heaviest first. A listed item's weight lies in [lower_bound, min(estimate, lower_bound + undercount)]; "
   "an unlisted item weighs at most `undercount`."),
 "ReplicaReport": obj({"node": STR, "replica": nullable({"type": "string", "pattern": "^[0-9]+$"}), "role": {"type": "string", "enum": ["voter", "learner", "directory"]},
   "current": nullable(BOOL), "matched": nullable(UINT)}, ["node", "replica", "role", "current", "matched"],
   desc="One replica of a range: its node, raft id (64 bits, in decimal), role (`directory`: named by the range directory on a node that runs no replica of the range), "
   "whether it is its node's current store incarnation, and on the range's leader the last log index it is known to hold."),
 "RangeReport": obj({"range": UINT,
   "counter_replicas": nullable({"type": "integer", "minimum": 1, "maximum": 5}), "replicated_here": BOOL, "replicas": {"type": "array", "items": ref("ReplicaReport")},
   "leader": nullable(STR), "term": nullable(UINT), "joint": BOOL, "applied": nullable(UINT), "leader_last_log": nullable(UINT),
   "excluded": {"type": "array", "items": STR}, "stopped": nullable(STR)},
   ["range", "counter_replicas", "replicated_here", "replicas", "leader", "term", "joint", "applied", "leader_last_log", "excluded", "stopped"],
   desc="A range's replica group as the node asked knows it (only when cluster.replicas > 1). `range` is the range's number in its layout; "
   "`counter_replicas` the copies its counters state when they state their own (each such count has ranges of its own), null for the ranges "
   "of counters that take the cluster's. On a node that runs no replica of the range, "
   "`replicas` are the directory's, `leader` the replica that served the range last for it, `term` null. `applied` is the node's last applied "
   "index; on the leader, `leader_last_log` is its last log index and every replica's `matched` is filled (a learner has caught up once "
   "`matched` reaches the leader's `applied`). `excluded`: nodes the directory names that hold no replica in the group. "
   "`stopped`: why the node asked's replica stopped on a fatal error (a failed write to its store; restart the node), null while it runs."),
 "ShardReport": obj({"index": UINT, "node": STR, "value": INT, "writes": UINT, "replication": ref("RangeReport")},
   ["index", "node", "value", "writes"]),
 "Contention": obj({"rate_per_shard": UINT, "rate_hottest": UINT, "skew": NUM, "queue_depth_max": UINT, "rate_total": UINT},
   ["rate_per_shard", "rate_hottest", "skew", "queue_depth_max", "rate_total"],
   desc="One sample of a counter's contention on this node: increments per second (mean per shard, busiest shard, all shards), skew, and the most increments waiting at one shard at once."),
 "AutoChange": obj({"from": UINT, "to": UINT, "reason": {"type": "string", "enum": ["queue_depth", "write_rate", "hot_shard", "quiet", "bounds"]},
   "proposed_at_ms": UINT, "completed_at_ms": nullable(UINT), "figures": ref("Contention")},
   ["from", "to", "reason", "proposed_at_ms", "completed_at_ms", "figures"]),
 "AutoStatus": obj({"bounds": ref("AutoShards"), "last_change": nullable(ref("AutoChange")), "pending": nullable(ref("AutoChange")),
   "last_dropped": nullable(obj({"change": ref("AutoChange"), "reason": STR}, ["change", "reason"])), "figures": nullable(ref("Contention"))},
   ["bounds", "last_change", "pending", "last_dropped", "figures"]),
 "ShardsReport": obj({"generation": UINT, "base": INT, "shards": {"type": "array", "items": ref("ShardReport")}, "skew": NUM,
   "auto": nullable(ref("AutoStatus"))}, ["generation", "base", "shards", "skew", "auto"]),
 "Reconcile": obj({"authoritative": INT}, ["authoritative"]),
 "ReconcileReport": obj({"before": INT, "drift": INT, "corrected": BOOL}, ["before", "drift", "corrected"]),
 "ReconcileRun": obj({"at_ms": UINT, "source": STR, "node": STR, "before": nullable(INT), "authoritative": nullable(INT),
   "drift": nullable(INT), "corrected": BOOL,
   "outcome": {"type": "string", "enum": ["corrected", "in_sync", "source_failed", "unavailable", "drift_out_of_range", "not_found", "failed"]},
   "error": nullable(STR)}, ["at_ms", "source", "node", "before", "authoritative", "drift", "corrected", "outcome", "error"],
   desc="One reconciliation of one counter: scheduled from a source of truth, or `request` for POST .../reconcile."),
 "Reconciliations": obj({"counter": NAME, "node": STR, "runs": {"type": "array", "items": ref("ReconcileRun"), "maxItems": 32}},
   ["counter", "node", "runs"], desc="The recent runs this node made, newest first."),
 "NodeView": obj({"id": STR, "state": {"type": "string", "enum": ["up", "suspect", "down"]}, "http": STR, "member": BOOL},
   ["id", "state", "http", "member"]),
 "ClusterView": obj({"nodes": {"type": "array", "items": ref("NodeView")}, "leader": nullable(STR), "term": UINT,
   "placement_epoch": UINT, "handoff": {"type": "array", "items": STR}, "data_lost": {"type": "array", "items": STR},
   "ranges": {"type": "array", "items": ref("RangeReport")}},
   ["nodes", "leader", "term", "placement_epoch", "handoff", "data_lost"]),
 "CounterPage": obj({"counters": {"type": "array", "items": NAME, "maxItems": 1000}, "next": nullable(ESCAPED)}, ["counters", "next"],
   desc="One page of counter names in byte order; pass `next` as `cursor` for the next page (null on the last)."),
 "CounterStats": obj({"name": NAME, "writes": UINT, "write_rate": {"type": "number", "minimum": 0}, "skew": {"type": "number", "minimum": 0},
   "value": nullable(INT), "staleness_ms": nullable(UINT), "complete": nullable(BOOL), "drift": nullable(INT), "error": nullable(STR)},
   ["name", "writes", "write_rate", "skew", "value", "staleness_ms", "complete", "drift", "error"]),
 "LatencySummary": obj({"count": UINT, "mean_us": NUM, "p50_us": UINT, "p99_us": UINT}, ["count", "mean_us", "p50_us", "p99_us"]),
 "StatsView": obj({"node": STR, "as_of_ms": UINT, "rate_window_ms": UINT, "increments": UINT, "increment_rate": NUM,
   "counters": {"type": "array", "items": ref("CounterStats"), "maxItems": 100},
   "reads": obj({"cached": ref("LatencySummary"), "fresh": ref("LatencySummary")}, ["cached", "fresh"])},
   ["node", "as_of_ms", "rate_window_ms", "increments", "increment_rate", "counters", "reads"]),
 "Health": obj({"status": {"const": "ok"}}, ["status"]),
}

schemas["BatchItem"]["oneOf"] = [{"required": ["counter"]}, {"required": ["counter_encoded"]}]

def err(desc): return {"description": desc, **json_body(ref("Error"))}
def ok(desc, schema): return {"description": desc, **json_body(schema)}
E400 = err("Malformed request: bad name, JSON, query or field.")
E404 = err("Unknown counter, node or route.")
E409 = err("Conflict: a reused event id, a writer sequence out of order, a bound the increment would cross (`bound_exceeded`), a resharding in progress, or not a cluster.")
E429 = err("The writer is new and its shard keeps marks for the most writers it may (`too_many_writers`); retry later.")
E413 = err("Body or batch too large.")
E422 = err("A value out of range.")
E503 = err("A shard or the metadata group is unavailable, or the node is starting or shutting down; retry (with the same event id).")
E507 = err("A quota of the node would be exceeded (`quota_exceeded`: engine.counters_max, [[quotas]], "
           "engine.event_ids_per_counter_max, engine.sketch_bytes_per_counter_max); nothing was created or counted.")
E415 = err("The body is not application/json (every POST must declare a JSON body, `{}` when it has no fields).")
name_param = {"name": "name", "in": "path", "required": True, "schema": NAME, "description": "The counter's name."}
prefix_param = {"name": "prefix", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1, "maxLength": 1536},
                "description": "A name prefix, percent-encoded."}
id_param = {"name": "id", "in": "path", "required": True, "schema": STR, "description": "A node id from the cluster config."}

def op(op_id, summary, responses, params=(), body=None, tag="counters"):
    o = {"operationId": op_id, "summary": summary, "tags": [tag], "responses": responses}
    if params: o["parameters"] = list(params)
    if body: o["requestBody"] = {"required": body[1], **json_body(body[0])}
    return o

paths = {
 "/v1/counters": {"get": op("listCounters", "One page of counter names, in byte order.", {
     "200": ok("A page of names and the cursor of the next.", ref("CounterPage")), "400": E400},
     [{"name": "prefix", "in": "query", "schema": {"type": "string", "maxLength": 512}, "description": "Only names starting with this."},
      {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}},
      {"name": "cursor", "in": "query", "schema": ESCAPED, "description": "The `next` of the previous page."}])},
 "/v1/counters/{name}": {
   "put": op("putCounter", "Create (201) or update (200) a counter.", {
     "200": ok("Updated.", ref("CounterInfo")), "201": ok("Created.", ref("CounterInfo")),
     "400": E400, "409": E409, "413": E413, "415": E415, "422": E422, "503": E503, "507": E507}, [name_param], (ref("SpecPatch"), False)),
   "get": op("getCounter", "The counter's spec and a summary.", {"200": ok("The counter.", ref("CounterInfo")), "400": E400, "404": E404}, [name_param]),
   "delete": op("deleteCounter", "Delete the counter and its data.", {"204": {"description": "Deleted."}, "400": E400, "404": E404, "503": E503}, [name_param])},
 "/v1/counters/{name}/increments": {"post": op("increment", "Count one increment (an unknown counter is created with the defaults).", {
     "200": ok("Counted, or recognized as a duplicate.", ref("IncrOutcome")), "400": E400, "409": E409, "413": E413, "415": E415,
     "422": E422, "429": E429, "503": E503, "507": E507}, [name_param], (ref("Increment"), True))},
 "/v1/increments": {"post": op("incrementMany", "Count many increments; one result per item, in order.", {
     "200": ok("One result per item.", ref("BatchResults")), "400": E400, "413": E413, "415": E415, "503": E503}, body=(ref("Batch"), True))},
 "/v1/counters/{name}/value": {"get": op("readValue", "The counter's total.", {
     "200": ok("The total and how much to trust it; with `window`, the sliding window's total and its bucket granularity.",
               {"oneOf": [ref("ValueRead"), ref("WindowRead")]}),
     "400": err("Malformed request, or a window the counter does not keep (`unknown_window`)."), "404": E404, "503": E503},
     [name_param, {"name": "consistency", "in": "query", "schema": {"type": "string", "enum": ["cached", "fresh"], "default": "cached"}},
      {"name": "window", "in": "query", "schema": STR, "description": "One of the counter's windows (`1m`, `1h`, …): a fresh read of that sliding window."}])},
 "/v1/counters/{name}/distinct": {"get": op("readDistinct", "The distinct-member estimate.", {
     "200": ok("The estimate; with `window`, the sliding window's estimate and total and its bucket granularity.",
               {"oneOf": [ref("DistinctRead"), ref("WindowRead")]}),
     "400": err("Malformed request, or a window the counter does not keep (`unknown_window`)."), "404": E404, "409": E409, "422": E422, "503": E503},
     [name_param, {"name": "window", "in": "query", "schema": STR, "description": "One of the counter's windows: a fresh read of that sliding window."}])},
 "/v1/counters/{name}/frequency": {"get": op("readFrequency", "An item's estimated frequency, merged over every shard (counters with `frequency`).", {
     "200": ok("The estimate, its error bound and confidence.", ref("FrequencyRead")), "400": E400, "404": E404, "409": E409, "503": E503},
     [name_param, {"name": "item", "in": "query", "required": True, "schema": {"type": "string", "maxLength": 1024}}])},
 "/v1/counters/{name}/top": {"get": op("readTop", "The heaviest items, merged over every shard (counters with `frequency`).", {
     "200": ok("The items with their estimates and bounds.", ref("TopRead")), "400": E400, "404": E404, "409": E409, "503": E503},
     [name_param, {"name": "k", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 256, "default": 10}}])},
 "/v1/counters/{name}/shards": {"get": op("readShards", "Per-shard values, owners, writes and skew.", {
     "200": ok("The shards.", ref("ShardsReport")), "400": E400, "404": E404, "503": E503}, [name_param])},
 "/v1/counters/{name}/expiry": {
   "get": op("getExpiry", "The counter's deadline (as TTL).", {"200": ok("The deadline.", ref("ExpiryView")), "400": E400, "404": E404}, [name_param]),
   "put": op("putExpiry", "Set the counter's deadline (as EXPIRE with NX, XX, GT, LT).", {
     "200": ok("The deadline after the change.", ref("ExpiryView")), "400": E400, "404": E404, "415": E415, "422": E422, "503": E503},
     [name_param], (ref("Expiry"), True)),
   "delete": op("deleteExpiry", "Remove the counter's deadline (as PERSIST).", {
     "200": ok("The deadline after the change.", ref("ExpiryView")), "400": E400, "404": E404, "503": E503}, [name_param])},
 "/v1/namespaces": {"get": op("listNamespaces", "Every namespace, by prefix.", {"200": ok("The namespaces.", ref("Namespaces"))}, tag="namespaces")},
 "/v1/namespaces/{prefix}": {
   "put": op("putNamespace", "Declare (201) or replace (200) the spec counters created implicitly under the prefix take.", {
     "200": ok("Replaced.", ref("Namespace")), "201": ok("Declared.", ref("Namespace")), "400": E400, "415": E415, "422": E422, "503": E503},
     [prefix_param], (ref("SpecPatch"), False), tag="namespaces"),
   "get": op("getNamespace", "The namespace.", {"200": ok("The namespace.", ref("Namespace")), "404": E404}, [prefix_param], tag="namespaces"),
   "delete": op("deleteNamespace", "Drop the namespace (counters created under it keep their specs).", {
     "204": {"description": "Dropped."}, "404": E404, "503": E503}, [prefix_param], tag="namespaces")},
 "/v1/counters/{name}/reconcile": {"post": op("reconcile", "Bring the counter to an authoritative total.", {
     "200": ok("What was found and corrected.", ref("ReconcileReport")), "400": E400, "404": E404, "415": E415, "422": E422, "503": E503},
     [name_param], (ref("Reconcile"), True))},
 "/v1/counters/{name}/reconciliations": {"get": op("reconciliations", "The recent reconciliations of the counter this node ran.", {
     "200": ok("The runs, newest first.", ref("Reconciliations")), "400": E400}, [name_param])},
 "/v1/stats": {"get": op("stats", "This node's busiest counters (rate, value, staleness, skew, drift) and read latency.", {
     "200": ok("The summary.", ref("StatsView")), "400": E400},
     [{"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 10}}], tag="operations")},
 "/v1/cluster": {"get": op("cluster", "Members, their state, the metadata leader, term and placement epoch.", {
     "200": ok("The cluster as this node sees it.", ref("ClusterView"))}, tag="cluster")},
 "/v1/cluster/members/{id}": {
   "put": op("addMember", "Add a node to the placement ring.", {"200": ok("The cluster after the change.", ref("ClusterView")),
     "400": E400, "404": E404, "409": E409, "503": E503}, [id_param], tag="cluster"),
   "delete": op("removeMember", "Remove a node from the placement ring.", {"200": ok("The cluster after the change.", ref("ClusterView")),
     "400": E400, "404": E404, "409": E409, "503": E503}, [id_param], tag="cluster")},
 "/v1/cluster/nodes/{id}/accept-loss": {"post": op("acceptLoss", "Accept that a replaced disk lost a node's data.", {
     "200": ok("The cluster after the change.", ref("ClusterView")), "400": E400, "404": E404, "409": E409, "415": E415, "503": E503},
     [id_param], (obj({}, []), True), tag="cluster")},
 "/v1/openapi.json": {"get": op("openapi", "This document.", {"200": {"description": "The OpenAPI 3.1 document.",
     "content": {"application/json": {"schema": {"type": "object"}}}}}, tag="operations")},
 "/metrics": {"get": op("metrics", "Prometheus text exposition (version 0.0.4).", {"200": {"description": "The metrics.",
     "content": {"text/plain": {"schema": {"type": "string"}}}}}, tag="operations")},
 "/healthz": {"get": op("healthz", "200 when the node is ready to serve.", {"200": ok("Ready.", ref("Health")), "503": E503}, tag="operations")},
 "/ui": {"get": op("statusPage", "The status page (HTML; its script and styles are /ui/app.js and /ui/app.css).", {
     "200": {"description": "The page.", "content": {"text/html": {"schema": {"type": "string"}}}}}, tag="operations")},
}

# Client tokens (`[[tokens]]` in the node config): every route but the open ones
# takes `Authorization: Bearer TOKEN` and may answer 401 or 403. A node without
# tokens is open and never answers either.
E401 = {**err("No token, a malformed Authorization header, or a token this node does not accept "
               "(the answer carries WWW-Authenticate: Bearer realm=\"tally\")."),
        "headers": {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer realm=\"tally\", with error=\"invalid_token\" for a wrong token."}}}
E403 = err("The token's scopes or counter prefixes do not allow this, or (a write) a browser sent it from a page of "
           "another origin (`cross_origin`).")
OPEN = {"/v1/openapi.json", "/healthz", "/ui"}
# Browsers (http::browser): a Host the node does not answer to is refused on every
# route; a write from a page of another origin, and a POST without a JSON body, too.
E421 = err("The Host header names a host this node does not answer to (`host_not_allowed`: not an IP literal, "
           "localhost, nor one of http.allowed_hosts), which is how DNS rebinding looks.")
E403_CROSS = err("A browser sent this write from a page of another origin (`cross_origin`).")
for path, ops in paths.items():
    for method, o in ops.items():
        o["responses"]["421"] = E421
        if method != "get":
            o["responses"]["403"] = E403_CROSS
        if method == "post":
            o["responses"]["415"] = E415
        if path in OPEN:
            o["security"] = []
        else:
            o["responses"]["401"] = E401
            o["responses"]["403"] = E403
paths["/metrics"]["get"]["description"] = ("Needs a read token without counter prefixes on a node with tokens, "
                                          "unless http.metrics_public is set.")

doc = {
 "openapi": "3.1.0",
 "info": {"title": "Tally", "version": "0.1.0", "summary": "A distributed counter service: sharded, batched, durable counters over HTTP/JSON.",
          "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"}},
 "servers": [{"url": "http://127.0.0.1:7070", "description": "the built-in single-node config"}],
 "tags": [{"name": "counters"}, {"name": "namespaces"}, {"name": "cluster"}, {"name": "operations"}],
 "paths": paths,
 "security": [{"bearer": []}],
 "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
     "description": "A client token declared in the node's [[tokens]] (tally token new); scopes read, write, admin; optional counter-name prefixes. Not needed on a node without tokens."}}},
}
out = pathlib.Path(__file__).resolve().parent.parent / "crates/tally-server/openapi.json"
out.write_text(json.dumps(doc, indent=1) + "\n")
print(f"wrote {out}")
