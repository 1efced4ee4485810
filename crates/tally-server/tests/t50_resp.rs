//! t50: the RESP front end over a node on the in-memory store, through a real
//! socket: a pipeline sent in one write is answered in order in one read (an
//! increment run before a read is seen by it), `HELLO 3` switches the encoding of
//! every later reply, `QUIT` answers and closes, and input over the limits is
//! refused as soon as its header arrives; `MULTI` queues and `EXEC` runs as Redis
//! does (a command refused while queued discards the whole transaction).

mod common;

use std::sync::Arc;
use std::time::Duration;
use tally_auth::{Scope, TokenConfig, TokenHash, Tokens};
use tally_server::auth::Gate;
use tally_server::resp;
use tally_server::{HttpConfig, RespConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long one exchange may take.
const EXCHANGE_TIMEOUT_MS: u64 = 5_000;

fn cmd(args: &[&str]) -> String {
    let mut s = format!("*{}\r\n", args.len());
    for a in args {
        s += &format!("${}\r\n{a}\r\n", a.len());
    }
    s
}

/// Starts the RESP front end on a free port, open to everyone; the sender stops it.
async fn start(limits: RespConfig) -> (u16, tokio::sync::oneshot::Sender<()>) {
    start_gated(limits, Gate::open()).await
}

/// Starts the RESP front end on a free port behind `gate`.
async fn start_gated(limits: RespConfig, gate: Gate) -> (u16, tokio::sync::oneshot::Sender<()>) {
    let node = common::mem_node(&HttpConfig::default()).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let stop = async move {
            let _ = rx.await;
        };
        let (timeout, grace) = (Duration::from_secs(5), Duration::from_secs(5));
        let _ = resp::serve(listener, node, &limits, timeout, grace, Arc::new(gate), stop).await;
    });
    (port, tx)
}

/// Writes `input` at once and reads until `expect` bytes came or the node closed.
async fn exchange(s: &mut TcpStream, input: &str, expect: usize) -> String {
    s.write_all(input.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let read = async {
        while got.len() < expect {
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
            }
        }
    };
    tokio::time::timeout(Duration::from_millis(EXCHANGE_TIMEOUT_MS), read).await.expect("answered in time");
    String::from_utf8(got).expect("ascii")
}

#[tokio::test]
async fn a_pipeline_is_answered_in_order_and_reads_see_earlier_increments() {
    let (port, _stop) = start(RespConfig::default()).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let mut input = cmd(&["TALLY.CREATE", "p", "DURABILITY", "sync", "SHARDS", "4"]);
    for _ in 0..10 {
        input += &cmd(&["INCRBY", "p", "5"]);
    }
    input += &cmd(&["GET", "p"]);
    input += &cmd(&["TALLY.INCRBY", "p", "1", "ID", "e1"]);
    input += &cmd(&["TALLY.INCRBY", "p", "1", "ID", "e1"]);
    input += &cmd(&["GET", "nope"]);
    input += &cmd(&["NOPE"]);
    input += "PING\r\n";
    let expected_tail = "$2\r\n50\r\n+applied\r\n+duplicate\r\n$-1\r\n-ERR unknown command 'NOPE', with args beginning with: \r\n+PONG\r\n";
    let answer = exchange(&mut s, &input, 1).await;
    let mut answer = answer;
    while !answer.ends_with("+PONG\r\n") {
        answer += &exchange(&mut s, "", 1).await;
    }
    let lines: Vec<&str> = answer.split("\r\n").collect();
    assert_eq!(lines[0], "+created");
    // Ten concurrent sync increments, answered in the order sent: each total
    // includes itself and every increment before it.
    let totals: Vec<i64> = lines[1..11].iter().map(|l| l[1..].parse().expect("an integer")).collect();
    assert_eq!(totals, (1..=10).map(|i| 5 * i).collect::<Vec<i64>>());
    assert!(answer.ends_with(expected_tail), "{answer:?}");
}

#[tokio::test]
async fn hello_3_switches_replies_to_resp3_and_quit_closes() {
    let (port, _stop) = start(RespConfig::default()).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let two = exchange(&mut s, &cmd(&["TALLY.GET", "nope"]), 1).await;
    assert!(two.starts_with("-ERR counter_not_found"), "{two:?}");
    let hello = exchange(&mut s, &cmd(&["HELLO", "3", "SETNAME", "t50"]), 1).await;
    assert!(hello.starts_with("%7\r\n$6\r\nserver\r\n$5\r\ntally\r\n"), "{hello:?}");
    assert!(hello.contains("$5\r\nproto\r\n:3\r\n"), "{hello:?}");
    assert_eq!(exchange(&mut s, &cmd(&["CLIENT", "GETNAME"]), 1).await, "$3\r\nt50\r\n");
    assert_eq!(exchange(&mut s, &cmd(&["GET", "nope"]), 1).await, "_\r\n", "RESP3 null");
    let no = exchange(&mut s, &cmd(&["HELLO", "4"]), 1).await;
    assert!(no.starts_with("-NOPROTO"), "{no:?}");
    let quit = exchange(&mut s, &cmd(&["QUIT"]), 1).await;
    assert_eq!(quit, "+OK\r\n");
    let after = exchange(&mut s, "", 1).await;
    assert_eq!(after, "", "closed after QUIT");
}

#[tokio::test]
async fn over_limit_headers_are_refused_at_once_and_close_the_connection() {
    let limits = RespConfig { request_bytes_max: 4096, args_max: 4, ..RespConfig::default() };
    let (port, _stop) = start(limits).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let answer = exchange(&mut s, "*2\r\n$4\r\nECHO\r\n$4097\r\n", 1 << 20).await;
    assert!(answer.starts_with("-ERR request_too_large"), "{answer:?}");
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let answer = exchange(&mut s, "*5\r\n", 1 << 20).await;
    assert!(answer.starts_with("-ERR request_too_large") && answer.contains("resp.args_max"), "{answer:?}");
    // A command at the limits is served.
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let body = "x".repeat(4000);
    let answer = exchange(&mut s, &cmd(&["ECHO", &body]), 4000).await;
    assert_eq!(answer, format!("$4000\r\n{body}\r\n"));
}

#[tokio::test]
async fn a_node_with_tokens_wants_auth_and_holds_each_token_to_its_scopes_and_prefixes() {
    let token = |name: &str, scopes: &[Scope], prefixes: &[&str]| TokenConfig {
        name: name.into(),
        hash: TokenHash::of(&format!("secret-{name}")).to_config(),
        scopes: scopes.to_vec(),
        prefixes: prefixes.iter().map(|p| p.to_string()).collect(),
    };
    let tokens = Tokens::from_config(&[
        token("likes", &[Scope::Read, Scope::Write], &["likes:"]),
        token("root", &[Scope::Admin, Scope::Read, Scope::Write], &[]),
    ])
    .unwrap();
    let (port, _stop) = start_gated(RespConfig::default(), Gate::new(tokens)).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let mut input = cmd(&["INCR", "likes:1"]);
    input += &cmd(&["AUTH", "not-a-token"]);
    input += &cmd(&["AUTH", "secret-likes"]);
    input += &cmd(&["INCR", "likes:1"]);
    input += &cmd(&["INCR", "credits:1"]);
    input += &cmd(&["DEL", "likes:1"]);
    input += &cmd(&["GET", "likes:1"]);
    let mut answer = String::new();
    while answer.matches("\r\n").count() < 7 {
        answer += &exchange(&mut s, if answer.is_empty() { &input } else { "" }, 1).await;
    }
    let lines: Vec<&str> = answer.split("\r\n").collect();
    assert_eq!(lines[0], "-NOAUTH Authentication required.", "{answer:?}");
    assert!(lines[1].starts_with("-WRONGPASS"), "{answer:?}");
    assert_eq!(lines[2], "+OK");
    assert_eq!(lines[3], ":1", "{answer:?}");
    assert!(lines[4].starts_with("-NOPERM"), "another prefix: {answer:?}");
    assert!(lines[5].starts_with("-NOPERM"), "deleting needs admin: {answer:?}");

    // The admin token may delete, in a new connection that authenticates in HELLO.
    let mut root = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let input = cmd(&["HELLO", "2", "AUTH", "default", "secret-root"]) + &cmd(&["DEL", "likes:1"]);
    let mut answer = String::new();
    while !answer.ends_with(":1\r\n") {
        let got = exchange(&mut root, if answer.is_empty() { &input } else { "" }, 1).await;
        assert!(!got.is_empty(), "{answer:?}");
        answer += &got;
    }
}

#[tokio::test]
async fn frequencies_answer_cms_query_and_topk_list_in_redisbloom_shape() {
    let (port, _stop) = start(RespConfig::default()).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let mut input =
        cmd(&["TALLY.CREATE", "f", "SHARDS", "4", "DURABILITY", "sync", "FREQUENCY", "0.01", "0.01"]);
    for (item, weight) in [("a", "5"), ("b", "3"), ("a", "2"), ("c", "1")] {
        input += &cmd(&["TALLY.INCRBY", "f", weight, "ITEM", item]);
    }
    input += &cmd(&["CMS.QUERY", "f", "a", "b", "never"]);
    input += &cmd(&["TOPK.LIST", "f", "WITHCOUNT", "K", "2"]);
    input += &cmd(&["TOPK.LIST", "f"]);
    input += &cmd(&["CMS.QUERY", "nope", "a"]);
    let mut answer = String::new();
    while !answer.contains("counter_not_found") {
        let got = exchange(&mut s, if answer.is_empty() { &input } else { "" }, 1).await;
        assert!(!got.is_empty(), "{answer:?}");
        answer += &got;
    }
    let expected = "+created\r\n+applied\r\n+applied\r\n+applied\r\n+applied\r\n\
                    *3\r\n:7\r\n:3\r\n:0\r\n\
                    *4\r\n$1\r\na\r\n:7\r\n$1\r\nb\r\n:3\r\n\
                    *3\r\n$1\r\na\r\n$1\r\nb\r\n$1\r\nc\r\n-ERR counter_not_found";
    assert!(answer.starts_with(expected), "{answer:?}");
}

/// Reads from `s` until the answer ends with `tail`.
async fn until(s: &mut TcpStream, input: &str, tail: &str) -> String {
    let mut answer = exchange(s, input, 1).await;
    while !answer.ends_with(tail) {
        let more = exchange(s, "", 1).await;
        assert!(!more.is_empty(), "closed before {tail:?}: {answer:?}");
        answer += &more;
    }
    answer
}

#[tokio::test]
async fn multi_queues_exec_runs_and_a_refused_command_discards_the_transaction() {
    let (port, _stop) = start(RespConfig::default()).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    // Queued, then run in order: one reply each, in an array.
    let mut input = cmd(&["MULTI"]);
    input += &cmd(&["INCR", "tx"]);
    input += &cmd(&["INCRBY", "tx", "10"]);
    input += &cmd(&["GET", "tx"]);
    input += &cmd(&["INCRBY", "tx", "abc"]);
    input += &cmd(&["DECR", "tx"]);
    input += &cmd(&["EXEC"]);
    let answer = until(&mut s, &input, "\r\n:10\r\n").await;
    assert_eq!(
        answer,
        "+OK\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n\
         *5\r\n:1\r\n:11\r\n$2\r\n11\r\n-ERR value is not an integer or out of range\r\n:10\r\n",
        "a value Redis finds bad only when it runs answers in its place"
    );
    // A command refused while queueing discards everything queued.
    let mut input = cmd(&["MULTI"]);
    input += &cmd(&["INCR", "tx"]);
    input += &cmd(&["NOSUCH", "x"]);
    input += &cmd(&["INCR"]);
    input += &cmd(&["EXEC"]);
    input += &cmd(&["GET", "tx"]);
    let answer = until(&mut s, &input, "$2\r\n10\r\n").await;
    assert_eq!(
        answer,
        "+OK\r\n+QUEUED\r\n-ERR unknown command 'NOSUCH', with args beginning with: 'x' \r\n\
         -ERR wrong number of arguments for 'incr' command\r\n\
         -EXECABORT Transaction discarded because of previous errors.\r\n$2\r\n10\r\n",
        "nothing of the transaction was applied"
    );
    // DISCARD, and what is refused outside or inside a transaction.
    let mut input = cmd(&["MULTI"]);
    input += &cmd(&["INCR", "tx"]);
    input += &cmd(&["MULTI"]);
    input += &cmd(&["WATCH", "tx"]);
    input += &cmd(&["DISCARD"]);
    input += &cmd(&["EXEC"]);
    input += &cmd(&["DISCARD"]);
    input += &cmd(&["WATCH", "tx"]);
    input += &cmd(&["UNWATCH"]);
    input += &cmd(&["GET", "tx"]);
    let answer = until(&mut s, &input, "$2\r\n10\r\n").await;
    let lines: Vec<&str> = answer.split("\r\n").collect();
    assert_eq!(
        &lines[..7],
        [
            "+OK",
            "+QUEUED",
            "-ERR MULTI calls can not be nested",
            "-ERR WATCH inside MULTI is not allowed",
            "+OK",
            "-ERR EXEC without MULTI",
            "-ERR DISCARD without MULTI",
        ]
    );
    assert!(lines[7].starts_with("-ERR WATCH is not supported"), "{answer:?}");
    assert_eq!(&lines[8..11], ["+OK", "$2", "10"], "the discarded INCR counted nothing");
    // Concurrent sync increments in a transaction share a commit and answer in order.
    let mut input = cmd(&["TALLY.CREATE", "ids", "SHARDS", "1", "DURABILITY", "sync"]) + &cmd(&["MULTI"]);
    for _ in 0..20 {
        input += &cmd(&["INCR", "ids"]);
    }
    input += &cmd(&["EXEC"]);
    let answer = until(&mut s, &input, ":20\r\n").await;
    let totals: Vec<&str> = answer.split("\r\n").filter(|l| l.starts_with(':')).collect();
    assert_eq!(totals, (1..=20).map(|i| format!(":{i}")).collect::<Vec<_>>());
}

/// The lines of `answer`, for replies that are one line each (or `$n` and its text).
fn lines(answer: &str) -> Vec<&str> {
    answer.split("\r\n").filter(|l| !l.is_empty()).collect()
}

#[tokio::test]
async fn expire_ttl_persist_and_set_answer_as_redis_does() {
    let (port, _stop) = start(RespConfig::default()).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let mut input = String::new();
    for args in [
        &["INCR", "rl"][..],
        &["EXPIRE", "rl", "60"],
        &["TTL", "rl"],
        &["EXPIRE", "rl", "60", "NX"],
        &["EXPIRE", "rl", "30", "GT"],
        &["EXPIRE", "rl", "120", "gt"],
        &["TTL", "rl"],
        &["PERSIST", "rl"],
        &["TTL", "rl"],
        &["PERSIST", "rl"],
        &["TTL", "nope"],
        &["PTTL", "nope"],
        &["EXPIRE", "nope", "10"],
        &["EXPIRE", "rl", "abc"],
        &["EXPIRE", "rl", "10", "NX", "XX"],
        &["EXPIRE", "rl", "10", "GT", "LT"],
        &["EXPIRE", "rl", "10", "FOO"],
        &["EXPIRE", "rl", "9223372036854775807"],
        &["GET", "rl"],
        &["PING"],
    ] {
        input += &cmd(args);
    }
    let answer = until(&mut s, &input, "+PONG\r\n").await;
    assert_eq!(
        lines(&answer),
        [
            ":1",
            ":1",
            ":60",
            ":0",
            ":0",
            ":1",
            ":120",
            ":1",
            ":-1",
            ":0",
            ":-2",
            ":-2",
            ":0",
            "-ERR value is not an integer or out of range",
            "-ERR NX and XX, GT or LT options at the same time are not compatible",
            "-ERR GT and LT options at the same time are not compatible",
            "-ERR Unsupported option FOO",
            "-ERR invalid expire time in 'expire' command",
            "$1",
            "1",
            "+PONG",
        ]
    );
    // Past its deadline: gone for reads, and an INCR starts it anew.
    let answer = until(&mut s, &(cmd(&["PEXPIRE", "rl", "100"]) + &cmd(&["PING"])), "+PONG\r\n").await;
    assert_eq!(lines(&answer), [":1", "+PONG"]);
    tokio::time::sleep(Duration::from_millis(250)).await;
    let mut input = String::new();
    for args in [&["GET", "rl"][..], &["TTL", "rl"], &["EXISTS", "rl"], &["INCR", "rl"], &["TTL", "rl"]] {
        input += &cmd(args);
    }
    let answer = until(&mut s, &input, ":-1\r\n").await;
    assert_eq!(lines(&answer), ["$-1", ":-2", ":0", ":1", ":-1"]);
    // A time already passed deletes at once.
    let answer = until(&mut s, &(cmd(&["EXPIRE", "rl", "-1"]) + &cmd(&["EXISTS", "rl"])), ":0\r\n").await;
    assert_eq!(lines(&answer), [":1", ":0"]);

    // SET and its family: an absolute write, with Redis's options.
    let mut input = String::new();
    for args in [
        &["SET", "s", "10"][..],
        &["INCR", "s"],
        &["SET", "s", "5", "GET"],
        &["GET", "s"],
        &["SET", "s", "7", "NX"],
        &["SET", "new", "3", "XX"],
        &["EXISTS", "new"],
        &["SET", "s", "9", "EX", "100"],
        &["TTL", "s"],
        &["SET", "s", "9", "KEEPTTL"],
        &["TTL", "s"],
        &["SET", "s", "9"],
        &["TTL", "s"],
        &["GETSET", "s", "4"],
        &["GETDEL", "s"],
        &["GET", "s"],
        &["GETDEL", "s"],
        &["SET", "s", "abc"],
        &["SET", "s", "1", "EX", "0"],
        &["SET", "s", "1", "NX", "XX"],
        &["SET", "s", "1", "EX"],
        &["EXISTS", "s"],
        &["PING"],
    ] {
        input += &cmd(args);
    }
    let answer = until(&mut s, &input, "+PONG\r\n").await;
    assert_eq!(
        lines(&answer),
        [
            "+OK",
            ":11",
            "$2",
            "11",
            "$1",
            "5",
            "$-1",
            "$-1",
            ":0",
            "+OK",
            ":100",
            "+OK",
            ":100",
            "+OK",
            ":-1",
            "$1",
            "9",
            "$1",
            "4",
            "$-1",
            "$-1",
            "-ERR value is not an integer or out of range",
            "-ERR invalid expire time in 'set' command",
            "-ERR syntax error: unexpected 'XX'",
            "-ERR syntax error: 'EX' needs a value after it",
            ":0",
            "+PONG",
        ]
    );
    // SET twice to the same total with increments between: each SET is its own
    // correction (never taken for a repeat of the one before).
    let mut input = String::new();
    for args in [
        &["SET", "r", "0"][..],
        &["INCRBY", "r", "5"],
        &["SET", "r", "0"],
        &["INCRBY", "r", "5"],
        &["SET", "r", "0"],
        &["GET", "r"],
        &["SET", "r", "0"],
        &["GET", "r"],
        &["PING"],
    ] {
        input += &cmd(args);
    }
    let answer = until(&mut s, &input, "+PONG\r\n").await;
    assert_eq!(lines(&answer), ["+OK", ":5", "+OK", ":5", "+OK", "$1", "0", "+OK", "$1", "0", "+PONG"]);
}

/// Sends `args` and reads lines until `tail`: the reply lines.
async fn ask(s: &mut TcpStream, args: &[&str], tail: &str) -> Vec<String> {
    lines(&until(s, &cmd(args), tail).await).into_iter().map(str::to_owned).collect()
}

#[tokio::test]
async fn scan_keys_type_dbsize_config_and_clients_answer_as_redis_does() {
    let (port, _stop) = start(RespConfig::default()).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let mut input = String::new();
    for i in 0..25 {
        input += &cmd(&["INCR", &format!("likes:{i:02}")]);
    }
    input += &cmd(&["INCR", "views:1"]);
    input += &cmd(&["PING"]);
    until(&mut s, &input, "+PONG\r\n").await;
    // KEYS answers every match; SCAN pages through them with numeric cursors.
    let keys = ask(&mut s, &["KEYS", "likes:1*"], "likes:19\r\n").await;
    assert_eq!(keys[0], "*10");
    let mut seen = Vec::new();
    let mut cursor = "0".to_string();
    loop {
        let page = until(&mut s, &cmd(&["SCAN", &cursor, "MATCH", "likes:*", "COUNT", "7"]), "\r\n").await;
        let mut parts = lines(&page).into_iter();
        assert_eq!(parts.next(), Some("*2"));
        parts.next();
        cursor = parts.next().expect("a cursor").to_owned();
        assert!(cursor.parse::<u64>().is_ok(), "{cursor}");
        let n: usize = parts.next().expect("a count")[1..].parse().unwrap();
        let mut names: Vec<String> = parts.skip(1).step_by(2).map(str::to_owned).collect();
        while names.len() < n {
            let more = exchange(&mut s, "", 1).await;
            names =
                lines(&(page.clone() + &more)).into_iter().skip(5).step_by(2).map(str::to_owned).collect();
        }
        seen.extend(names);
        if cursor == "0" {
            break;
        }
    }
    assert_eq!(seen, (0..25).map(|i| format!("likes:{i:02}")).collect::<Vec<_>>(), "each once, in order");
    assert_eq!(ask(&mut s, &["SCAN", "12345678"], "\r\n").await, ["-ERR invalid cursor"]);
    assert_eq!(
        ask(&mut s, &["SCAN", "0", "TYPE", "hash", "COUNT", "1000"], "*0\r\n").await,
        ["*2", "$1", "0", "*0"]
    );
    assert_eq!(ask(&mut s, &["TYPE", "views:1"], "\r\n").await, ["+string"]);
    assert_eq!(ask(&mut s, &["TYPE", "nope"], "\r\n").await, ["+none"]);
    assert_eq!(ask(&mut s, &["DBSIZE"], "\r\n").await, [":26"]);
    assert_eq!(ask(&mut s, &["EXISTS", "views:1", "views:1", "nope"], "\r\n").await, [":2"]);
    // CONFIG GET answers what redis-benchmark asks for; CONFIG SET says why not.
    let config =
        until(&mut s, &(cmd(&["CONFIG", "GET", "save"]) + &cmd(&["CONFIG", "GET", "appendonly"])), "no\r\n")
            .await;
    assert_eq!(lines(&config), ["*2", "$4", "save", "$0", "*2", "$10", "appendonly", "$2", "no"]);
    assert!(ask(&mut s, &["CONFIG", "SET", "maxclients", "5"], "\r\n").await[0]
        .starts_with("-ERR CONFIG SET is not supported"));
    // INFO names the Redis version it follows and real figures.
    let info = until(&mut s, &cmd(&["INFO"]), "\r\n\r\n\r\n").await;
    for field in [
        "redis_version:7.2.0",
        "connected_clients:1",
        "db0:keys=26,expires=0",
        "role:master",
        "keyspace_hits:",
    ] {
        assert!(info.contains(field), "{field} missing from {info}");
    }
    // CLIENT ID, INFO, LIST and KILL.
    let id = ask(&mut s, &["CLIENT", "ID"], "\r\n").await[0][1..].to_owned();
    let mut other = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    assert_eq!(ask(&mut other, &["CLIENT", "SETNAME", "victim"], "\r\n").await, ["+OK"]);
    let list = until(&mut s, &cmd(&["CLIENT", "LIST"]), "\n\r\n").await;
    assert!(list.contains(&format!("id={id} ")) && list.contains("name=victim"), "{list}");
    let info = until(&mut s, &cmd(&["CLIENT", "INFO"]), "\n\r\n").await;
    assert!(info.contains(&format!("id={id} ")), "{info}");
    let victim = list.lines().find(|l| l.contains("name=victim")).unwrap();
    let victim_id = victim
        .split(' ')
        .find_map(|f| f.strip_prefix("id="))
        .unwrap()
        .trim_start_matches(|c: char| !c.is_ascii_digit());
    assert_eq!(ask(&mut s, &["CLIENT", "KILL", "ID", victim_id], "\r\n").await, [":1"]);
    assert_eq!(exchange(&mut other, "", 1).await, "", "the killed connection is closed");
    assert_eq!(ask(&mut s, &["CLIENT", "KILL", "127.0.0.1:1"], "\r\n").await, ["-ERR No such client"]);
    assert_eq!(ask(&mut s, &["WAIT", "0", "100"], "\r\n").await, [":0"], "one copy per shard here");
    assert_eq!(
        ask(&mut s, &["FLUSHALL"], "\r\n").await,
        ["-ERR unknown command 'FLUSHALL', with args beginning with: "],
        "anything else is Redis's unknown command, and runs nothing"
    );
    assert_eq!(ask(&mut s, &["DBSIZE"], "\r\n").await, [":26"]);
}

#[tokio::test]
async fn hyperloglogs_count_min_and_top_k_answer_in_their_modules_shapes() {
    let (port, _stop) = start(RespConfig::default()).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let mut input = String::new();
    input += &cmd(&["PFADD", "a", "u1", "u2", "u3"]);
    input += &cmd(&["PFADD", "b", "u3", "u4"]);
    input += &cmd(&["PFCOUNT", "a", "b", "nope"]);
    input += &cmd(&["PFMERGE", "c", "a", "b"]);
    input += &cmd(&["PFCOUNT", "c"]);
    input += &cmd(&["PFMERGE", "c", "a"]);
    input += &cmd(&["PFCOUNT", "c"]);
    input += &cmd(&["PING"]);
    let answer = until(&mut s, &input, "+PONG\r\n").await;
    assert_eq!(lines(&answer), [":1", ":1", ":4", "+OK", ":4", "+OK", ":4", "+PONG"]);
    // Count-min, RedisBloom's commands.
    let mut input = String::new();
    input += &cmd(&["CMS.INITBYDIM", "cms", "2000", "5"]);
    input += &cmd(&["CMS.INITBYDIM", "cms", "2000", "5"]);
    input += &cmd(&["CMS.INCRBY", "cms", "a", "5", "b", "3"]);
    input += &cmd(&["CMS.INCRBY", "cms", "a", "1"]);
    input += &cmd(&["CMS.QUERY", "cms", "a", "b", "c"]);
    input += &cmd(&["CMS.INFO", "cms"]);
    input += &cmd(&["CMS.INITBYPROB", "cms2", "0.001", "0.01"]);
    input += &cmd(&["CMS.INCRBY", "nope", "a", "1"]);
    input += &cmd(&["CMS.INCRBY", "cms", "a", "x"]);
    input += &cmd(&["PING"]);
    let answer = until(&mut s, &input, "+PONG\r\n").await;
    assert_eq!(
        lines(&answer),
        [
            "+OK",
            "-ERR CMS: key already exists",
            "*2",
            ":5",
            ":3",
            "*1",
            ":6",
            "*3",
            ":6",
            ":3",
            ":0",
            "*6",
            "$5",
            "width",
            ":2000",
            "$5",
            "depth",
            ":5",
            "$5",
            "count",
            ":9",
            "+OK",
            "-ERR CMS: key does not exist",
            "-ERR CMS: Cannot parse number",
            "+PONG",
        ]
    );
    // CMS.MERGE replaces the destination with the weighted sum of the sources.
    let mut input = String::new();
    input += &cmd(&["CMS.INITBYDIM", "sum", "2000", "5"]);
    input += &cmd(&["CMS.INCRBY", "sum", "z", "100"]);
    input += &cmd(&["CMS.MERGE", "sum", "1", "cms", "WEIGHTS", "2"]);
    input += &cmd(&["CMS.QUERY", "sum", "a", "b", "z"]);
    input += &cmd(&["CMS.MERGE", "sum", "1", "cms2"]);
    input += &cmd(&["PING"]);
    let answer = until(&mut s, &input, "+PONG\r\n").await;
    let got = lines(&answer);
    assert_eq!(&got[..8], ["+OK", "*1", ":100", "+OK", "*3", ":12", ":6", ":0"], "{got:?}");
    assert!(got[8].starts_with("-ERR"), "another shape does not merge: {got:?}");
    // Top-k, RedisBloom's commands: the list keeps the k it was reserved with.
    let mut input = String::new();
    input += &cmd(&["TOPK.RESERVE", "top", "2"]);
    input += &cmd(&["TOPK.ADD", "top", "x", "y", "x"]);
    input += &cmd(&["TOPK.INCRBY", "top", "z", "5"]);
    input += &cmd(&["TOPK.QUERY", "top", "z", "x", "y"]);
    input += &cmd(&["TOPK.COUNT", "top", "z", "x"]);
    input += &cmd(&["TOPK.LIST", "top"]);
    input += &cmd(&["TOPK.LIST", "top", "WITHCOUNT"]);
    input += &cmd(&["TOPK.INFO", "top"]);
    input += &cmd(&["PING"]);
    let answer = until(&mut s, &input, "+PONG\r\n").await;
    let got = lines(&answer);
    assert_eq!(
        &got[..28],
        [
            "+OK", "*3", "$-1", "$-1", "$-1", "*1", "$-1", "*3", ":1", ":1", ":0", "*2", ":5", ":2", "*2",
            "$1", "z", "$1", "x", "*4", "$1", "z", ":5", "$1", "x", ":2", "*8", "$1"
        ],
        "{got:?}"
    );
    assert!(answer.contains("$1\r\nk\r\n:2\r\n"), "{answer}");
}

#[tokio::test]
async fn increx_answers_as_redis_8_8_states_it() {
    let (port, _stop) = start(RespConfig::default()).await;
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let mut input = String::new();
    for args in [
        // By 1 by default, by BYINT otherwise; the reply is [new value, applied].
        &["INCREX", "a"][..],
        &["INCREX", "a", "BYINT", "5"],
        &["INCREX", "a", "byint", "-10"],
        // Out of bounds: skipped, [current, 0]; SATURATE stops at the bound.
        &["INCREX", "b", "BYINT", "99", "UBOUND", "100"],
        &["INCREX", "b", "BYINT", "5", "UBOUND", "100"],
        &["INCREX", "b", "BYINT", "5", "UBOUND", "100", "SATURATE"],
        &["INCREX", "b", "LBOUND", "-1", "BYINT", "-200", "UBOUND", "100"],
        // A skip on a missing key creates nothing.
        &["INCREX", "c", "BYINT", "7", "UBOUND", "5"],
        &["EXISTS", "c"],
        // The fixed-window limiter: the deadline set once per window with ENX.
        &["INCREX", "rl", "BYINT", "1", "UBOUND", "2", "EX", "60", "ENX"],
        &["TTL", "rl"],
        &["INCREX", "rl", "BYINT", "1", "UBOUND", "2", "EX", "10", "ENX"],
        &["TTL", "rl"],
        &["INCREX", "rl", "BYINT", "1", "UBOUND", "2", "EX", "10"],
        &["TTL", "rl"],
        // The counter keeps the bound it was created with: held to both.
        &["INCREX", "rl", "UBOUND", "3"],
        &["INCREX", "p", "PXAT", "4102444800000"],
        &["PEXPIRETIME", "p"],
        &["INCREX", "p", "PERSIST"],
        &["TTL", "p"],
        // Refused whole: nothing counted.
        &["INCREX", "d", "BYFLOAT", "0.5"],
        &["INCREX", "d", "ENX"],
        &["INCREX", "d", "EX", "10", "PERSIST"],
        &["INCREX", "d", "PERSIST", "ENX"],
        &["INCREX", "d", "LBOUND"],
        &["INCREX", "d", "LBOUND", "5", "UBOUND", "4"],
        &["INCREX", "d", "BYINT", "x"],
        &["INCREX", "d", "EX", "0"],
        &["INCREX", "d", "BYINT", "1", "BYINT", "2"],
        &["INCREX", "d", "FOO"],
        &["INCREX"],
        &["EXISTS", "d"],
        &["PING"],
    ] {
        input += &cmd(args);
    }
    let answer = until(&mut s, &input, "+PONG\r\n").await;
    assert_eq!(
        lines(&answer),
        [
            "*2",
            ":1",
            ":1",
            "*2",
            ":6",
            ":5",
            "*2",
            ":-4",
            ":-10",
            "*2",
            ":99",
            ":99",
            "*2",
            ":99",
            ":0",
            "*2",
            ":100",
            ":1",
            "*2",
            ":100",
            ":0",
            "*2",
            ":0",
            ":0",
            ":0",
            "*2",
            ":1",
            ":1",
            ":60",
            "*2",
            ":2",
            ":1",
            ":60",
            "*2",
            ":2",
            ":0",
            ":60",
            "*2",
            ":2",
            ":0",
            "*2",
            ":1",
            ":1",
            ":4102444800000",
            "*2",
            ":2",
            ":1",
            ":-1",
            "-ERR BYFLOAT is not supported: Tally counters hold integers; use BYINT",
            "-ERR ENX flag requires an expiration",
            "-ERR syntax error",
            "-ERR syntax error",
            "-ERR syntax error",
            "-ERR LBOUND 5 is above UBOUND 4",
            "-ERR value is not an integer or out of range",
            "-ERR invalid expire time in 'increx' command",
            "-ERR syntax error",
            "-ERR syntax error",
            "-ERR wrong number of arguments for 'increx' command",
            ":0",
            "+PONG",
        ]
    );
}
