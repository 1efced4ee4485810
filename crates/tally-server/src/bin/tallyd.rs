//! `tallyd`: runs one Tally node.
//!
//! ```text
//! tallyd                                   # built-in single node: HTTP 127.0.0.1:7070,
//!                                          # RESP 127.0.0.1:6380, data ./data
//! tallyd --config FILE [--data-dir DIR]    # a node from a configuration file
//! tallyd --config FILE --check             # validate, print the cluster fingerprint, exit
//! tallyd --config FILE --check-config      # print the security checklist, exit
//! ```
//!
//! On SIGTERM or SIGINT the node stops accepting connections, finishes the requests
//! in flight, delivers and flushes every buffered increment, and exits 0. A second
//! signal during that drain exits at once with status 130.
//!
//! A configuration that lists one node runs the embedded engine with its metadata
//! in the node's own store; one that lists several joins (or forms) a cluster:
//! replicated metadata, ring placement of shards, node-to-node calls.

use anyhow::{Context, Result};
use clap::Parser;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use tally_server::auth::Gate;
use tally_server::{resp, router_with_gate, serve, serve_tls, ClusterService, Config, SingleNode};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tracing_subscriber::EnvFilter;

/// Requests, replies and the futures of a pipeline are allocated on one worker and
/// often freed on another: glibc's malloc contends on its arenas' locks there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Exit status after a second shutdown signal cut the drain short (128 + SIGINT).
const FORCED_EXIT_STATUS: i32 = 130;

/// Command-line arguments.
#[derive(Debug, Clone, Parser)]
#[command(name = "tallyd", version, about = "Runs a Tally node: sharded, durable counters over HTTP/JSON.")]
struct Args {
    /// The node's configuration file (TOML). Without it, the built-in single-node
    /// configuration (cluster-config/single.toml) is used.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Overrides `node.data_dir`.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Validates the configuration (the exposure check included), prints a summary
    /// with the cluster fingerprint, and exits.
    #[arg(long)]
    check: bool,
    /// Prints the security checklist of the configuration — what it exposes, what
    /// a node reachable by others must set, each item ok / info / warn / FAIL — and
    /// exits: 1 when the node would refuse to start, 0 otherwise.
    #[arg(long)]
    check_config: bool,
}

fn load(args: &Args) -> Result<Config> {
    let mut config = match &args.config {
        Some(path) => Config::load(path).with_context(|| format!("loading {}", path.display()))?,
        None => Config::single_node().context("loading the built-in single-node configuration")?,
    };
    if let Some(dir) = &args.data_dir {
        config.node.data_dir = dir.clone();
        config.validate().context("applying --data-dir")?;
    }
    Ok(config)
}

/// A running node of either kind.
#[derive(Clone)]
enum Node {
    Single(SingleNode),
    Cluster(ClusterService),
}

impl Node {
    fn begin_shutdown(&self) {
        match self {
            Node::Single(n) => n.begin_shutdown(),
            Node::Cluster(n) => n.begin_shutdown(),
        }
    }

    async fn shutdown(&self) -> Result<(), tally_engine::TallyError> {
        match self {
            Node::Single(n) => n.shutdown().await,
            Node::Cluster(n) => n.shutdown().await,
        }
    }
}

/// Resolves on the first SIGTERM or SIGINT; a second one exits the process at once.
async fn shutdown_signal(mut term: Signal, mut int: Signal, node: Node) {
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(signal = name, "shutting down: draining requests, then flushing");
    node.begin_shutdown();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        tracing::warn!("second signal: exiting without finishing the drain");
        std::process::exit(FORCED_EXIT_STATUS);
    });
}

/// Re-reads the node config on every SIGHUP and puts its `[[tokens]]` in force
/// (nothing else of it: a changed listener, secret or engine setting needs a
/// restart, and a reload that changes them says so). A config that does not load,
/// validate or pass the exposure check (tokens removed from a node listening beyond
/// loopback) is refused whole and the tokens in force stay.
async fn reload_tokens_on_hangup(mut hup: Signal, args: Args, running: Config, gate: Arc<Gate>) {
    while hup.recv().await.is_some() {
        if args.config.is_none() {
            tracing::info!("SIGHUP: the built-in configuration has no tokens to reload");
            continue;
        }
        let loaded = load(&args).and_then(|c| c.check_exposure().map(|()| c).map_err(anyhow::Error::from));
        let config = match loaded {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(
                    target: tally_server::auth::AUDIT_TARGET,
                    event = "tokens_reload",
                    outcome = "refused",
                    "SIGHUP: token reload refused, the tokens in force stay: {e:#}"
                );
                continue;
            }
        };
        let mut rest = config.clone();
        rest.tokens.clone_from(&running.tokens);
        if rest != running {
            tracing::warn!(
                "SIGHUP: the config changed beyond [[tokens]]; only the tokens are reloaded, \
                 the rest takes effect at the next restart"
            );
        }
        match gate.reload(&config) {
            Ok(n) => {
                let names: Vec<&str> = config.tokens.iter().map(|t| t.name.as_str()).collect();
                tracing::info!(
                    target: tally_server::auth::AUDIT_TARGET,
                    event = "tokens_reload",
                    outcome = "ok",
                    tokens = n,
                    names = %names.join(","),
                    generation = gate.generation(),
                    "SIGHUP: reloaded [[tokens]]: {n} in force"
                );
            }
            Err(e) => tracing::error!(
                target: tally_server::auth::AUDIT_TARGET,
                event = "tokens_reload",
                outcome = "refused",
                "SIGHUP: token reload refused, the tokens in force stay: {e}"
            ),
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tallyd: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line with the whole chain of causes; no backtrace noise.
            eprintln!("tallyd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `--check-config`: the checklist of [`Config::checklist`], one item a line.
fn print_checklist(config: &Config) -> Result<()> {
    let me = config.this_node()?;
    println!("security checklist of node {:?} (cluster {:?}):", me.id, config.cluster.name);
    for check in config.checklist() {
        println!("[{:>4}] {}", check.level.label(), check.text);
    }
    match config.check_exposure() {
        Ok(()) => Ok(()),
        Err(e) => Err(anyhow::Error::from(e).context("the node would refuse to start")),
    }
}

async fn run(args: Args) -> Result<()> {
    let config = load(&args)?;
    if args.check_config {
        return print_checklist(&config);
    }
    let me = config.this_node()?.clone();
    let nodes = config.cluster.nodes.len();
    // Before anything binds: a listener beyond loopback needs tokens, a long random
    // secret and TLS (or an explicit node.insecure_plaintext, said at every start).
    config.check_exposure().context("refusing to start")?;
    for l in config.insecure_listeners() {
        tracing::warn!(
            target: tally_server::auth::AUDIT_TARGET,
            listener = %l.field,
            addr = %l.addr,
            "{} listens on {} beyond loopback WITHOUT TLS (node.insecure_plaintext = true): tokens, raft \
             traffic and counter data cross the network in clear, and a raft request seen on the wire can \
             be replayed",
            l.field,
            l.addr
        );
    }
    let gate = Arc::new(Gate::from_config(&config).context("loading [[tokens]]")?);
    if args.check {
        println!(
            "config ok: cluster {:?} ({nodes} node{}), node {:?}, http {}, resp {}, data {}",
            config.cluster.name,
            if nodes == 1 { "" } else { "s" },
            me.id,
            me.http,
            me.resp.map_or_else(|| "off".to_string(), |a| a.to_string()),
            config.node.data_dir.display()
        );
        println!("cluster fingerprint: {:#018x}", config.cluster.fingerprint());
        let replicas = config.cluster.replicas();
        let copies = usize::from(replicas).min(config.cluster.initial_members());
        println!(
            "copies of each shard: {copies}{}",
            match (config.cluster.replicas, replicas) {
                _ if nodes == 1 => " (a single node: one copy, no range groups)",
                (_, 1) => " (cluster.replicas = 1: one copy, no range groups)",
                (Some(_), _) => " (cluster.replicas, in range groups)",
                (None, _) => " (the default: min(3, initial members), in range groups)",
            }
        );
        println!(
            "client tokens: {}",
            if gate.is_open() {
                "none (open, loopback only)".to_string()
            } else {
                config.tokens.len().to_string()
            }
        );
        return Ok(());
    }

    // Signals first, so one that arrives while the engine opens is not lost.
    let term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let hup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    tokio::spawn(reload_tokens_on_hangup(hup, args.clone(), config.clone(), gate.clone()));
    // Certificates are read before anything binds, so a wrong path fails the start.
    let tls = config.tls.as_ref().map(tally_tls::acceptor).transpose().context("setting up TLS for HTTP")?;
    let resp_tls = match (&config.tls, me.resp) {
        (Some(files), Some(_)) => Some(resp::RespTls {
            acceptor: tally_tls::stream_acceptor(files).context("setting up TLS for RESP")?,
            handshake_timeout: config.http.header_read_timeout(),
        }),
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(me.http)
        .await
        .with_context(|| format!("binding HTTP to {}", me.http))?;
    let resp_listener = match me.resp {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding RESP to {addr}"))?,
        ),
        None => None,
    };
    let node = if nodes > 1 {
        Node::Cluster(
            ClusterService::start(&config)
                .await
                .with_context(|| format!("starting cluster node {:?}", me.id))?,
        )
    } else {
        Node::Single(
            SingleNode::open(&config)
                .await
                .with_context(|| format!("opening the engine in {}", config.store_dir().display()))?,
        )
    };
    tracing::info!(
        node = %me.id,
        http = %me.http,
        resp = %me.resp.map_or_else(|| "off".to_string(), |a| a.to_string()),
        data = %config.node.data_dir.display(),
        fingerprint = %format!("{:#018x}", config.cluster.fingerprint()),
        tokens = config.tokens.len(),
        "node started"
    );

    let app = match &node {
        Node::Single(n) => router_with_gate(n.clone(), &config.http, gate.clone()),
        Node::Cluster(n) => router_with_gate(n.clone(), &config.http, gate.clone()),
    };
    // One signal stops both front ends: HTTP waits for it, RESP for HTTP's word.
    let (stopping_tx, mut stopping_rx) = tokio::sync::watch::channel(false);
    let http_shutdown = {
        let node = node.clone();
        async move {
            shutdown_signal(term, int, node).await;
            let _ = stopping_tx.send(true);
        }
    };
    let resp_shutdown = async move {
        let _ = stopping_rx.wait_for(|s| *s).await;
    };
    let resp_served = async {
        let Some(l) = resp_listener else { return Ok(()) };
        let serving = resp::Serving {
            limits: config.resp.clone(),
            command_timeout: config.http.request_timeout(),
            grace: config.http.shutdown_grace(),
            gate: gate.clone(),
            tls: resp_tls,
        };
        match &node {
            Node::Single(n) => resp::serve_with(l, n.clone(), serving, resp_shutdown).await,
            Node::Cluster(n) => resp::serve_with(l, n.clone(), serving, resp_shutdown).await,
        }
    };
    let http_served = async {
        match tls {
            Some(acceptor) => serve_tls(listener, acceptor, app, &config.http, http_shutdown).await,
            None => serve(listener, app, &config.http, http_shutdown).await,
        }
    };
    let (served, resp_served) = tokio::join!(http_served, resp_served);
    // Flush whatever the front ends left buffered even if serving failed.
    let flushed = node.shutdown().await;
    served.context("serving HTTP")?;
    resp_served.context("serving RESP")?;
    flushed.context("flushing the engine at shutdown")?;
    tracing::info!("stopped cleanly");
    Ok(())
}
