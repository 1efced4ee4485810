//! Operational signals in the Prometheus text exposition format (version 0.0.4),
//! written by hand from the engine's [`Stats`] and the HTTP front end's
//! [`HttpStats`]: a handful of atomics does not need a metrics framework, and
//! writing the text directly keeps the hot path free of registries and locks.

use crate::sources::RunBook;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use tally_engine::{Count, Histogram, HistogramSnapshot, Stats, Tally};

/// The `Content-Type` of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Index of the engine histograms' clamp bucket: it also holds every value beyond
/// its bound, so it is exported only as `+Inf`.
const CLAMP_BUCKET: usize = 40;

/// Builds one exposition: every family gets its HELP and TYPE lines before its
/// samples, label values are escaped, histograms end with `+Inf`, `_sum`, `_count`.
#[derive(Debug, Default)]
pub struct PromWriter {
    out: String,
}

/// Label pairs of one sample.
pub type Labels<'a> = &'a [(&'a str, &'a str)];

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl PromWriter {
    /// An empty exposition.
    pub fn new() -> Self {
        Self::default()
    }

    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: Labels<'_>, extra: Option<(&str, &str)>, value: &str) {
        self.out.push_str(name);
        let mut pairs = labels.iter().copied().chain(extra).peekable();
        if pairs.peek().is_some() {
            self.out.push('{');
            for (i, (k, v)) in pairs.enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }

    /// A counter family (`name` should end in `_total`).
    pub fn counter(&mut self, name: &str, help: &str, samples: &[(Labels<'_>, u64)]) {
        self.header(name, "counter", help);
        for (labels, v) in samples {
            self.sample(name, labels, None, &v.to_string());
        }
    }

    /// A gauge family.
    pub fn gauge(&mut self, name: &str, help: &str, samples: &[(Labels<'_>, f64)]) {
        self.header(name, "gauge", help);
        for (labels, v) in samples {
            self.sample(name, labels, None, &v.to_string());
        }
    }

    /// A histogram family from engine histograms of integer values. Each value is
    /// divided by `scale` on export (1e6 turns microseconds into seconds). The engine
    /// counts integers below `2^i` in bucket `i`, so the inclusive bound is `2^i - 1`.
    pub fn histogram(
        &mut self,
        name: &str,
        help: &str,
        scale: f64,
        series: &[(Labels<'_>, HistogramSnapshot)],
    ) {
        self.header(name, "histogram", help);
        let bucket = format!("{name}_bucket");
        for (labels, snap) in series {
            let mut last = 0;
            for &(bound, cumulative) in snap.buckets.iter().take(CLAMP_BUCKET) {
                let le = (bound - 1) as f64 / scale;
                self.sample(&bucket, labels, Some(("le", &le.to_string())), &cumulative.to_string());
                last = cumulative;
            }
            // The snapshot reads buckets and count one after the other; keep the
            // exposition self-consistent if a value landed in between.
            let total = snap.buckets.last().map_or(0, |b| b.1).max(snap.count).max(last);
            self.sample(&bucket, labels, Some(("le", "+Inf")), &total.to_string());
            self.sample(&format!("{name}_sum"), labels, None, &(snap.sum as f64 / scale).to_string());
            self.sample(&format!("{name}_count"), labels, None, &total.to_string());
        }
    }

    /// The exposition text.
    pub fn finish(self) -> String {
        self.out
    }
}

/// Signals of the HTTP front end, kept by the router.
#[derive(Debug, Default)]
pub struct HttpStats {
    /// Responses by status class: index 0 is 1xx, 4 is 5xx.
    pub responses: [Count; 5],
    /// Requests cut off by the request timeout.
    pub timeouts: Count,
    /// Handler panics turned into 500 answers.
    pub panics: Count,
    /// Time from request head to response head, in microseconds.
    pub latency_us: Histogram,
    /// Staleness of the cached totals answered through `GET .../value`, in milliseconds.
    pub cached_staleness_ms: Histogram,
}

impl HttpStats {
    /// Records one answered request.
    pub fn record(&self, status: u16, elapsed_us: u64) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.responses[class].inc();
        self.latency_us.record(elapsed_us);
    }

    /// Writes the HTTP families.
    pub fn write(&self, w: &mut PromWriter) {
        let labels = ["1xx", "2xx", "3xx", "4xx", "5xx"].map(|c| [("class", c)]);
        let samples: Vec<(Labels<'_>, u64)> =
            labels.iter().zip(&self.responses).map(|(l, n)| (l.as_slice(), n.get())).collect();
        w.counter("tally_http_responses_total", "HTTP responses sent, by status class.", &samples);
        w.counter(
            "tally_http_request_timeouts_total",
            "Requests cut off by http.request_timeout_ms.",
            &[(&[], self.timeouts.get())],
        );
        w.counter(
            "tally_http_panics_total",
            "Handler panics answered with 500.",
            &[(&[], self.panics.get())],
        );
        w.histogram(
            "tally_http_request_duration_seconds",
            "Time from a request's head to its response's head.",
            1e6,
            &[(&[], self.latency_us.snapshot())],
        );
        w.histogram(
            "tally_cached_read_staleness_seconds",
            "Age of the cached totals answered by cached value reads through this node.",
            1e3,
            &[(&[], self.cached_staleness_ms.snapshot())],
        );
    }
}

/// Signals of client authentication and of admin operations, kept by the
/// [`crate::auth::Gate`] every listener shares.
#[derive(Debug, Default)]
pub struct AuthStats {
    /// Refused requests, by [`tally_auth::AuthError::REASONS`] index.
    pub refusals: [Count; tally_auth::AuthError::REASONS.len()],
    /// Admin operations, by [`AdminOp`] and [`AdminOutcome`].
    pub admin_operations: [[Count; AdminOutcome::ALL.len()]; AdminOp::ALL.len()],
}

/// An operation that needs the `admin` scope, as the audit trail and metrics name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminOp {
    /// `PUT /v1/counters/{name}`: creates a counter or changes its spec (resharding included).
    PutCounter,
    /// `DELETE /v1/counters/{name}`.
    DeleteCounter,
    /// `POST /v1/counters/{name}/reconcile`.
    Reconcile,
    /// `PUT /v1/cluster/members/{id}`.
    AddMember,
    /// `DELETE /v1/cluster/members/{id}`.
    RemoveMember,
    /// `POST /v1/cluster/nodes/{id}/accept-loss`.
    AcceptLoss,
    /// A route no table entry classifies (treated as admin on every counter).
    Other,
}

impl AdminOp {
    /// Every operation, in label order.
    pub const ALL: [AdminOp; 7] = [
        Self::PutCounter,
        Self::DeleteCounter,
        Self::Reconcile,
        Self::AddMember,
        Self::RemoveMember,
        Self::AcceptLoss,
        Self::Other,
    ];

    /// The label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PutCounter => "put_counter",
            Self::DeleteCounter => "delete_counter",
            Self::Reconcile => "reconcile",
            Self::AddMember => "add_member",
            Self::RemoveMember => "remove_member",
            Self::AcceptLoss => "accept_loss",
            Self::Other => "other",
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|o| *o == self).unwrap_or(Self::ALL.len() - 1)
    }
}

/// How an admin operation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminOutcome {
    /// It took effect (a 2xx answer).
    Ok,
    /// It was refused as asked (a 4xx answer: unknown counter, bad spec, a change in progress).
    Rejected,
    /// The node could not carry it out (a 5xx answer); it may or may not have taken effect.
    Failed,
}

impl AdminOutcome {
    /// Every outcome, in label order.
    pub const ALL: [AdminOutcome; 3] = [Self::Ok, Self::Rejected, Self::Failed];

    /// The outcome of an answer with HTTP status `status`.
    pub fn of_status(status: u16) -> Self {
        match status {
            200..=299 => Self::Ok,
            500.. => Self::Failed,
            _ => Self::Rejected,
        }
    }

    /// The label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Rejected => "rejected",
            Self::Failed => "failed",
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|o| *o == self).unwrap_or(0)
    }
}

impl AuthStats {
    /// Counts one refusal for `reason` (one of [`tally_auth::AuthError::REASONS`]).
    pub fn refused(&self, reason: &str) {
        self.refused_n(reason, 1);
    }

    /// Counts `n` refusals for `reason`.
    pub fn refused_n(&self, reason: &str, n: u64) {
        let reasons = tally_auth::AuthError::REASONS;
        if let Some(i) = reasons.iter().position(|r| *r == reason) {
            self.refusals[i].add(n);
        }
    }

    /// Counts one admin operation.
    pub fn admin(&self, op: AdminOp, outcome: AdminOutcome) {
        self.admin_operations[op.index()][outcome.index()].inc();
    }

    /// Writes the authentication families (every label combination, zeros included,
    /// so a rate over them never starts from a missing series).
    pub fn write(&self, w: &mut PromWriter) {
        let reasons = tally_auth::AuthError::REASONS.map(|r| [("reason", r)]);
        let samples: Vec<(Labels<'_>, u64)> =
            reasons.iter().zip(&self.refusals).map(|(l, n)| (l.as_slice(), n.get())).collect();
        w.counter(
            "tally_auth_refusals_total",
            "Requests refused by client authentication (401) or authorization (403), by reason.",
            &samples,
        );
        let labels: Vec<[(&str, &str); 2]> = AdminOp::ALL
            .iter()
            .flat_map(|op| AdminOutcome::ALL.iter().map(|o| [("op", op.as_str()), ("outcome", o.as_str())]))
            .collect();
        let counts = self.admin_operations.iter().flatten();
        let samples: Vec<(Labels<'_>, u64)> =
            labels.iter().zip(counts).map(|(l, n)| (l.as_slice(), n.get())).collect();
        w.counter(
            "tally_admin_operations_total",
            "Operations that need the admin scope, by operation and outcome (ok, rejected, failed).",
            &samples,
        );
    }
}

/// `tally_listener_refusals_total{listener, reason}`: connections and calls refused
/// below client authentication (TLS handshakes, raft proofs, node-to-node sessions),
/// counted by every listener of this process ([`tally_tls::refusals`]).
pub fn listener_refusals(w: &mut PromWriter) {
    let counts = tally_tls::refusals::snapshot();
    let labels: Vec<[(&str, &str); 2]> =
        counts.iter().map(|((l, r), _)| [("listener", l.as_str()), ("reason", r.as_str())]).collect();
    let samples: Vec<(Labels<'_>, u64)> =
        labels.iter().zip(&counts).map(|(l, (_, n))| (l.as_slice(), *n)).collect();
    w.counter(
        "tally_listener_refusals_total",
        "Connections and calls refused before client authentication, by listener and reason \
         (TLS handshakes, raft RPCs without the cluster secret's proof, node-to-node sessions).",
        &samples,
    );
}

/// The engine's families, labelled where a dimension exists.
pub fn engine_metrics(w: &mut PromWriter, tally: &Tally, node_id: &str) {
    let s: &Stats = tally.stats();
    let in_doubt = tally.in_doubt_increments();
    w.gauge("tally_node_info", "Constant 1, labelled with this node's id.", &[(&[("node", node_id)], 1.0)]);
    w.counter(
        "tally_increments_total",
        "Increments acknowledged, by the counter's durability.",
        &[
            (&[("durability", "sync")], s.increments_sync.get()),
            (&[("durability", "batched")], s.increments_batched.get()),
        ],
    );
    w.counter(
        "tally_dedup_hits_total",
        "Increments whose event id had been counted before (not counted again).",
        &[(&[], s.dedup_hits.get())],
    );
    w.counter(
        "tally_event_id_conflicts_total",
        "Increments refused because their event id was used with another delta.",
        &[(&[], s.conflicts.get())],
    );
    w.counter(
        "tally_bound_refusals_total",
        "Increments refused because they would take a bounded counter past its min or max.",
        &[(&[], s.bound_refusals.get())],
    );
    w.counter(
        "tally_quota_refusals_total",
        "Requests refused with 507 quota_exceeded, by quota: counters (engine.counters_max, [[quotas]]), \
         event_ids (engine.event_ids_per_counter_max), sketch_bytes (engine.sketch_bytes_per_counter_max).",
        &[
            (&[("quota", "counters")], s.quota_counters_refused.get()),
            (&[("quota", "event_ids")], s.quota_event_ids_refused.get()),
            (&[("quota", "sketch_bytes")], s.quota_sketch_bytes_refused.get()),
        ],
    );
    w.counter(
        "tally_escrow_grants_total",
        "Headroom transfers between shards of bounded counters sent by this node (resends included).",
        &[(&[], s.escrow_grants_sent.get())],
    );
    w.counter(
        "tally_escrow_messages_total",
        "Escrow messages (borrow requests, grants, acknowledgements) sent by this node's shards.",
        &[(&[], s.escrow_messages.get())],
    );
    w.counter("tally_shard_commits_total", "Shard commits written to the store.", &[(&[], s.commits.get())]);
    w.histogram(
        "tally_commit_batch_submissions",
        "Submissions (single increments or drained sums) per shard commit.",
        1.0,
        &[(&[], s.commit_submissions.snapshot())],
    );
    w.histogram(
        "tally_aggregator_drain_increments",
        "Increments carried by one aggregator drain to one shard.",
        1.0,
        &[(&[], s.drain_increments.snapshot())],
    );
    w.counter("tally_flushes_total", "Store flushes (fsyncs).", &[(&[], s.flushes.get())]);
    w.histogram(
        "tally_flush_waiters",
        "Writes served by one store flush (the group-commit factor).",
        1.0,
        &[(&[], s.flush_waiters.snapshot())],
    );
    w.histogram(
        "tally_commit_cycle_writes",
        "Shard writes applied by one commit cycle (a cycle ends with at most one flush).",
        1.0,
        &[(&[], s.cycle_commits.snapshot())],
    );
    w.counter(
        "tally_reads_total",
        "Counter reads served, by consistency.",
        &[
            (&[("consistency", "cached")], s.reads_cached.get()),
            (&[("consistency", "fresh")], s.reads_fresh.get()),
        ],
    );
    w.histogram(
        "tally_read_duration_seconds",
        "Latency of counter reads inside the engine, by consistency.",
        1e6,
        &[
            (&[("consistency", "cached")], s.read_cached_us.snapshot()),
            (&[("consistency", "fresh")], s.read_fresh_us.snapshot()),
        ],
    );
    w.counter(
        "tally_reconcile_corrections_total",
        "Reconciliations that found and corrected drift.",
        &[(&[], s.reconcile_corrections.get())],
    );
    w.counter(
        "tally_expired_reclaimed_total",
        "Expired counters this node deleted (its sweep, or a write that met one).",
        &[(&[], s.expired_reclaimed.get())],
    );
    w.counter(
        "tally_buffered_lost_total",
        "Acknowledged batched increments given up on: in doubt past the resend limit, or undeliverable at shutdown.",
        &[(&[], s.buffered_lost.get())],
    );
    w.gauge(
        "tally_buffered_in_doubt",
        "Drained batched increments sent to a shard and not yet confirmed.",
        &[(&[], in_doubt as f64)],
    );
    w.gauge(
        "tally_drift_last",
        "The last measured drift (authoritative total minus sum of shards) of any counter.",
        &[(&[], s.drift_last.load(Ordering::Relaxed) as f64)],
    );
    w.counter("tally_shard_activations_total", "Shard actors started.", &[(&[], s.shard_activations.get())]);
    w.counter(
        "tally_dormant_shard_wakes_total",
        "Shards started only to sweep their expired dedup records.",
        &[(&[], s.dormant_wakes.get())],
    );
    w.counter(
        "tally_dedup_sweep_reads_total",
        "Dedup records read by sweep passes, live ones included.",
        &[(&[], s.dedup_sweep_reads.get())],
    );
    w.counter(
        "tally_shard_retirements_total",
        "Shard actors stopped for idleness.",
        &[(&[], s.shard_retirements.get())],
    );
    let (counters, shards) = tally.active();
    w.gauge(
        "tally_active_counters",
        "Counters with in-memory state on this node.",
        &[(&[], counters as f64)],
    );
    w.gauge("tally_active_shard_actors", "Shard actors running on this node.", &[(&[], shards as f64)]);
    let skews = tally.write_skews(SKEW_COUNTERS_MAX);
    let samples: Vec<(Vec<(&str, &str)>, f64)> =
        skews.iter().map(|(name, skew, _)| (vec![("counter", name.as_str())], *skew)).collect();
    let samples: Vec<(Labels<'_>, f64)> = samples.iter().map(|(l, v)| (l.as_slice(), *v)).collect();
    w.gauge(
        "tally_shard_skew",
        "Write skew of a counter's shards on this node (hottest shard's increments / mean); \
         the busiest active counters only.",
        &samples,
    );
    // Auto shard counts: changes by direction and reason (a fixed label set), and the
    // totals over every auto counter, not one series per counter (their number is
    // up to the clients).
    let changes = s.auto_changes.snapshot();
    let labels: Vec<[(&str, &str); 2]> =
        changes.iter().map(|(d, r, _)| [("direction", *d), ("reason", *r)]).collect();
    let samples: Vec<(Labels<'_>, u64)> = labels.iter().zip(&changes).map(|(l, c)| (&l[..], c.2)).collect();
    w.counter(
        "tally_auto_reshards_total",
        "Completed reshardings of counters with shards \"auto\", by direction and reason.",
        &samples,
    );
    w.counter(
        "tally_auto_proposals_total",
        "Reshardings this node proposed for counters with shards \"auto\".",
        &[(&[], s.auto_proposals.get())],
    );
    w.counter(
        "tally_auto_dropped_total",
        "Auto proposals that did not happen (refused, or overtaken by another change).",
        &[(&[], s.auto_dropped.get())],
    );
    let (auto_counters, auto_shards) = tally.auto_totals();
    w.gauge(
        "tally_auto_counters",
        "Counters with shards \"auto\" this node follows.",
        &[(&[], auto_counters as f64)],
    );
    w.gauge(
        "tally_auto_shards",
        "Shards of the current generations of every counter with shards \"auto\", summed.",
        &[(&[], auto_shards as f64)],
    );
}

/// The scheduled reconciler's signals: `tally_drift{counter}`, the latest drift a
/// run measured (the most recently reconciled counters only), and
/// `tally_reconcile_runs_total{outcome}`.
pub fn reconcile_metrics(w: &mut PromWriter, book: &RunBook) {
    let drifts = book.latest_drifts();
    let samples: Vec<(Vec<(&str, &str)>, f64)> =
        drifts.iter().map(|(name, d)| (vec![("counter", name.as_str())], *d as f64)).collect();
    let samples: Vec<(Labels<'_>, f64)> = samples.iter().map(|(l, v)| (l.as_slice(), *v)).collect();
    w.gauge(
        "tally_drift",
        "The latest drift (authoritative total minus sum of shards) a reconciliation on this node \
         measured, per counter; the most recently reconciled counters only.",
        &samples,
    );
    let totals = book.outcome_totals();
    let samples: Vec<(Vec<(&str, &str)>, u64)> =
        totals.iter().map(|(o, n)| (vec![("outcome", o.as_str())], *n)).collect();
    let samples: Vec<(Labels<'_>, u64)> = samples.iter().map(|(l, v)| (l.as_slice(), *v)).collect();
    w.counter(
        "tally_reconcile_runs_total",
        "Reconciliations of one counter run on this node since it started, by outcome.",
        &samples,
    );
}

/// Most counters `tally_shard_skew` reports (the busiest active ones), so a node with
/// millions of counters keeps its metrics page small.
pub const SKEW_COUNTERS_MAX: usize = 100;

/// The shard replication figures of a node whose shards are replicated
/// (`cluster.replicas` > 1).
pub fn replication_metrics(w: &mut PromWriter, f: &tally_cluster::ReplicationFigures) {
    w.gauge(
        "tally_replica_ranges",
        "Ranges this node runs a replica of.",
        &[(&[], f.ranges_replicated as f64)],
    );
    w.gauge("tally_replica_ranges_led", "Ranges this node leads.", &[(&[], f.ranges_led as f64)]);
    w.gauge(
        "tally_replica_ranges_without_leader",
        "Ranges this node runs a replica of whose group knows no leader here.",
        &[(&[], f.ranges_without_leader as f64)],
    );
    w.gauge(
        "tally_replica_ranges_stopped",
        "Ranges whose group on this node stopped on a fatal error (a failed write to its store): \
         they take no part in their groups until the node restarts.",
        &[(&[], f.ranges_stopped as f64)],
    );
    w.gauge(
        "tally_replica_lag_entries",
        "Over the ranges this node leads: the largest gap, in log entries, between its last log \
         index and a voter's matched index (0 when it leads none).",
        &[(&[], f.lag_entries_max as f64)],
    );
    w.counter(
        "tally_replica_failovers_total",
        "Leader changes this node observed in the range groups it runs since it started (a first \
         election is none).",
        &[(&[], f.failovers)],
    );
    w.counter(
        "tally_replica_hand_overs_total",
        "Ranges this node led and left since it started; each range then elects another \
         leader (up to a failover without one).",
        &[(&[], f.hand_overs)],
    );
    w.counter(
        "tally_replica_groups_retired_total",
        "Range groups this node closed since it started because the group no longer listed this \
         replica (the directory moved the range elsewhere, or a leader steps aside).",
        &[(&[], f.groups_retired)],
    );
    w.counter(
        "tally_replica_snapshots_installed_total",
        "Snapshots this node's replicas installed to catch up since it started.",
        &[(&[], f.snapshots_installed)],
    );
    w.counter(
        "tally_replica_snapshot_bytes_installed_total",
        "Encoded bytes of the snapshots this node's replicas installed to catch up since it started.",
        &[(&[], f.snapshot_bytes_installed)],
    );
    w.counter(
        "tally_replica_log_bytes_caught_up_total",
        "Encoded bytes of the log entries this node's replicas received as learners (catch-up through \
         the log) since it started.",
        &[(&[], f.log_bytes_caught_up)],
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_end_with_inf_sum_and_count() {
        let h = Histogram::default();
        for v in [0, 1, 2, 3, 1000] {
            h.record(v);
        }
        let mut w = PromWriter::new();
        w.histogram("x", "help", 1.0, &[(&[("k", "v")], h.snapshot())]);
        let text = w.finish();
        assert!(text.starts_with("# HELP x help\n# TYPE x histogram\n"), "{text}");
        assert!(text.contains("x_bucket{k=\"v\",le=\"0\"} 1\n"), "{text}");
        assert!(text.contains("x_bucket{k=\"v\",le=\"1\"} 2\n"), "{text}");
        assert!(text.contains("x_bucket{k=\"v\",le=\"3\"} 4\n"), "{text}");
        assert!(text.contains("x_bucket{k=\"v\",le=\"1023\"} 5\n"), "{text}");
        assert!(text.contains("x_bucket{k=\"v\",le=\"+Inf\"} 5\nx_sum{k=\"v\"} 1006\nx_count{k=\"v\"} 5\n"));
    }

    #[test]
    fn label_values_are_escaped() {
        let mut w = PromWriter::new();
        w.counter("c_total", "h", &[(&[("l", "a\"b\\c\nd")], 1)]);
        assert!(w.finish().contains(r#"c_total{l="a\"b\\c\nd"} 1"#));
    }

    #[test]
    fn http_stats_count_by_class() {
        let s = HttpStats::default();
        s.record(200, 5);
        s.record(404, 5);
        s.record(503, 5);
        s.record(204, 5);
        let mut w = PromWriter::new();
        s.write(&mut w);
        let text = w.finish();
        assert!(text.contains("tally_http_responses_total{class=\"2xx\"} 2\n"), "{text}");
        assert!(text.contains("tally_http_responses_total{class=\"5xx\"} 1\n"), "{text}");
        assert!(text.contains("tally_http_request_duration_seconds_count 4\n"), "{text}");
    }
}
