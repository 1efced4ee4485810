//! t17: code written for Redis runs unchanged against a node. Keys are any bytes
//! (spaces, hash tags, `@`, `/`, UTF-8, bytes that are not text, up to the named
//! limit) and reach the same counter as the HTTP API's percent-encoded paths, their
//! bytes kept exactly; errors and bodies name a counter as it was given, and a
//! batch item names any bytes with `counter_encoded`. Then the clients people use,
//! as they use them: redis-py (plain calls, pipelines with and without a transaction, the fixed-window rate
//! limiter, `PF*`, and RedisBloom's count-min and top-k through `r.cms()` and
//! `r.topk()`), ioredis from npm (pipelines and `MULTI`), and `redis-benchmark -t incr`
//! with and without pipelining, whose every request must be counted exactly once.
//! A test whose client is not installed is skipped with a message, and fails when
//! `CI` is set (`.ci/run` installs them all).

use anyhow::{bail, Context, Result};
use std::future::Future;
use std::pin::Pin;
use std::process::Command;
use std::time::Duration;
use tally_core::name::NAME_BYTES_MAX;
use tally_tests::{in_ci, python_redis, require_tool, TestCluster};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// How long one RESP exchange may take.
const EXCHANGE_TIMEOUT_MS: u64 = 10_000;

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Resp {
    /// `+…`
    Simple(String),
    /// `-…`
    Error(String),
    /// `:…`
    Int(i64),
    /// `$…`, `None` for nil.
    Bulk(Option<Vec<u8>>),
    /// `*…`
    Array(Vec<Resp>),
}

/// A RESP connection that sends commands of any bytes and reads one reply each.
struct Conn(BufReader<TcpStream>);

impl Conn {
    async fn open(port: u16) -> Result<Self> {
        Ok(Self(BufReader::new(TcpStream::connect(("127.0.0.1", port)).await?)))
    }

    /// The reply to `args`.
    async fn call(&mut self, args: &[&[u8]]) -> Result<Resp> {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        self.0.get_mut().write_all(&out).await?;
        tokio::time::timeout(Duration::from_millis(EXCHANGE_TIMEOUT_MS), self.reply())
            .await
            .context("no reply in time")?
    }

    fn reply(&mut self) -> Pin<Box<dyn Future<Output = Result<Resp>> + Send + '_>> {
        Box::pin(async move {
            let mut line = String::new();
            self.0.read_line(&mut line).await?;
            let line = line.trim_end();
            let Some(kind) = line.as_bytes().first() else { bail!("the node closed the connection") };
            let rest = &line[1..];
            Ok(match kind {
                b'+' => Resp::Simple(rest.into()),
                b'-' => Resp::Error(rest.into()),
                b':' => Resp::Int(rest.parse()?),
                b'$' => {
                    let len: i64 = rest.parse()?;
                    if len < 0 {
                        return Ok(Resp::Bulk(None));
                    }
                    let mut buf = vec![0; usize::try_from(len)? + 2];
                    self.0.read_exact(&mut buf).await?;
                    buf.truncate(buf.len() - 2);
                    Resp::Bulk(Some(buf))
                }
                b'*' => {
                    let n: usize = rest.parse()?;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.reply().await?);
                    }
                    Resp::Array(items)
                }
                other => bail!("unexpected reply type {:?}", *other as char),
            })
        })
    }
}

/// `%XX` for every byte outside RFC 3986's unreserved characters.
fn percent_encode(raw: &[u8]) -> String {
    raw.iter()
        .map(|&b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_any_bytes_and_reach_the_same_counter_over_http() -> Result<()> {
    let c = TestCluster::start(1).await?;
    let mut r = Conn::open(c.node(1).ports.resp).await?;
    let longest = vec![b'k'; NAME_BYTES_MAX];
    let keys: Vec<&[u8]> = vec![
        b"user:{42}:hits",
        b"with space",
        b"mail@example.com/inbox",
        "ключ:üñí".as_bytes(),
        b"100%",
        b"\x00\xff\r\n",
        &longest,
    ];

    eprintln!("phase: INCRBY over RESP, then the same counters over HTTP");
    for (i, key) in keys.iter().enumerate() {
        let delta = (i + 1).to_string();
        assert_eq!(r.call(&[b"INCRBY", key, delta.as_bytes()]).await?, Resp::Int(i as i64 + 1), "{key:?}");
        let path = percent_encode(key);
        let (status, body) = c.incr(1, &path, serde_json::json!({"delta": 10})).await?;
        assert_eq!(status, 200, "{key:?}: {body}");
        assert_eq!(c.value(1, &path).await?, i as i64 + 11, "{key:?}");
        assert_eq!(r.call(&[b"GET", key]).await?, Resp::Bulk(Some((i + 11).to_string().into_bytes())));
    }
    // HTTP shows a UTF-8 name as itself.
    let info = c.get(1, &format!("/v1/counters/{}", percent_encode("ключ:üñí".as_bytes()))).await?;
    assert_eq!(info["name"], "ключ:üñí", "{info}");

    eprintln!("phase: SCAN and KEYS answer the keys' own bytes");
    let Resp::Array(all) = r.call(&[b"KEYS", b"*"]).await? else { bail!("KEYS answered no array") };
    let mut got: Vec<Vec<u8>> = all
        .into_iter()
        .map(|k| match k {
            Resp::Bulk(Some(b)) => Ok(b),
            other => bail!("a key that is not a bulk string: {other:?}"),
        })
        .collect::<Result<_>>()?;
    got.sort();
    let mut want: Vec<Vec<u8>> = keys.iter().map(|k| k.to_vec()).collect();
    want.sort();
    assert_eq!(got, want);
    let Resp::Array(page) = r.call(&[b"SCAN", b"0", b"MATCH", b"user:{*", b"COUNT", b"100"]).await? else {
        bail!("SCAN answered no array")
    };
    assert_eq!(page[1], Resp::Array(vec![Resp::Bulk(Some(b"user:{42}:hits".to_vec()))]));
    assert_eq!(r.call(&[b"EXISTS", b"\x00\xff\r\n", b"with space", b"\x00\xff"]).await?, Resp::Int(2));

    eprintln!("phase: the limits, on both fronts");
    let over = vec![b'k'; NAME_BYTES_MAX + 1];
    let Resp::Error(e) = r.call(&[b"INCR", &over]).await? else { bail!("an over-long key was accepted") };
    assert!(e.starts_with("ERR invalid_name"), "{e}");
    let Resp::Error(e) = r.call(&[b"INCR", b""]).await? else { bail!("an empty key was accepted") };
    assert!(e.starts_with("ERR invalid_name"), "{e}");
    let (status, body) = c.incr(1, &percent_encode(&over), serde_json::json!({"delta": 1})).await?;
    assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid_name")), "{body}");
    let (status, body) = c.incr(1, "bad%zz", serde_json::json!({"delta": 1})).await?;
    assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid_path")), "{body}");

    eprintln!("phase: the names survive a restart byte for byte");
    assert_eq!(c.node(1).stop(), Some(0), "a clean stop");
    c.restart(1).await?;
    let mut r = Conn::open(c.node(1).ports.resp).await?;
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(r.call(&[b"GET", key]).await?, Resp::Bulk(Some((i + 11).to_string().into_bytes())));
    }
    Ok(())
}

/// A name as an error message quotes it: the name itself when it is UTF-8 (its
/// quotes, backslashes and control characters escaped), else its escaped form.
fn quoted(raw: &[u8]) -> String {
    match std::str::from_utf8(raw) {
        Ok(text) => format!("{text:?}"),
        Err(_) => format!("{:?}", tally_core::name::escape(raw)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_and_bodies_name_a_counter_as_it_was_given() -> Result<()> {
    use tally_tests::openapi;
    let c = TestCluster::start(1).await?;
    let names: [&[u8]; 6] =
        [b"a b", "ü".as_bytes(), b"100%", b"say \"hi\"", "tenant/ключ".as_bytes(), b"\xff\xfe"];

    eprintln!("phase: an error about a counter quotes its name, not the name's escaped form");
    for raw in names {
        let path = format!("/v1/counters/{}", percent_encode(raw));
        let (status, body) = c.send(1, "GET", &path, serde_json::json!(null)).await?;
        assert_eq!(status, 404, "{raw:?}: {body}");
        openapi::check("GET", "/v1/counters/{name}", status, &body)?;
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&quoted(raw)),
            "{raw:?}: the message {message:?} does not quote {}",
            quoted(raw)
        );
    }
    // A refusal the engine answers for one counter, over HTTP and over RESP.
    let (status, body) = c.incr(1, "a%20b", serde_json::json!({"delta": 1})).await?;
    assert_eq!(status, 200, "{body}");
    let (status, body) =
        c.send(1, "GET", "/v1/counters/a%20b/frequency?item=x", serde_json::json!(null)).await?;
    assert_eq!(status, 409, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.starts_with("counter \"a b\" keeps no frequencies"), "{message}");
    let mut r = Conn::open(c.node(1).ports.resp).await?;
    assert_eq!(r.call(&[b"INCR", "ü x".as_bytes()]).await?, Resp::Int(1));
    let Resp::Error(e) = r.call(&[b"CMS.QUERY", "ü x".as_bytes(), b"item"]).await? else {
        bail!("CMS.QUERY of a counter without frequencies answered no error")
    };
    assert!(e.contains("counter \"ü x\" keeps no frequencies"), "{e}");
    // Each failed item of a batch, the same.
    c.put_counter(1, "f%C3%BC", serde_json::json!({"frequency": {"epsilon": 0.01, "delta": 0.01}})).await?;
    let batch = serde_json::json!({"increments": [{"counter": "fü", "delta": -1, "item": "x"}]});
    let (status, body) = c.send(1, "POST", "/v1/increments", batch).await?;
    assert_eq!(status, 200, "{body}");
    openapi::check("POST", "/v1/increments", status, &body)?;
    let message = body["results"][0]["error"]["message"].as_str().unwrap_or_default();
    assert!(message.starts_with("counter \"fü\" keeps frequencies"), "{body}");
    // A body that names the counter names it as given too.
    let runs = c.get(1, "/v1/counters/a%20b/reconciliations").await?;
    assert_eq!(runs["counter"], "a b", "{runs}");

    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_item_names_any_bytes_with_counter_encoded() -> Result<()> {
    use tally_tests::openapi;
    let c = TestCluster::start(1).await?;
    let mut r = Conn::open(c.node(1).ports.resp).await?;
    assert_eq!(c.incr(1, "a%20b", serde_json::json!({"delta": 1})).await?.0, 200);

    eprintln!("phase: counter_encoded, percent-encoded as a path, reaches the counter of those bytes");
    let batch = serde_json::json!({"increments": [
        {"counter_encoded": "%FF%FE", "delta": 2},
        {"counter_encoded": "a%20b", "delta": 3},
        {"counter_encoded": "%c3%bc%20x", "delta": 4},
        {"counter": "a b", "delta": 5},
    ]});
    let (status, body) = c.send(1, "POST", "/v1/increments", batch).await?;
    assert_eq!(status, 200, "{body}");
    openapi::check("POST", "/v1/increments", status, &body)?;
    for result in body["results"].as_array().context("no results")? {
        assert_eq!(result["applied"], true, "{body}");
    }
    assert_eq!(c.value(1, "%FF%FE").await?, 2);
    assert_eq!(c.value(1, "a%20b").await?, 1 + 3 + 5);
    assert_eq!(r.call(&[b"GET", "ü x".as_bytes()]).await?, Resp::Bulk(Some(b"4".to_vec())));
    // A name a listing shows in its escaped form (not UTF-8) goes back as it is shown.
    let page = c.get(1, "/v1/counters").await?;
    let listed: Vec<&str> =
        page["counters"].as_array().context("no counters")?.iter().filter_map(|n| n.as_str()).collect();
    assert!(listed.contains(&"%FF%FE") && listed.contains(&"a b"), "{page}");
    let batch = serde_json::json!({"increments": [{"counter_encoded": "%FF%FE", "delta": 1}]});
    assert_eq!(c.send(1, "POST", "/v1/increments", batch).await?.0, 200);
    assert_eq!(r.call(&[b"GET", b"\xff\xfe"]).await?, Resp::Bulk(Some(b"3".to_vec())));

    eprintln!("phase: exactly one of counter and counter_encoded, a valid encoding");
    let refused = [
        (serde_json::json!({"counter": "a", "counter_encoded": "a", "delta": 1}), "not both"),
        (serde_json::json!({"delta": 1}), "counter or counter_encoded is required"),
        (serde_json::json!({"counter_encoded": "a%zz", "delta": 1}), "counter_encoded"),
    ];
    for (item, says) in refused {
        let batch = serde_json::json!({"increments": [{"counter": "ok", "delta": 1}, item]});
        let (status, body) = c.send(1, "POST", "/v1/increments", batch).await?;
        openapi::check("POST", "/v1/increments", status, &body)?;
        assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid_body")), "{body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.starts_with("increments[1]") && message.contains(says), "{message}");
    }
    let (status, _) = c.send(1, "GET", "/v1/counters/ok", serde_json::json!(null)).await?;
    assert_eq!(status, 404, "a refused batch counts none of its items");
    Ok(())
}

/// Runs `program args…`; fails with its output if it fails.
fn run(program: &str, args: &[&str], env: &[(&str, &str)]) -> Result<String> {
    let out = Command::new(program).args(args).envs(env.iter().copied()).output()?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("{program} failed ({}):\n{text}", out.status);
    }
    Ok(text)
}

/// redis-py, as its documentation shows it. Every check is an `assert`.
const REDIS_PY: &str = r#"
import sys, time, redis
r = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]))

# Plain calls.
assert r.ping()
assert [r.incr("page:views") for _ in range(3)] == [1, 2, 3]
assert r.incrby("page:views", 10) == 13 and r.decr("page:views") == 12
assert r.get("page:views") == b"12" and r.get("never:made") is None
assert r.mget("page:views", "never:made") == [b"12", None]
assert r.exists("page:views", "never:made") == 1
assert r.type("page:views") == b"string"
assert r.set("page:resets", 40) and r.incr("page:resets") == 41
assert r.getdel("page:resets") == b"41" and r.get("page:resets") is None
assert r.delete("page:views") == 1 and r.get("page:views") is None

# Pipelines: without a transaction, and with one (redis-py's default).
p = r.pipeline(transaction=False)
for _ in range(100):
    p.incr("pipe:plain")
assert p.execute() == list(range(1, 101))
p = r.pipeline()
p.incr("pipe:tx").incrby("pipe:tx", 4).get("pipe:tx")
assert p.execute() == [1, 5, b"5"]
with r.pipeline() as p:
    p.multi()
    p.incr("pipe:tx")
    p.expire("pipe:tx", 60)
    assert p.execute() == [6, True]
assert 55 <= r.ttl("pipe:tx") <= 60

# The fixed-window rate limiter of every tutorial.
def allow(user, limit):
    key = "rate:%s:%d" % (user, int(time.time()) // 60)
    p = r.pipeline()
    p.incr(key)
    p.expire(key, 60)
    count, _ = p.execute()
    return count <= limit
assert [allow("ann", 3) for _ in range(5)] == [True, True, True, False, False]

# HyperLogLog.
assert r.pfadd("hll:a", *["u%d" % i for i in range(500)]) == 1
assert r.pfadd("hll:b", *["u%d" % i for i in range(250, 750)]) == 1
assert abs(r.pfcount("hll:a") - 500) <= 15
assert abs(r.pfcount("hll:a", "hll:b") - 750) <= 25, r.pfcount("hll:a", "hll:b")
assert r.pfmerge("hll:all", "hll:a", "hll:b")
assert abs(r.pfcount("hll:all") - 750) <= 25, r.pfcount("hll:all")

# Count-min and top-k through redis-py's RedisBloom commands.
cms = r.cms()
assert cms.initbydim("cms:pages", 2000, 5)
assert cms.incrby("cms:pages", ["/home", "/pricing"], [7, 2]) == [7, 2]
assert cms.incrby("cms:pages", ["/home"], [1]) == [8]
home, pricing, never = cms.query("cms:pages", "/home", "/pricing", "/never")
assert home >= 8 and pricing >= 2 and never >= 0, (home, pricing, never)
info = cms.info("cms:pages")
assert (info.width, info.depth, info.count) == (2000, 5, 10), (info.width, info.depth, info.count)
assert cms.initbyprob("cms:other", 0.001, 0.01)
assert cms.incrby("cms:other", ["/home"], [3]) == [3]
assert cms.initbydim("cms:sum", 2000, 5)
assert cms.merge("cms:sum", 2, ["cms:pages", "cms:pages"])
assert cms.query("cms:sum", "/home")[0] >= 16
topk = r.topk()
assert topk.reserve("top:songs", 3, 2000, 5, 0.9)
for song, plays in [("a", 9), ("b", 5), ("c", 3), ("d", 1)]:
    for _ in range(plays):
        topk.add("top:songs", song)
assert topk.incrby("top:songs", ["e"], [2]) is not None
assert topk.list("top:songs") == ["a", "b", "c"], topk.list("top:songs")
assert topk.query("top:songs", "a", "d") == [1, 0], topk.query("top:songs", "a", "d")
a, d = topk.count("top:songs", "a", "d")
assert a >= 9 and d >= 1, (a, d)
info = topk.info("top:songs")
# k is kept; width and depth are the shape Tally picks for k (docs/SEMANTICS.md).
assert info.k == 3 and info.width > 0 and info.depth > 0, (info.k, info.width, info.depth)

# Keys of any bytes, and SCAN as redis-py pages through it.
for key in [b"bin:\x00\xff", "bin:ключ", "bin:{tag} with space"]:
    assert r.incr(key) == 1 and r.get(key) == b"1"
assert sorted(r.scan_iter(match="bin:*", count=2)) == sorted([b"bin:\x00\xff", "bin:ключ".encode(), b"bin:{tag} with space"])
print("redis-py ok")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_py_code_runs_unchanged() -> Result<()> {
    let Some(python) = python_redis()? else { return Ok(()) };
    let c = TestCluster::start(1).await?;
    let port = c.node(1).ports.resp.to_string();
    let out = run(python, &["-c", REDIS_PY, &port], &[])?;
    assert!(out.contains("redis-py ok"), "{out}");
    // What redis-py counted is what the HTTP API reads.
    assert_eq!(c.value(1, "pipe:plain").await?, 100);
    assert_eq!(c.value(1, "pipe:tx").await?, 6);
    Ok(())
}

/// ioredis, as its README shows it: plain calls, a pipeline, and `multi()`.
const IOREDIS: &str = r#"
const Redis = require("ioredis");
const assert = require("assert");
(async () => {
  const r = new Redis({ port: Number(process.argv[1]), host: "127.0.0.1", lazyConnect: false });
  assert.strictEqual(await r.incr("io:plain"), 1);
  assert.strictEqual(await r.incrby("io:plain", 9), 10);
  assert.strictEqual(await r.get("io:plain"), "10");

  const p = r.pipeline();
  for (let i = 0; i < 200; i++) p.incr("io:pipe");
  const replies = await p.exec();
  assert.deepStrictEqual(replies.map(([err, n]) => (err ? String(err) : n)), [...Array(200).keys()].map((i) => i + 1));

  const tx = await r.multi().incr("io:tx").incrby("io:tx", 4).expire("io:tx", 30).get("io:tx").exec();
  assert.deepStrictEqual(tx, [[null, 1], [null, 5], [null, 1], [null, "5"]]);
  const ttl = await r.ttl("io:tx");
  assert.ok(ttl > 25 && ttl <= 30, String(ttl));

  // A transaction with a command refused while queued applies nothing.
  await assert.rejects(r.multi().incr("io:tx").call("NOSUCH").exec(), /EXECABORT|unknown command/);
  assert.strictEqual(await r.get("io:tx"), "5");
  r.disconnect();
  console.log("ioredis ok");
})().catch((e) => { console.error(e); process.exit(1); });
"#;

/// Where ioredis is installed: `TALLY_IOREDIS_DIR` (a directory holding
/// `node_modules/ioredis`, which `.ci/run` fills in a temporary directory), else
/// wherever `node` finds it on its own. `None` (skipped) outside CI when neither has it.
fn ioredis_modules() -> Result<Option<String>> {
    if require_tool("node", "apt-get install nodejs npm")?.is_none() {
        return Ok(None);
    }
    let dir = std::env::var("TALLY_IOREDIS_DIR").map(|d| format!("{d}/node_modules")).unwrap_or_default();
    let found = Command::new("node")
        .args(["-e", "require('ioredis')"])
        .env("NODE_PATH", &dir)
        .output()
        .is_ok_and(|o| o.status.success());
    if found {
        return Ok(Some(dir));
    }
    if in_ci() {
        bail!("ioredis is not installed and CI is set: .ci/run installs it with npm into TALLY_IOREDIS_DIR");
    }
    eprintln!(
        "SKIPPED: ioredis is not installed (npm install --prefix DIR ioredis, then TALLY_IOREDIS_DIR=DIR)"
    );
    Ok(None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ioredis_pipelines_and_multi_count_once() -> Result<()> {
    let Some(modules) = ioredis_modules()? else { return Ok(()) };
    let c = TestCluster::start(1).await?;
    let port = c.node(1).ports.resp.to_string();
    let out = run("node", &["-e", IOREDIS, &port], &[("NODE_PATH", &modules)])?;
    assert!(out.contains("ioredis ok"), "{out}");
    assert_eq!(c.value(1, "io:pipe").await?, 200);
    assert_eq!(c.value(1, "io:tx").await?, 5);
    Ok(())
}

/// Requests of each `redis-benchmark` run.
const BENCHMARK_REQUESTS: usize = 20_000;

/// The requests per second a `redis-benchmark -q` run printed for `INCR`.
fn incr_rate(out: &str) -> Result<f64> {
    // Progress lines end in `\r`; the summary is the last `INCR: N requests per second`.
    let line = out
        .split(['\n', '\r'])
        .rev()
        .find(|l| l.trim_start().starts_with("INCR:") && l.contains("requests per second"))
        .with_context(|| format!("no INCR summary in {out:?}"))?;
    let rate = line.split_whitespace().nth(1).context("no rate")?;
    Ok(rate.parse()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_benchmark_incr_counts_every_request() -> Result<()> {
    if require_tool("redis-benchmark", "apt-get install redis-tools")?.is_none() {
        return Ok(());
    }
    let c = TestCluster::start(1).await?;
    let port = c.node(1).ports.resp.to_string();
    let n = BENCHMARK_REQUESTS.to_string();
    let mut total = 0;
    for pipeline in ["1", "16"] {
        let args = ["-h", "127.0.0.1", "-p", &port, "-t", "incr", "-n", &n, "-c", "20", "-P", pipeline, "-q"];
        let out = run("redis-benchmark", &args, &[])?;
        assert!(!out.contains("Could not fetch server CONFIG"), "{out}");
        assert!(!out.to_lowercase().contains("error"), "{out}");
        eprintln!("redis-benchmark -t incr -n {n} -c 20 -P {pipeline}: {:.0} requests/s", incr_rate(&out)?);
        // redis-benchmark increments one key; every request counts once.
        total += BENCHMARK_REQUESTS as i64;
        assert_eq!(c.value(1, "counter:__rand_int__").await?, total);
    }
    Ok(())
}
