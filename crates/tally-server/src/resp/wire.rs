//! The wire: requests out of the read buffer, replies into the write buffer.
//!
//! Clients send every command as an array of bulk strings, whatever protocol they
//! asked replies in, or in Redis's inline form (`PING\r\n`, as typed into `nc`).
//! [`next_request_spans`] walks an array's length headers as they arrive and
//! refuses, at once, an array longer than `resp.args_max` or a bulk string longer
//! than `resp.request_bytes_max` — a client announcing a 1 GB bulk gets its error
//! without the node buffering a byte of it. It finds where each argument lies in
//! one pass and copies nothing; it accepts exactly what `redis-protocol`'s RESP2
//! decoder accepts for such arrays, which the tests check it against.
//!
//! Replies are built as [`Reply`] values and encoded by the same crate as RESP2 or
//! RESP3 frames: a map is a RESP3 map or, in RESP2, a flat array of keys and values;
//! a null is `_` or `$-1`; a boolean is `#t`/`#f` or the integer 1/0.

use redis_protocol::resp2::types::{OwnedFrame as Frame2, Resp2Frame};
use redis_protocol::resp3::types::{FrameMap, OwnedFrame as Frame3, Resp3Frame};

/// Longest inline command line, in bytes (Redis's `PROTO_INLINE_MAX_SIZE`).
pub const INLINE_BYTES_MAX: usize = 64 * 1024;
/// Longest length header (`*N\r\n`, `$N\r\n`) accepted, in bytes: a 20-digit
/// number, its sign, the type byte and CRLF fit.
pub const HEADER_BYTES_MAX: usize = 24;
/// Longest piece of a client's input quoted back in an error, in bytes.
pub const QUOTE_BYTES_MAX: usize = 128;

/// The limits a request is decoded under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireLimits {
    /// Largest request (and so largest bulk string), in bytes.
    pub request_bytes_max: usize,
    /// Most elements in a request's array.
    pub args_max: usize,
    /// Largest single argument (bulk string), in bytes: no argument of any command
    /// needs more than a few kilobytes, and a client announcing a bigger one (a
    /// megabyte `CLIENT SETNAME`) is refused before its bytes arrive.
    pub arg_bytes_max: usize,
}

/// A request the decoder cannot make sense of, or one over a limit. The connection
/// is answered this error and closed: the rest of its input cannot be framed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code} Protocol error: {message}")]
pub struct ProtocolError {
    /// The stable code (`protocol_error` or `request_too_large`).
    pub code: &'static str,
    /// What was wrong.
    pub message: String,
}

/// The code of malformed input.
pub const PROTOCOL_ERROR: &str = "protocol_error";
/// The code of input over `resp.request_bytes_max` or `resp.args_max`.
pub const REQUEST_TOO_LARGE: &str = "request_too_large";

fn malformed(message: impl Into<String>) -> ProtocolError {
    ProtocolError { code: PROTOCOL_ERROR, message: message.into() }
}

fn too_large(message: impl Into<String>) -> ProtocolError {
    ProtocolError { code: REQUEST_TOO_LARGE, message: message.into() }
}

/// Up to [`QUOTE_BYTES_MAX`] bytes of client input, printable.
pub fn quote(bytes: &[u8]) -> String {
    let cut = &bytes[..bytes.len().min(QUOTE_BYTES_MAX)];
    String::from_utf8_lossy(cut).chars().map(|c| if c.is_control() { '?' } else { c }).collect()
}

/// A decimal integer as `str::parse::<i64>` reads one (an optional sign, then at
/// least one digit, no overflow), straight from bytes.
fn parse_i64(text: &[u8]) -> Option<i64> {
    let (negative, digits) = match text {
        [b'-', rest @ ..] => (true, rest),
        [b'+', rest @ ..] => (false, rest),
        _ => (false, text),
    };
    if digits.is_empty() {
        return None;
    }
    let mut n: i64 = 0;
    for &b in digits {
        let d = i64::from(b.wrapping_sub(b'0'));
        if d > 9 {
            return None;
        }
        n = n.checked_mul(10)?;
        n = if negative { n.checked_sub(d)? } else { n.checked_add(d)? };
    }
    Some(n)
}

/// Reads a length header line starting at `at` (just after its type byte):
/// `Ok(None)` if its CRLF has not arrived, else the number and where it ends.
fn header(buf: &[u8], at: usize, what: &str) -> Result<Option<(i64, usize)>, ProtocolError> {
    let window = &buf[at..buf.len().min(at + HEADER_BYTES_MAX)];
    let Some(cr) = window.iter().position(|&b| b == b'\r') else {
        if window.len() >= HEADER_BYTES_MAX {
            return Err(malformed(format!("invalid {what} length")));
        }
        return Ok(None);
    };
    let digits = &window[..cr];
    let n =
        parse_i64(digits).ok_or_else(|| malformed(format!("invalid {what} length '{}'", quote(digits))))?;
    // The LF may lie just past the window (a header of exactly HEADER_BYTES_MAX bytes
    // before its LF): look it up in the buffer, or the header would read as
    // incomplete and its count escape the limits.
    match buf.get(at + cr + 1) {
        None => Ok(None),
        Some(b'\n') => Ok(Some((n, at + cr + 2))),
        Some(_) => Err(malformed(format!("invalid {what} length"))),
    }
}

/// Where one argument lies in the buffer a request was read from.
pub type Span = std::ops::Range<usize>;

/// Takes the next complete request off the front of `buf`, appending where each of
/// its arguments lies in `buf` to `spans` (nothing for a blank line, an empty array
/// or a null one): `Ok(None)` if more bytes are needed (and `spans` is left as it
/// was), else how many bytes the request took.
///
/// An array request is walked header by header as its bytes arrive, and a count or
/// length over the limits is refused as soon as its header is read, before any of
/// its body is buffered. The walk accepts what `redis-protocol`'s RESP2 decoder
/// accepts for an array of bulk strings (the tests hold it to that decoder); it
/// takes the request in one pass, without building frames.
pub fn next_request_spans(
    buf: &[u8],
    limits: &WireLimits,
    spans: &mut Vec<Span>,
) -> Result<Option<usize>, ProtocolError> {
    let Some(&first) = buf.first() else { return Ok(None) };
    if first != b'*' {
        return inline(buf, spans);
    }
    let before = spans.len();
    let walked = walk_array(buf, limits, spans);
    if !matches!(walked, Ok(Some(_))) {
        spans.truncate(before);
    }
    if walked == Ok(None) && buf.len() > limits.request_bytes_max {
        return Err(too_large(format!(
            "a request of more than {} bytes (resp.request_bytes_max)",
            limits.request_bytes_max
        )));
    }
    walked
}

/// The walk of [`next_request_spans`] over an array request; on `Ok(None)` or an
/// error, `spans` may hold part of the request.
fn walk_array(
    buf: &[u8],
    limits: &WireLimits,
    spans: &mut Vec<Span>,
) -> Result<Option<usize>, ProtocolError> {
    let Some((count, mut at)) = header(buf, 1, "multibulk")? else { return Ok(None) };
    if count > 0 && count as u64 > limits.args_max as u64 {
        return Err(too_large(format!(
            "a command of {count} arguments; the limit is {} (resp.args_max)",
            limits.args_max
        )));
    }
    match count {
        -1 => return Ok(Some(at)),
        ..=-2 => return Err(malformed(format!("invalid multibulk length '{count}'"))),
        _ => {}
    }
    for _ in 0..count {
        let Some(&kind) = buf.get(at) else { return Ok(None) };
        if kind != b'$' {
            return Err(malformed(format!("expected '$', got '{}'", quote(&[kind]))));
        }
        let Some((len, body)) = header(buf, at + 1, "bulk")? else { return Ok(None) };
        if len < 0 {
            return Err(malformed("invalid bulk length"));
        }
        if len as u64 > limits.request_bytes_max as u64 {
            return Err(too_large(format!(
                "invalid bulk length: {len} bytes; the limit is {} (resp.request_bytes_max)",
                limits.request_bytes_max
            )));
        }
        if len as u64 > limits.arg_bytes_max as u64 {
            return Err(too_large(format!(
                "an argument of {len} bytes; the limit is {} (resp.arg_bytes_max)",
                limits.arg_bytes_max
            )));
        }
        let end = body + len as usize;
        // Like Redis, the two bytes after a bulk string are skipped, not checked.
        at = end + 2;
        if at > buf.len() {
            return Ok(None);
        }
        spans.push(body..end);
    }
    Ok(Some(at))
}

/// An inline command: one line of words separated by spaces.
fn inline(buf: &[u8], spans: &mut Vec<Span>) -> Result<Option<usize>, ProtocolError> {
    let window = &buf[..buf.len().min(INLINE_BYTES_MAX)];
    let Some(nl) = window.iter().position(|&b| b == b'\n') else {
        if window.len() >= INLINE_BYTES_MAX {
            return Err(too_large(format!("an inline request of more than {INLINE_BYTES_MAX} bytes")));
        }
        return Ok(None);
    };
    let mut at = 0;
    for word in window[..nl].split(|b| b.is_ascii_whitespace()) {
        if !word.is_empty() {
            spans.push(at..at + word.len());
        }
        at += word.len() + 1;
    }
    Ok(Some(nl + 1))
}

/// Which protocol replies are encoded in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    /// RESP2, every connection's start.
    Resp2,
    /// RESP3, after `HELLO 3`.
    Resp3,
}

impl Proto {
    /// The number `HELLO` names it by.
    pub fn number(self) -> i64 {
        match self {
            Proto::Resp2 => 2,
            Proto::Resp3 => 3,
        }
    }
}

/// A reply, independent of the protocol it is encoded in.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// A status (`+OK`).
    Simple(String),
    /// An error: its whole text, code first (`ERR invalid_name ...`).
    Error(String),
    /// An integer.
    Int(i64),
    /// An integer that may not fit 64 bits (totals are 128-bit): an integer when it
    /// fits, else a RESP3 big number or, in RESP2, a bulk string of its digits.
    Big(i128),
    /// A bulk string.
    Bulk(Vec<u8>),
    /// No value.
    Null,
    /// A boolean.
    Bool(bool),
    /// A floating-point number (a bulk string in RESP2, as Redis does).
    Double(f64),
    /// An array.
    Array(Vec<Reply>),
    /// Keys and values, in order.
    Map(Vec<(Reply, Reply)>),
}

impl Reply {
    /// `+OK`.
    pub fn ok() -> Self {
        Reply::Simple("OK".into())
    }

    /// A bulk string of text.
    pub fn text(s: impl Into<String>) -> Self {
        Reply::Bulk(s.into().into_bytes())
    }

    /// A map whose keys are words.
    pub fn map<const N: usize>(pairs: [(&str, Reply); N]) -> Self {
        Reply::Map(pairs.into_iter().map(|(k, v)| (Reply::text(k), v)).collect())
    }

    /// An error with one of the public snake_case codes: `ERR code message`.
    pub fn err(code: &str, message: impl std::fmt::Display) -> Self {
        Reply::Error(format!("ERR {code} {message}"))
    }

    /// Whether this is an error.
    pub fn is_error(&self) -> bool {
        matches!(self, Reply::Error(_))
    }
}

/// Status and error lines cannot carry line breaks.
fn one_line(s: &str) -> String {
    s.replace(['\r', '\n'], " ")
}

fn to_resp2(reply: &Reply) -> Frame2 {
    match reply {
        Reply::Simple(s) => Frame2::SimpleString(one_line(s).into_bytes()),
        Reply::Error(s) => Frame2::Error(one_line(s)),
        Reply::Int(n) => Frame2::Integer(*n),
        Reply::Big(n) => match i64::try_from(*n) {
            Ok(n) => Frame2::Integer(n),
            Err(_) => Frame2::BulkString(n.to_string().into_bytes()),
        },
        Reply::Bulk(b) => Frame2::BulkString(b.clone()),
        Reply::Null => Frame2::Null,
        Reply::Bool(b) => Frame2::Integer(i64::from(*b)),
        Reply::Double(d) => Frame2::BulkString(d.to_string().into_bytes()),
        Reply::Array(items) => Frame2::Array(items.iter().map(to_resp2).collect()),
        Reply::Map(pairs) => {
            Frame2::Array(pairs.iter().flat_map(|(k, v)| [to_resp2(k), to_resp2(v)]).collect())
        }
    }
}

fn to_resp3(reply: &Reply) -> Frame3 {
    match reply {
        Reply::Simple(s) => Frame3::SimpleString { data: one_line(s).into_bytes(), attributes: None },
        Reply::Error(s) => Frame3::SimpleError { data: one_line(s), attributes: None },
        Reply::Int(n) => Frame3::Number { data: *n, attributes: None },
        Reply::Big(n) => match i64::try_from(*n) {
            Ok(n) => Frame3::Number { data: n, attributes: None },
            Err(_) => Frame3::BigNumber { data: n.to_string().into_bytes(), attributes: None },
        },
        Reply::Bulk(b) => Frame3::BlobString { data: b.clone(), attributes: None },
        Reply::Null => Frame3::Null,
        Reply::Bool(b) => Frame3::Boolean { data: *b, attributes: None },
        Reply::Double(d) => Frame3::Double { data: *d, attributes: None },
        Reply::Array(items) => Frame3::Array { data: items.iter().map(to_resp3).collect(), attributes: None },
        Reply::Map(pairs) => {
            let mut data = FrameMap::with_capacity(pairs.len());
            for (k, v) in pairs {
                data.insert(to_resp3(k), to_resp3(v));
            }
            Frame3::Map { data, attributes: None }
        }
    }
}

/// Appends `reply`, encoded in `proto`, to `out`.
pub fn encode(reply: &Reply, proto: Proto, out: &mut Vec<u8>) {
    // An integer is `:n\r\n` in both protocols, and the reply of every increment:
    // written directly, without building a frame and measuring it first.
    let int = match reply {
        Reply::Int(n) => Some(*n),
        Reply::Big(n) => i64::try_from(*n).ok(),
        _ => None,
    };
    if let Some(n) = int {
        out.push(b':');
        out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
        out.extend_from_slice(b"\r\n");
        return;
    }
    let start = out.len();
    let written = match proto {
        Proto::Resp2 => {
            let frame = to_resp2(reply);
            out.resize(start + frame.encode_len(false), 0);
            redis_protocol::resp2::encode::encode(&mut out[start..], &frame, false)
        }
        Proto::Resp3 => {
            let frame = to_resp3(reply);
            out.resize(start + frame.encode_len(false), 0);
            redis_protocol::resp3::encode::complete::encode(&mut out[start..], &frame, false)
        }
    };
    match written {
        Ok(n) => out.truncate(start + n),
        Err(e) => {
            // Every frame built above is encodable; should one not be, the client
            // still gets exactly one reply.
            out.truncate(start);
            tracing::error!(error = %e, "cannot encode a reply");
            out.extend_from_slice(b"-ERR internal cannot encode the reply\r\n");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: WireLimits = WireLimits { request_bytes_max: 1024, args_max: 8, arg_bytes_max: 1024 };

    /// The next request's arguments, copied out, and the bytes it took.
    #[allow(clippy::type_complexity)]
    fn next_request(buf: &[u8], limits: &WireLimits) -> Result<Option<(Vec<Vec<u8>>, usize)>, ProtocolError> {
        let mut spans = Vec::new();
        Ok(next_request_spans(buf, limits, &mut spans)?
            .map(|used| (spans.into_iter().map(|s| buf[s].to_vec()).collect(), used)))
    }

    fn args(buf: &[u8]) -> Vec<Vec<u8>> {
        next_request(buf, &LIMITS).expect("valid").expect("complete").0
    }

    #[test]
    fn arrays_and_inline_commands_decode_and_pipelines_split() {
        let pipeline = b"*2\r\n$4\r\nINCR\r\n$1\r\nk\r\n*1\r\n$4\r\nPING\r\nPING hi\r\n*1\r\n$3";
        let (first, used) = next_request(pipeline, &LIMITS).expect("valid").expect("complete");
        assert_eq!(first, vec![b"INCR".to_vec(), b"k".to_vec()]);
        let rest = &pipeline[used..];
        let (second, used2) = next_request(rest, &LIMITS).expect("valid").expect("complete");
        assert_eq!(second, vec![b"PING".to_vec()]);
        let rest = &rest[used2..];
        let (third, used3) = next_request(rest, &LIMITS).expect("valid").expect("complete");
        assert_eq!(third, vec![b"PING".to_vec(), b"hi".to_vec()]);
        assert_eq!(next_request(&rest[used3..], &LIMITS), Ok(None), "a partial frame waits");
        assert_eq!(args(b"\r\n"), Vec::<Vec<u8>>::new());
    }

    #[test]
    fn spans_point_into_the_buffer_and_a_partial_request_adds_none() {
        let buf = b"  incrby\tk  -3 \r\n*2\r\n$3\r\nGET\r\n$2\r\nab\r\n*2\r\n$1";
        let mut spans: Vec<Span> = Vec::new();
        spans.push(7..9);
        let used = next_request_spans(buf, &LIMITS, &mut spans).expect("valid").expect("complete");
        let words: Vec<&[u8]> = spans[1..].iter().map(|s| &buf[s.clone()]).collect();
        assert_eq!(words, [b"incrby".as_slice(), b"k", b"-3"], "appended after what was there");
        let rest = &buf[used..];
        let mut spans = Vec::new();
        let used = next_request_spans(rest, &LIMITS, &mut spans).expect("valid").expect("complete");
        let words: Vec<&[u8]> = spans.iter().map(|s| &rest[s.clone()]).collect();
        assert_eq!(words, [b"GET".as_slice(), b"ab"]);
        let mut spans = Vec::new();
        assert_eq!(next_request_spans(&rest[used..], &LIMITS, &mut spans), Ok(None));
        assert!(spans.is_empty());
    }

    #[test]
    fn oversized_headers_are_refused_before_their_bytes_arrive() {
        let e = next_request(b"*1\r\n$1000000000\r\n", &LIMITS).expect_err("too large");
        assert_eq!(e.code, REQUEST_TOO_LARGE);
        assert!(e.message.contains("1000000000"), "{e}");
        let e = next_request(b"*9\r\n", &LIMITS).expect_err("too many arguments");
        assert_eq!(e.code, REQUEST_TOO_LARGE);
        // One argument over its own bound, in a request under the request's.
        let small = WireLimits { arg_bytes_max: 8, ..LIMITS };
        let e = next_request(b"*3\r\n$6\r\nCLIENT\r\n$7\r\nSETNAME\r\n$9\r\n", &small).expect_err("too long");
        assert!(e.code == REQUEST_TOO_LARGE && e.message.contains("resp.arg_bytes_max"), "{e}");
        // Exactly at the limits passes.
        assert_eq!(next_request(b"*8\r\n", &LIMITS), Ok(None));
        assert_eq!(next_request(b"*1\r\n$1024\r\n", &LIMITS), Ok(None));
    }

    #[test]
    fn a_count_whose_lf_ends_just_past_the_header_window_is_still_checked() {
        // 23 digits: the CR is the window's last byte, the LF the next one.
        let mut req = format!("*{}9\r\n", "0".repeat(HEADER_BYTES_MAX - 2));
        for _ in 0..9 {
            req += "$1\r\na\r\n";
        }
        let e = next_request(req.as_bytes(), &LIMITS).expect_err("nine arguments, the limit is eight");
        assert_eq!(e.code, REQUEST_TOO_LARGE, "{e}");
    }

    #[test]
    fn garbage_is_a_protocol_error() {
        for bad in [&b"*x\r\n"[..], b"*1\r\n:5\r\n", b"*1\r\n$-5\r\n", b"*99999999999999999999999999\r\n"] {
            let e = next_request(bad, &LIMITS).expect_err("garbage");
            assert_eq!(e.code, PROTOCOL_ERROR, "{bad:?}: {e}");
        }
        let long_inline = vec![b'a'; INLINE_BYTES_MAX];
        assert_eq!(next_request(&long_inline, &LIMITS).expect_err("too long").code, REQUEST_TOO_LARGE);
    }

    #[test]
    fn replies_encode_per_protocol() {
        let enc = |r: &Reply, p| {
            let mut out = Vec::new();
            encode(r, p, &mut out);
            String::from_utf8(out).expect("ascii")
        };
        let map = Reply::map([("value", Reply::Int(3)), ("complete", Reply::Bool(true))]);
        assert_eq!(enc(&map, Proto::Resp2), "*4\r\n$5\r\nvalue\r\n:3\r\n$8\r\ncomplete\r\n:1\r\n");
        assert_eq!(enc(&map, Proto::Resp3), "%2\r\n$5\r\nvalue\r\n:3\r\n$8\r\ncomplete\r\n#t\r\n");
        assert_eq!(enc(&Reply::Null, Proto::Resp2), "$-1\r\n");
        assert_eq!(enc(&Reply::Null, Proto::Resp3), "_\r\n");
        let big = i128::from(i64::MAX) + 1;
        assert_eq!(enc(&Reply::Big(big), Proto::Resp2), "$19\r\n9223372036854775808\r\n");
        assert_eq!(enc(&Reply::Big(big), Proto::Resp3), "(9223372036854775808\r\n");
        assert_eq!(enc(&Reply::Big(-4), Proto::Resp3), ":-4\r\n");
        assert_eq!(enc(&Reply::Error("ERR a\r\nb".into()), Proto::Resp2), "-ERR a  b\r\n");
    }

    #[test]
    fn length_headers_read_as_the_standard_parser_reads_them() {
        for text in [
            "",
            "+",
            "-",
            "0",
            "-0",
            "+0",
            "7",
            "+5",
            "-1",
            "-2",
            "007",
            "1a",
            "a1",
            " 1",
            "1 ",
            "--1",
            "+-1",
            "9223372036854775807",
            "9223372036854775808",
            "-9223372036854775808",
            "-9223372036854775809",
            "99999999999999999999",
            "1.5",
            "\u{661}",
        ] {
            assert_eq!(parse_i64(text.as_bytes()), text.parse::<i64>().ok(), "{text:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_read_as_the_standard_parser_reads_them(bytes in proptest::collection::vec(
            proptest::prop_oneof![proptest::strategy::Just(b'-'), proptest::strategy::Just(b'+'), b'0'..=b'9', proptest::num::u8::ANY],
            0..22,
        )) {
            let standard = std::str::from_utf8(&bytes).ok().and_then(|s| s.parse::<i64>().ok());
            proptest::prop_assert_eq!(parse_i64(&bytes), standard);
        }
    }

    /// What the listener did before it walked requests itself: the limits checked
    /// over the headers that arrived, then `redis-protocol`'s decoder.
    fn crate_decoder(buf: &[u8], limits: &WireLimits) -> Result<Option<(Vec<Span>, usize)>, &'static str> {
        use redis_protocol::resp2::types::RangeFrame;
        let Some((count, mut at)) = header(buf, 1, "multibulk").map_err(|e| e.code)? else { return Ok(None) };
        if count > 0 && count as u64 > limits.args_max as u64 {
            return Err(REQUEST_TOO_LARGE);
        }
        for _ in 0..count.max(0) {
            let Some(&kind) = buf.get(at) else { break };
            if kind != b'$' {
                return Err(PROTOCOL_ERROR);
            }
            let Some((len, body)) = header(buf, at + 1, "bulk").map_err(|e| e.code)? else { break };
            if len < 0 {
                return Err(PROTOCOL_ERROR);
            }
            if len as u64 > limits.request_bytes_max as u64 {
                return Err(REQUEST_TOO_LARGE);
            }
            at = body + len as usize + 2;
            if at > buf.len() {
                break;
            }
        }
        match redis_protocol::resp2::decode::decode_range(buf).map_err(|_| PROTOCOL_ERROR)? {
            None if buf.len() > limits.request_bytes_max => Err(REQUEST_TOO_LARGE),
            None => Ok(None),
            Some((RangeFrame::Null, used)) => Ok(Some((Vec::new(), used))),
            Some((RangeFrame::Array(items), used)) => items
                .into_iter()
                .map(|item| match item {
                    RangeFrame::BulkString((start, end)) => Ok(start..end),
                    _ => Err(PROTOCOL_ERROR),
                })
                .collect::<Result<_, _>>()
                .map(|spans| Some((spans, used))),
            Some(_) => Err(PROTOCOL_ERROR),
        }
    }

    /// Pieces of array requests, well-formed and not: counts, bulk headers, bodies
    /// with their two trailing bytes right or wrong, and stray bytes.
    fn request_bytes() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let count = prop_oneof![
            (0i64..=10).prop_map(|n| format!("*{n}\r\n").into_bytes()),
            prop_oneof![Just(-1i64), Just(-2), Just(9), Just(1 << 40)]
                .prop_map(|n| format!("*{n}\r\n").into_bytes()),
            Just(b"*x\r\n".to_vec()),
            Just(b"*3\r".to_vec()),
        ];
        let bulk = (0usize..12, any::<bool>(), any::<u8>()).prop_map(|(len, crlf, fill)| {
            let mut b = format!("${len}\r\n").into_bytes();
            b.extend(std::iter::repeat_n(fill, len));
            b.extend_from_slice(if crlf { b"\r\n" } else { b"ab" });
            b
        });
        let odd = prop_oneof![
            Just(b"$-1\r\n".to_vec()),
            Just(b"$2000\r\n".to_vec()),
            Just(b":5\r\n".to_vec()),
            Just(b"+OK\r\n".to_vec()),
            Just(b"$1x\r\n".to_vec()),
            proptest::collection::vec(any::<u8>(), 0..4),
        ];
        let piece = prop_oneof![4 => bulk, 2 => count.clone(), 1 => odd];
        (count, proptest::collection::vec(piece, 0..12), any::<proptest::sample::Index>()).prop_map(
            |(head, pieces, cut)| {
                let mut buf = head;
                buf.extend(pieces.concat());
                let keep = cut.index(buf.len() + 1);
                buf.truncate(keep.max(1));
                buf
            },
        )
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4096))]

        /// The listener's walk takes the same requests, with the same arguments and
        /// the same refusals, as the crate's decoder behind the limit check.
        #[test]
        fn the_walk_agrees_with_the_crates_decoder(buf in request_bytes(), small in proptest::bool::ANY) {
            let limits = if small { WireLimits { request_bytes_max: 16, args_max: 3, arg_bytes_max: 16 } } else { LIMITS };
            let mut spans: Vec<Span> = std::iter::once(0..0).collect();
            let walked = next_request_spans(&buf, &limits, &mut spans).map_err(|e| e.code);
            let walked = walked.map(|used| used.map(|used| (spans[1..].to_vec(), used)));
            proptest::prop_assert_eq!(&walked, &crate_decoder(&buf, &limits), "{:?}", String::from_utf8_lossy(&buf));
            if !matches!(walked, Ok(Some(_))) {
                proptest::prop_assert_eq!(spans.len(), 1, "spans untouched");
            }
        }
    }

    #[test]
    fn integers_written_directly_match_the_crates_frames() {
        for n in [0, 1, -1, 42, -1_000_000, i64::MAX, i64::MIN] {
            let mut framed = vec![0; Frame2::Integer(n).encode_len(false)];
            redis_protocol::resp2::encode::encode(&mut framed, &Frame2::Integer(n), false).expect("encodes");
            let mut framed3 = vec![0; Frame3::Number { data: n, attributes: None }.encode_len(false)];
            redis_protocol::resp3::encode::complete::encode(
                &mut framed3,
                &Frame3::Number { data: n, attributes: None },
                false,
            )
            .expect("encodes");
            for (reply, proto, want) in [
                (Reply::Int(n), Proto::Resp2, &framed),
                (Reply::Big(i128::from(n)), Proto::Resp2, &framed),
                (Reply::Int(n), Proto::Resp3, &framed3),
                (Reply::Big(i128::from(n)), Proto::Resp3, &framed3),
            ] {
                let mut out = b"+OK\r\n".to_vec();
                encode(&reply, proto, &mut out);
                assert_eq!(&out[5..], want.as_slice(), "{reply:?} in {proto:?}");
            }
        }
    }
}
