//! `tally`, the command-line client of Tally's HTTP/JSON API (DESIGN.md, "Public
//! interface"), and `tally load`, its load generator.
//!
//! # Layout
//!
//! * [`cli`] — the command line (clap): global `--node`, `--token` (or
//!   `TALLY_TOKEN`), `--json`, `--timeout-ms` and one subcommand per endpoint, plus
//!   `load` and `token new` (a random token and its `[[tokens]]` entry, offline).
//! * [`client`] — the HTTP client and [`CliError`], the one error every command
//!   reports: the server's code and message, or a client-side code such as
//!   `unreachable` or `client_timeout`.
//! * [`wire`] — the JSON shapes of the interface, read leniently.
//! * [`render`] — the friendly text of each answer.
//! * [`load`] — the load generator.
//! * [`ops`] — `tally ls` and `tally top`, the operators' views.
//! * `main.rs` — the `tally` binary: parses the command line and exits with the
//!   library's exit code.
//!
//! # Output
//!
//! Text goes to standard output and errors to standard error as
//! `error: CODE (HTTP STATUS): MESSAGE`. With `--json`, standard output carries
//! exactly one JSON object: the server's answer as it sent it (`delete`, which has
//! no answer body, prints `{"deleted": NAME}`), the load report, or the error in
//! the server's shape `{"error": {"code": ..., "message": ...}}`.
//! The exit code says what kind of failure it was (see [`client::EXIT_API_ERROR`]
//! and its neighbours).

pub mod cli;
pub mod client;
pub mod load;
pub mod ops;
pub mod render;
pub mod wire;

use cli::{Cli, Command, CreateArgs, IncrArgs, LoadArgs, MembershipChange, TokenAction, LOAD_NODES_MAX};
pub use client::CliError;
use client::{codes, parse_node, Client};
use reqwest::Method;
use std::io::Write;
use wire::{
    ClusterView, CounterInfo, DistinctRead, Frequency, FrequencyRead, IncrOutcome, IncrementBody,
    ReconcileReport, ShardsReport, SpecBody, TopRead, ValueRead, WindowRead,
};

/// Where results go, and whether standard output already holds one.
struct Output {
    json: bool,
    printed: bool,
}

impl Output {
    /// Prints `json` (already JSON text) in `--json` mode, else `text`.
    fn show(&mut self, json: &str, text: impl FnOnce() -> String) {
        let out = if self.json { format!("{}\n", json.trim()) } else { text() };
        let mut stdout = std::io::stdout().lock();
        // A closed pipe (`tally ... | head`) is not an error worth reporting.
        let _ = stdout.write_all(out.as_bytes()).and_then(|()| stdout.flush());
        self.printed = true;
    }

    /// Reports an error: JSON on standard output in `--json` mode (unless a result
    /// is already there), a line on standard error otherwise.
    fn error(&self, e: &CliError) {
        if self.json && !self.printed {
            println!("{}", e.to_json());
        } else {
            eprintln!("error: {e}");
        }
    }
}

/// Runs the command line and returns the process exit code.
pub fn main_with(cli: Cli) -> u8 {
    let mut out = Output { json: cli.json, printed: false };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            let e =
                CliError::Load { code: codes::INTERNAL, message: format!("cannot start the runtime: {e}") };
            out.error(&e);
            return e.exit_code();
        }
    };
    match runtime.block_on(run(&cli, &mut out)) {
        Ok(()) => 0,
        Err(e) => {
            out.error(&e);
            e.exit_code()
        }
    }
}

async fn run(cli: &Cli, out: &mut Output) -> Result<(), CliError> {
    let timeout = cli.timeout();
    if let Command::Load(args) = &cli.command {
        return run_load(cli, args, out).await;
    }
    if let Command::Token { action } = &cli.command {
        return token(action, out);
    }
    let client = Client::connect(parse_node(&cli.node_arg())?, timeout, cli.cacert()?.as_ref())?
        .with_token(cli.token_arg().as_deref());
    match &cli.command {
        Command::Create(args) => create(&client, args, out).await,
        Command::Get { name, window: Some(window), .. } => {
            read_window(&client, name, "value", window, out).await
        }
        Command::Distinct { name, window: Some(window) } => {
            read_window(&client, name, "distinct", window, out).await
        }
        Command::Get { name, fresh, window: None } => {
            let mut url = client.counter_url(name, &["value"]);
            url.query_pairs_mut().append_pair("consistency", if *fresh { "fresh" } else { "cached" });
            let answer = client.call::<()>(Method::GET, url, None).await?;
            let v: ValueRead = answer.parse()?;
            out.show(&answer.text, || render::value(name, &v));
            Ok(())
        }
        Command::Info { name } => {
            let answer = client.call::<()>(Method::GET, client.counter_url(name, &[]), None).await?;
            let info: CounterInfo = answer.parse()?;
            out.show(&answer.text, || render::counter("", &info));
            Ok(())
        }
        Command::Delete { name } => {
            client.call::<()>(Method::DELETE, client.counter_url(name, &[]), None).await?;
            let json = serde_json::json!({ "deleted": name }).to_string();
            out.show(&json, || format!("deleted {name}\n"));
            Ok(())
        }
        Command::Incr(args) => incr(&client, args, out).await,
        Command::Distinct { name, window: None } => {
            let answer =
                client.call::<()>(Method::GET, client.counter_url(name, &["distinct"]), None).await?;
            let d: DistinctRead = answer.parse()?;
            out.show(&answer.text, || render::distinct(name, &d));
            Ok(())
        }
        Command::Frequency { name, item } => {
            let mut url = client.counter_url(name, &["frequency"]);
            url.query_pairs_mut().append_pair("item", item);
            let answer = client.call::<()>(Method::GET, url, None).await?;
            let f: FrequencyRead = answer.parse()?;
            out.show(&answer.text, || render::frequency(name, &f));
            Ok(())
        }
        Command::TopItems { name, k } => {
            let mut url = client.counter_url(name, &["top"]);
            url.query_pairs_mut().append_pair("k", &k.to_string());
            let answer = client.call::<()>(Method::GET, url, None).await?;
            let t: TopRead = answer.parse()?;
            out.show(&answer.text, || render::top_items(name, &t));
            Ok(())
        }
        Command::Shards { name } => {
            let answer = client.call::<()>(Method::GET, client.counter_url(name, &["shards"]), None).await?;
            let r: ShardsReport = answer.parse()?;
            out.show(&answer.text, || render::shards(name, &r));
            Ok(())
        }
        Command::Cluster { change } => {
            let answer = match change {
                None => client.call::<()>(Method::GET, client.url(&["v1", "cluster"]), None).await?,
                Some(MembershipChange::Add { id }) => {
                    let url = client.url(&["v1", "cluster", "members", id]);
                    client.call::<()>(Method::PUT, url, None).await?
                }
                Some(MembershipChange::Remove { id }) => {
                    let url = client.url(&["v1", "cluster", "members", id]);
                    client.call::<()>(Method::DELETE, url, None).await?
                }
                Some(MembershipChange::AcceptLoss { id }) => {
                    let url = client.url(&["v1", "cluster", "nodes", id, "accept-loss"]);
                    // An empty JSON body: every POST declares one (a browser guard).
                    client.call(Method::POST, url, Some(&serde_json::json!({}))).await?
                }
            };
            let c: ClusterView = answer.parse()?;
            out.show(&answer.text, || render::cluster(&c));
            Ok(())
        }
        Command::Reconcile { name, authoritative } => {
            // Written by hand: the total may exceed 64 bits, which JSON carries exactly.
            let body = format!("{{\"authoritative\":{authoritative}}}").into_bytes();
            let url = client.counter_url(name, &["reconcile"]);
            let answer = client.send_raw(Method::POST, url, Some(body)).await?;
            let r: ReconcileReport = answer.parse()?;
            out.show(&answer.text, || render::reconcile(name, &r));
            Ok(())
        }
        Command::Ls { prefix, limit } => {
            out.printed = true;
            ops::ls(&client, prefix.as_deref(), *limit, out.json, &mut std::io::stdout()).await
        }
        Command::Top { count, iterations } => {
            out.printed = true;
            ops::top(&client, *count, *iterations, &mut std::io::stdout()).await
        }
        Command::Load(_) | Command::Token { .. } => unreachable!("handled above"),
    }
}

/// `tally token new`: a new random token and the config entry that declares it.
fn token(action: &TokenAction, out: &mut Output) -> Result<(), CliError> {
    let TokenAction::New { name, scopes, prefixes } = action;
    let scopes: Vec<tally_auth::Scope> = scopes.iter().map(|s| s.scope()).collect();
    let token = tally_auth::new_token().map_err(|e| CliError::Load {
        code: codes::INTERNAL,
        message: format!("the operating system's random generator failed: {e}"),
    })?;
    let lines = tally_auth::config_lines(&token, name, &scopes, prefixes)
        .map_err(|e| CliError::Usage { code: codes::INVALID_REQUEST, message: e.to_string() })?;
    let json = serde_json::json!({ "name": name, "token": token, "config": lines }).to_string();
    out.show(&json, || {
        format!(
            "token (shown once: hand it to the client, e.g. as TALLY_TOKEN; it is stored nowhere):\n\
             {token}\n\n# add to the config of every node that should accept it:\n{lines}"
        )
    });
    Ok(())
}

async fn create(client: &Client, args: &CreateArgs, out: &mut Output) -> Result<(), CliError> {
    let distinct = match (args.distinct, args.no_distinct) {
        (true, _) => Some(true),
        (_, true) => Some(false),
        _ => None,
    };
    let spec = SpecBody {
        shards: args.shards.clone(),
        min_shards: args.min_shards,
        max_shards: args.max_shards,
        durability: args.durability.map(|d| d.as_str().to_string()),
        flush_ms: args.flush_ms,
        rollup_ms: args.rollup_ms,
        router: args.router.map(|r| r.as_str().to_string()),
        distinct,
        dedup_window_s: args.dedup_window_s,
        frequency: args.epsilon.zip(args.delta).map(|(epsilon, delta)| Frequency { epsilon, delta }),
        windows: args.windows.as_ref().map(|w| w.iter().filter(|t| !t.is_empty()).cloned().collect()),
        min: args.min,
        max: args.max,
        limit: args.limit.clone(),
        replicas: args.replicas,
    };
    let answer = client.call(Method::PUT, client.counter_url(&args.name, &[]), Some(&spec)).await?;
    let info: CounterInfo = answer.parse()?;
    let verb = if answer.status == 201 { "created" } else { "updated" };
    out.show(&answer.text, || render::counter(verb, &info));
    Ok(())
}

/// `get --window` and `distinct --window`: one of the counter's sliding windows.
async fn read_window(
    client: &Client,
    name: &str,
    what: &str,
    window: &str,
    out: &mut Output,
) -> Result<(), CliError> {
    let mut url = client.counter_url(name, &[what]);
    url.query_pairs_mut().append_pair("window", window);
    let answer = client.call::<()>(Method::GET, url, None).await?;
    let w: WindowRead = answer.parse()?;
    out.show(&answer.text, || render::window(name, &w));
    Ok(())
}

async fn incr(client: &Client, args: &IncrArgs, out: &mut Output) -> Result<(), CliError> {
    let body = IncrementBody {
        delta: args.by,
        event_id: args.event_id.as_deref(),
        writer: args.writer.as_deref(),
        seq: args.seq,
        member: args.member.as_deref(),
        item: args.item.as_deref(),
    };
    let url = client.counter_url(&args.name, &["increments"]);
    let answer = client.call(Method::POST, url, Some(&body)).await?;
    let outcome: IncrOutcome = answer.parse()?;
    out.show(&answer.text, || render::incr(&args.name, args.by, &outcome));
    Ok(())
}

async fn run_load(cli: &Cli, args: &LoadArgs, out: &mut Output) -> Result<(), CliError> {
    let node_args = if args.nodes.is_empty() { vec![cli.node_arg()] } else { args.nodes.clone() };
    if node_args.len() > LOAD_NODES_MAX {
        return Err(CliError::Usage {
            code: codes::INVALID_NODE_URL,
            message: format!("at most {LOAD_NODES_MAX} nodes may be given to --nodes"),
        });
    }
    let nodes = node_args.iter().map(|n| parse_node(n)).collect::<Result<Vec<_>, _>>()?;
    let create =
        (args.create_shards.is_some() || args.durability.is_some() || args.flush_ms.is_some()).then(|| {
            SpecBody {
                shards: args.create_shards.map(crate::wire::Shards::Count),
                durability: args.durability.map(|d| d.as_str().to_string()),
                flush_ms: args.flush_ms,
                ..SpecBody::default()
            }
        });
    let plan = load::LoadPlan {
        counter: args.name.clone(),
        nodes,
        writers: args.writers,
        duration: args.duration,
        batch: args.batch,
        event_ids: args.event_ids,
        sequences: args.seq,
        timeout: cli.timeout(),
        cacert: cli.cacert()?,
        create,
        verify: args.verify,
        progress: !args.no_progress,
        token: cli.token_arg(),
    };
    let report = load::run(&plan).await?;
    let json = serde_json::to_string(&report).unwrap_or_else(|e| {
        let e = CliError::Load { code: codes::INTERNAL, message: format!("cannot encode the report: {e}") };
        e.to_json().to_string()
    });
    out.show(&json, || report.text());
    match report.failure() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
