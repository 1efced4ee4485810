//! Redis's glob patterns (`KEYS`, `SCAN ... MATCH`): `*` any run of bytes, `?` one
//! byte, `[abc]`, `[^abc]` and `[a-z]` one byte of (or not of) a set, `\x` the byte
//! `x` itself. Matched on bytes, as Redis's `stringmatchlen` does. Pure.

/// Whether `name` matches `pattern`. In time proportional to the pattern's length
/// times the name's, whatever the pattern: a mismatch after a `*` resumes from the
/// last `*` only (any earlier one could only have matched a shorter run, which the
/// last one covers), so no pattern of many stars takes exponential time.
pub fn matches(pattern: &[u8], name: &[u8]) -> bool {
    let (mut p, mut s) = (0usize, 0usize);
    // The pattern position after the last `*`, and the name position it resumes at.
    let mut star: Option<(usize, usize)> = None;
    while s < name.len() {
        let step = match pattern.get(p) {
            Some(b'*') => {
                star = Some((p + 1, s));
                p += 1;
                continue;
            }
            Some(b'?') => Some(p + 1),
            Some(b'[') => {
                let (hit, after) = class(&pattern[p + 1..], name[s]);
                hit.then(|| pattern.len() - after.len())
            }
            Some(b'\\') if p + 1 < pattern.len() => (pattern[p + 1] == name[s]).then_some(p + 2),
            Some(&c) => (c == name[s]).then_some(p + 1),
            None => None,
        };
        match (step, star) {
            (Some(next), _) => {
                p = next;
                s += 1;
            }
            (None, Some((after_star, from))) => {
                // Let the last star take one more byte, and try again after it.
                p = after_star;
                s = from + 1;
                star = Some((after_star, from + 1));
            }
            (None, None) => return false,
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

/// Whether byte `b` is in the class that starts at `p` (just after its `[`), and the
/// pattern after the class's `]` (an unclosed class runs to the end, as in Redis).
fn class(mut p: &[u8], b: u8) -> (bool, &[u8]) {
    let not = p.first() == Some(&b'^');
    if not {
        p = &p[1..];
    }
    let mut hit = false;
    loop {
        match p {
            [] => break,
            [b']', rest @ ..] => {
                p = rest;
                break;
            }
            [b'\\', x, rest @ ..] => {
                hit |= *x == b;
                p = rest;
            }
            [lo, b'-', hi, rest @ ..] if *hi != b']' => {
                let (lo, hi) = if lo <= hi { (*lo, *hi) } else { (*hi, *lo) };
                hit |= (lo..=hi).contains(&b);
                p = rest;
            }
            [x, rest @ ..] => {
                hit |= *x == b;
                p = rest;
            }
        }
    }
    (hit != not, p)
}

/// The literal bytes every name that matches `pattern` starts with: the pattern up
/// to its first special character. A listing needs to look only under it.
pub fn literal_prefix(pattern: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut p = pattern;
    while let Some(&c) = p.first() {
        match c {
            b'*' | b'?' | b'[' => break,
            b'\\' if p.len() >= 2 => {
                out.push(p[1]);
                p = &p[2..];
            }
            b'\\' => break,
            _ => {
                out.push(c);
                p = &p[1..];
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(p: &str, s: &str) -> bool {
        matches(p.as_bytes(), s.as_bytes())
    }

    #[test]
    fn globs_match_as_redis_does() {
        assert!(m("*", "") && m("*", "likes:1"));
        assert!(m("likes:*", "likes:1") && !m("likes:*", "views:1"));
        assert!(m("h?llo", "hello") && m("h?llo", "hallo") && !m("h?llo", "hllo"));
        assert!(m("h[ae]llo", "hello") && !m("h[ae]llo", "hillo"));
        assert!(m("h[^e]llo", "hallo") && !m("h[^e]llo", "hello"));
        assert!(m("h[a-b]llo", "hbllo") && !m("h[a-b]llo", "hcllo") && m("h[b-a]llo", "hallo"));
        assert!(m(r"a\*b", "a*b") && !m(r"a\*b", "axb"));
        assert!(m("*:*:9", "a:b:9") && !m("*:*:9", "a:b:8"));
        assert!(!m("a[", "a") && m("a[b", "ab"), "an unclosed class runs to the end");
        assert!(m("**a**", "xxa"));
        // No blow-up on a pathological pattern.
        let many = "*a".repeat(40);
        assert!(!m(&many, &"a".repeat(30)));
        assert!(m(&many, &"a".repeat(40)));
    }

    #[test]
    fn the_literal_prefix_is_what_comes_before_the_first_special() {
        assert_eq!(literal_prefix(b"likes:*"), b"likes:");
        assert_eq!(literal_prefix(br"a\*b*"), b"a*b");
        assert_eq!(literal_prefix(b"*"), b"");
        assert_eq!(literal_prefix(b"exact"), b"exact");
        assert_eq!(literal_prefix(b"h[ae]llo"), b"h");
    }
}
