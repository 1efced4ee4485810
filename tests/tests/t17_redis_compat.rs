//! t17: code written for Redis runs unchanged against a node. Keys are any bytes
//! (spaces, hash tags, `@`, `/`, UTF-8, bytes that are not text, up to the named
//! limit) and reach the same counter as the HTTP API's percent-encoded paths, their
//! bytes kept exactly.

use anyhow::{bail, Context, Result};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tally_core::name::NAME_BYTES_MAX;
use tally_tests::TestCluster;
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
