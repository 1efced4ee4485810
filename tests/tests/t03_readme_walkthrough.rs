//! t03: the README's walk-through, run as written. Every fenced `sh` block between
//! `<!-- walkthrough -->` and `<!-- /walkthrough -->` in README.md is read from the
//! file itself; each command (a line, or lines joined by a trailing `\`) runs in
//! order with `sh -c` against one real `tallyd`, with the README's addresses
//! (`localhost:7070`, `-p 6380`) rewritten to the test node's and `tally` pointed at
//! it (`TALLY_NODE`). Every command must exit 0, and where the README shows what a
//! command answers, the answer must match it:
//!
//! * `→ TEXT`, at the end of the command's line or on a comment line after it
//!   (`#   → TEXT`, continued on further comment lines indented deeper), is the
//!   expected output, up to a ` — ` that starts prose about it. `…` stands for
//!   anything; whitespace is ignored; a leading HTTP status (`409 {…}`) is dropped,
//!   since `curl` prints the body only.
//!   `redis-cli` runs with `--no-raw`, so its answers read as in a terminal
//!   (`(integer) 6`); a command whose expected answer is an `(error)` may exit
//!   non-zero.
//! * Anything else in a comment (`e.g. …`, prose) is not checked.
//!
//! So the walk-through fails this test as soon as one of its commands stops
//! working or answers something other than what the README shows.

use anyhow::{bail, Context, Result};
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;
use tally_tests::{require_tool, tally_cli, TestCluster};

const BEGIN: &str = "<!-- walkthrough -->";
const END: &str = "<!-- /walkthrough -->";
/// Fewer commands than this means the markers or the parser lost most of the
/// walk-through, which must not pass silently.
const STEPS_MIN: usize = 60;
/// Likewise for the commands whose answer the README shows.
const EXPECTATIONS_MIN: usize = 25;

/// One command of the walk-through and what the README says it answers.
#[derive(Debug)]
struct Step {
    /// README.md's line number of the command's first line.
    line: usize,
    command: String,
    expected: Option<String>,
}

/// Where an unquoted `#` starts a comment in `line` (a `#` at the start of a word).
fn comment_start(line: &str) -> Option<usize> {
    let (mut single, mut double, mut prev_space) = (false, false, true);
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && prev_space => return Some(i),
            _ => {}
        }
        prev_space = c.is_whitespace();
    }
    None
}

/// The text after `→` in a comment, if the comment is an expected output.
fn expectation(comment: &str) -> Option<String> {
    let body = comment.trim_start_matches('#').trim_start();
    let expected = body.strip_prefix('→')?;
    // ` — ` ends the expected text: what follows is prose about it.
    let expected = expected.split(" — ").next().unwrap_or_default();
    Some(expected.trim().to_string())
}

/// The walk-through's commands, in order.
fn steps(readme: &str) -> Result<Vec<Step>> {
    let start = readme.find(BEGIN).context("README.md has no walk-through marker")?;
    let end = readme[start..].find(END).context("README.md's walk-through is not closed")? + start;
    let first_line = readme[..start].lines().count();
    let mut steps: Vec<Step> = Vec::new();
    let mut in_sh = false;
    // The last expectation read, which a deeper-indented comment line continues.
    let mut continuing = false;
    let mut pending: Option<(usize, String)> = None;
    for (i, raw) in readme[start..end].lines().enumerate() {
        let line_no = first_line + i + 1;
        let line = raw.trim_end();
        if !in_sh {
            in_sh = line.trim() == "```sh";
            continue;
        }
        if line.trim() == "```" {
            in_sh = false;
            continuing = false;
            continue;
        }
        if let Some((at, mut command)) = pending.take() {
            // A continuation of the command above (the shell joins the lines too).
            let (text, comment) = split_comment(line);
            command.push('\n');
            command += text;
            if command.ends_with('\\') {
                pending = Some((at, command));
            } else {
                let expected = comment.and_then(expectation);
                continuing = expected.is_some();
                steps.push(Step { line: at, command, expected });
            }
            continue;
        }
        let trimmed = line.trim_start();
        if trimmed.is_empty() {
            continuing = false;
            continue;
        }
        if trimmed.starts_with('#') {
            if let Some(e) = expectation(trimmed) {
                let Some(step) = steps.last_mut() else {
                    bail!("README.md:{line_no}: an expectation before any command")
                };
                if step.expected.is_some() {
                    bail!("README.md:{line_no}: a second expectation for the command of line {}", step.line);
                }
                step.expected = Some(e);
                continuing = true;
            } else if continuing && trimmed.trim_start_matches('#').starts_with("    ") {
                let step = steps.last_mut().expect("an expectation was read");
                let e = step.expected.as_mut().expect("an expectation was read");
                e.push(' ');
                e.push_str(trimmed.trim_start_matches('#').trim());
            } else {
                continuing = false;
            }
            continue;
        }
        continuing = false;
        let (text, comment) = split_comment(line);
        if text.ends_with('\\') {
            pending = Some((line_no, text.to_string()));
        } else {
            let expected = comment.and_then(expectation);
            continuing = expected.is_some();
            steps.push(Step { line: line_no, command: text.to_string(), expected });
        }
    }
    if let Some((at, _)) = pending {
        bail!("README.md:{at}: a command continued past the end of its block");
    }
    Ok(steps)
}

/// A command line without its trailing comment, and the comment.
fn split_comment(line: &str) -> (&str, Option<&str>) {
    match comment_start(line) {
        Some(at) => (line[..at].trim_end(), Some(&line[at..])),
        None => (line.trim_end(), None),
    }
}

/// Whether `output` matches `expected`: whitespace ignored, `…` for anything, a
/// leading HTTP status dropped.
fn matches(expected: &str, output: &str) -> bool {
    let squeeze = |s: &str| s.chars().filter(|c| !c.is_whitespace()).collect::<String>();
    let mut expected = expected.trim();
    let digits = expected.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 3 && expected[3..].starts_with(' ') {
        expected = &expected[4..];
    }
    let output = squeeze(output);
    let mut at = 0;
    let parts: Vec<String> = expected.split('…').map(squeeze).collect();
    for (i, part) in parts.iter().enumerate() {
        if part.is_empty() {
            continue;
        }
        let found = if i == 0 {
            output.starts_with(part.as_str()).then_some(0)
        } else {
            output[at..].find(part.as_str()).map(|p| p + at)
        };
        let Some(p) = found else { return false };
        at = p + part.len();
    }
    // Without a trailing `…`, the expectation covers the output to its end.
    parts.last().is_some_and(String::is_empty) || at == output.len()
}

#[test]
fn expectations_are_matched_as_the_module_says() {
    assert!(matches(r#"{"applied":false,"duplicate":true}"#, "{\"applied\":false,\"duplicate\":true}\n"));
    assert!(!matches(r#"{"applied":false,"duplicate":true}"#, r#"{"applied":true}"#));
    assert!(matches(
        r#"{"value":1,"as_of_ms":…,"staleness_ms":…}"#,
        r#"{"value":1,"as_of_ms":17,"staleness_ms":0}"#
    ));
    assert!(!matches(r#"{"value":1,"as_of_ms":…}"#, r#"{"value":12,"as_of_ms":17}"#));
    assert!(matches(
        r#"409 {"error":{"code":"bound_exceeded",…}}"#,
        r#"{"error":{"code":"bound_exceeded","m":1}}"#
    ));
    assert!(matches("(integer) 6", "(integer) 6\n"));
    assert!(!matches("(integer) 6", "(integer) 60\n"));
    assert!(matches(
        "(error) ERR out_of_order_sequence …",
        "(error) ERR out_of_order_sequence: expected 3\n"
    ));
}

#[test]
fn commands_comments_and_expectations_are_told_apart() -> Result<()> {
    let readme = "x\n<!-- walkthrough -->\n```sh\n# a comment\ncurl 'a#b' \\\n  --json '{}'   # → {\"a\":1,\n#      \"b\":2}\nredis-cli PING   # PONG, not checked\n#   → PONG\n```\n```python\nnot run\n```\n<!-- /walkthrough -->\n";
    let s = steps(readme)?;
    assert_eq!(s.len(), 2, "{s:?}");
    assert_eq!(s[0].command, "curl 'a#b' \\\n  --json '{}'");
    assert_eq!(s[0].expected.as_deref(), Some("{\"a\":1, \"b\":2}"));
    assert_eq!(s[1].command, "redis-cli PING");
    assert_eq!(s[1].expected.as_deref(), Some("PONG"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_walkthrough_runs_as_written() -> Result<()> {
    let mut found = Vec::new();
    for (tool, install) in [
        ("curl", "apt-get install curl"),
        ("redis-cli", "apt-get install redis-tools"),
        ("redis-benchmark", "apt-get install redis-tools"),
    ] {
        match require_tool(tool, install)? {
            Some(path) => found.push(path),
            None => return Ok(()),
        }
    }
    let redis_cli = &found[1];
    let readme_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let readme = std::fs::read_to_string(&readme_path).context("reading README.md")?;
    let steps = steps(&readme)?;
    let checked = steps.iter().filter(|s| s.expected.is_some()).count();
    if steps.len() < STEPS_MIN || checked < EXPECTATIONS_MIN {
        bail!(
            "only {} commands, {checked} with an expected answer, in README.md's walk-through \
             (at least {STEPS_MIN} and {EXPECTATIONS_MIN} expected)",
            steps.len()
        );
    }
    eprintln!("README.md's walk-through: {} commands, {checked} with an expected answer", steps.len());

    let tally = tally_cli()?;
    let cluster = TestCluster::start(1).await?;
    let node = cluster.node(1);
    let (http, resp) = (node.ports.http, node.ports.resp);
    // `redis-cli` answers as in a terminal (`(integer) 6`, not `6`), through a
    // wrapper first on the commands' PATH; `tally` is the one built beside this test.
    let wrappers = tempfile::tempdir()?;
    let wrapper = wrappers.path().join("redis-cli");
    std::fs::write(&wrapper, format!("#!/bin/sh\nexec '{}' --no-raw \"$@\"\n", redis_cli.display()))?;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
    let bin_dir = tally.parent().context("the tally binary's directory")?;
    let path = std::env::join_paths(
        [wrappers.path().to_path_buf(), bin_dir.to_path_buf()]
            .into_iter()
            .chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )?;

    for step in &steps {
        let command = step
            .command
            .replace("localhost:7070", &format!("127.0.0.1:{http}"))
            .replace("-p 6380", &format!("-p {resp}"));
        let out = tokio::task::spawn_blocking({
            let (script, path, node_url) = (command, path.clone(), node.url());
            move || {
                Command::new("sh")
                    .arg("-c")
                    .arg(script)
                    .env("PATH", path)
                    .env("TALLY_NODE", node_url)
                    .output()
            }
        })
        .await?
        .with_context(|| format!("running README.md:{}", step.line))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let error_expected = step.expected.as_deref().is_some_and(|e| e.starts_with("(error)"));
        if !out.status.success() && !error_expected {
            bail!(
                "README.md:{}: `{}` exited with {}\nstdout: {stdout}\nstderr: {stderr}\nnode log:\n{}",
                step.line,
                step.command,
                out.status,
                node.log_tail()
            );
        }
        if let Some(expected) = &step.expected {
            if !matches(expected, &stdout) {
                bail!(
                    "README.md:{}: `{}` answered\n  {}\nwhere the README shows\n  {expected}\nstderr: {stderr}",
                    step.line,
                    step.command,
                    stdout.trim()
                );
            }
        }
    }
    Ok(())
}
