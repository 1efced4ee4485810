//! Friendly text for each answer. Every function returns the text (ending in a
//! newline) so the formats are unit-tested; `--json` bypasses all of this.

use crate::wire::{
    ClusterView, CounterInfo, DistinctRead, FrequencyRead, IncrOutcome, ReconcileReport, ShardsReport,
    TopRead, ValueRead, WindowRead,
};
use std::fmt::Write;

/// Lays out rows as left-aligned columns separated by two spaces, with a header row.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let columns = header.len();
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate().take(columns) {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let mut text = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:<w$}  ", w = widths[i]);
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
    out
}

/// `key  value` lines with the keys aligned, indented by two spaces.
fn fields(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    pairs.iter().map(|(k, v)| format!("  {k:<width$}  {v}\n")).collect()
}

fn shard_list(shards: &[u64]) -> String {
    shards.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
}

/// A counter's name, spec and summary, after `verb` (`created`, `updated`, or empty).
pub fn counter(verb: &str, info: &CounterInfo) -> String {
    let s = &info.spec;
    let title = if verb.is_empty() { info.name.clone() } else { format!("{verb} {}", info.name) };
    let mut pairs = vec![
        ("shards", s.shards.to_string()),
        ("durability", s.durability.clone()),
        ("flush_ms", s.flush_ms.to_string()),
        ("rollup_ms", if s.rollup_ms == 0 { "0 (no rollup)".into() } else { s.rollup_ms.to_string() }),
        ("router", s.router.clone()),
        ("distinct", s.distinct.to_string()),
        ("dedup_window_s", s.dedup_window_s.to_string()),
        ("generation", info.generation.to_string()),
    ];
    if let Some(f) = s.frequency {
        pairs.push(("frequency", format!("epsilon {} delta {}", f.epsilon, f.delta)));
    }
    if !s.windows.is_empty() {
        pairs.push(("windows", s.windows.join(", ")));
    }
    if let Some(min) = s.min {
        pairs.push(("min", min.to_string()));
    }
    if let Some(max) = s.max {
        pairs.push(("max", max.to_string()));
    }
    if let Some(l) = &s.limit {
        pairs.push(("limit", format!("{} per {}", l.max, l.window)));
    }
    if let Some(r) = s.replicas {
        pairs.push(("replicas", r.to_string()));
    }
    if let Some(target) = info.resharding {
        pairs.push(("resharding", format!("{} → {target} shards", info.layout_shards)));
    }
    if info.created_at_ms > 0 {
        pairs.push(("created_at_ms", info.created_at_ms.to_string()));
    }
    format!("{title}\n{}", fields(&pairs))
}

/// A value read: the total, then how it was produced and whether it is whole.
pub fn value(name: &str, v: &ValueRead) -> String {
    let complete = if v.complete {
        "yes".to_string()
    } else {
        format!("NO: shards {} did not answer; their values are missing", shard_list(&v.missing_shards))
    };
    let pairs = [
        ("consistency", v.consistency.clone()),
        ("staleness", format!("{} ms", v.staleness_ms)),
        ("as_of_ms", v.as_of_ms.to_string()),
        ("complete", complete),
    ];
    format!("{name} = {}\n{}", v.value, fields(&pairs))
}

/// The outcome of one increment.
pub fn incr(name: &str, delta: i64, outcome: &IncrOutcome) -> String {
    if outcome.duplicate {
        format!("duplicate: this event id was already counted on {name}; not counted again\n")
    } else if outcome.applied {
        format!("applied {delta:+} to {name}\n")
    } else {
        format!("not applied to {name}\n")
    }
}

/// A distinct-member estimate with its error.
pub fn distinct(name: &str, d: &DistinctRead) -> String {
    let mut out = format!("{name}: ~{} distinct members (±{:.2}%)\n", d.estimate, d.relative_error * 100.0);
    let _ =
        writeln!(out, "  sketch {} bytes, counter {} bytes over its shards", d.sketch_bytes, d.counter_bytes);
    if !d.complete {
        let _ =
            writeln!(out, "  INCOMPLETE: sketches of shards {} are missing", shard_list(&d.missing_shards));
    }
    out
}

/// A sliding window's total (and distinct estimate), with its span and granularity.
pub fn window(name: &str, w: &WindowRead) -> String {
    let mut out = format!("{name} over the last {} = {}\n", w.window, w.value);
    let mut pairs = vec![
        ("span_ms", format!("{}..{}", w.start_ms, w.end_ms)),
        ("granularity", format!("{} ms buckets", w.bucket_ms)),
    ];
    if let (Some(limit), Some(remaining)) = (w.limit, w.remaining) {
        pairs.push(("limit", format!("{limit} per {} ({remaining} left)", w.window)));
    }
    if let (Some(estimate), Some(error)) = (w.estimate, w.relative_error) {
        pairs.push(("distinct", format!("~{estimate} (±{:.2}%)", error * 100.0)));
    }
    pairs.push(("bytes", format!("{} of at most {}", w.window_bytes, w.window_bytes_bound)));
    let complete = if w.complete {
        "yes".to_string()
    } else {
        format!("NO: buckets of shards {} are missing", shard_list(&w.missing_shards))
    };
    pairs.push(("complete", complete));
    out.push_str(&fields(&pairs));
    out
}

/// An item's estimate with its bound.
pub fn frequency(name: &str, f: &FrequencyRead) -> String {
    let mut out = format!(
        "{name}: {} ~{} (at least {}; over by at most {} with {:.2}% confidence; total weight {})\n",
        f.item,
        f.estimate,
        f.lower_bound,
        f.error_bound,
        f.confidence * 100.0,
        f.total
    );
    if !f.complete {
        let _ =
            writeln!(out, "  INCOMPLETE: sketches of shards {} are missing", shard_list(&f.missing_shards));
    }
    out
}

/// The heaviest items as a table.
pub fn top_items(name: &str, t: &TopRead) -> String {
    let rows: Vec<Vec<String>> = t
        .items
        .iter()
        .enumerate()
        .map(|(i, e)| {
            vec![(i + 1).to_string(), e.item.clone(), e.estimate.to_string(), e.lower_bound.to_string()]
        })
        .collect();
    let mut out = format!(
        "{name}: top {} of total weight {} (estimates over by at most {} with {:.2}% confidence)\n",
        t.items.len(),
        t.total,
        t.error_bound,
        t.confidence * 100.0
    );
    out.push_str(&table(&["#", "ITEM", "ESTIMATE", "AT LEAST"], &rows));
    if !t.complete {
        let _ =
            writeln!(out, "  INCOMPLETE: sketches of shards {} are missing", shard_list(&t.missing_shards));
    }
    out
}

/// Per-shard values as a table, then the total and skew.
pub fn shards(name: &str, r: &ShardsReport) -> String {
    let replicated = r.shards.iter().any(|s| s.replication.is_some());
    let rows: Vec<Vec<String>> = r
        .shards
        .iter()
        .map(|s| {
            let mut row =
                vec![s.index.to_string(), s.node.clone(), s.value.to_string(), s.writes.to_string()];
            if replicated {
                row.extend(replica_columns(s.replication.as_ref()));
            }
            row
        })
        .collect();
    let total: i128 = r.base.saturating_add(r.shards.iter().map(|s| s.value).sum::<i128>());
    let mut out = if replicated {
        table(&["shard", "node", "value", "writes", "range", "leader", "term", "replicas"], &rows)
    } else {
        table(&["shard", "node", "value", "writes"], &rows)
    };
    let sealed =
        if r.base == 0 { String::new() } else { format!(" (of which {} from sealed generations)", r.base) };
    let _ = writeln!(
        out,
        "{name}: {} shards, generation {}, total {total}{sealed}, skew {:.2}",
        r.shards.len(),
        r.generation,
        r.skew
    );
    out
}

/// A replicated shard's range, leader, term and replicas (learners marked).
fn replica_columns(r: Option<&crate::wire::RangeReport>) -> Vec<String> {
    let Some(r) = r else { return vec!["-".into(); 4] };
    let replicas: Vec<String> = r
        .replicas
        .iter()
        .map(|p| if p.role == "learner" { format!("{}(learner)", p.node) } else { p.node.clone() })
        .collect();
    vec![
        r.range.to_string(),
        r.leader.clone().unwrap_or_else(|| "(none known)".into()),
        r.term.map_or_else(|| "-".into(), |t| t.to_string()),
        replicas.join(","),
    ]
}

/// The cluster's nodes as a table, then the leader and term.
pub fn cluster(c: &ClusterView) -> String {
    let rows: Vec<Vec<String>> = c
        .nodes
        .iter()
        .map(|n| {
            let role = if n.member { "member" } else { "spare" };
            vec![n.id.clone(), n.state.clone(), role.to_string(), n.http.clone()]
        })
        .collect();
    let mut out = table(&["node", "state", "shards", "http"], &rows);
    let leader = c.leader.as_deref().unwrap_or("(none known)");
    let _ = writeln!(out, "leader {leader}, term {}, placement epoch {}", c.term, c.placement_epoch);
    if !c.data_lost.is_empty() {
        let _ = writeln!(
            out,
            "data lost (replaced disk; reads report these nodes' shards missing until `tally cluster accept-loss NODE`): {}",
            c.data_lost.join(", ")
        );
    }
    if !c.handoff.is_empty() {
        let _ = writeln!(out, "shards still moving from: {}", c.handoff.join(", "));
    }
    out
}

/// The result of a reconciliation.
pub fn reconcile(name: &str, r: &ReconcileReport) -> String {
    if r.drift == 0 {
        return format!("{name}: no drift (sum of shards {}); nothing to correct\n", r.before);
    }
    let what = if r.corrected { "corrected" } else { "not corrected (already applied)" };
    format!("{name}: sum of shards was {}, drift {:+}: {what}\n", r.before, r.drift)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{NodeView, ShardReport, Spec};

    #[test]
    fn tables_align_columns() {
        let t = table(&["a", "bb"], &[vec!["long".into(), "x".into()], vec!["s".into(), "yy".into()]]);
        assert_eq!(t, "a     bb\nlong  x\ns     yy\n");
    }

    #[test]
    fn shards_and_cluster_read_well() {
        let r = ShardsReport {
            generation: 1,
            base: 0,
            shards: vec![
                ShardReport { index: 0, node: "node1".into(), value: 12, writes: 12, replication: None },
                ShardReport { index: 1, node: "node1".into(), value: 3, writes: 3, replication: None },
            ],
            skew: 1.6,
        };
        let text = shards("likes", &r);
        assert!(text.starts_with("shard  node   value  writes\n0      node1  12     12\n"), "{text}");
        assert!(text.contains("total 15") && text.contains("skew 1.60"), "{text}");
        let c = ClusterView {
            nodes: vec![NodeView {
                id: "node1".into(),
                state: "up".into(),
                http: "127.0.0.1:7070".into(),
                member: true,
            }],
            leader: Some("node1".into()),
            term: 3,
            placement_epoch: 1,
            handoff: vec!["node1".into()],
            data_lost: vec![],
        };
        assert_eq!(
            cluster(&c),
            "node   state  shards  http\nnode1  up     member  127.0.0.1:7070\n\
             leader node1, term 3, placement epoch 1\nshards still moving from: node1\n"
        );
    }

    #[test]
    fn replicated_shards_show_their_range_leader_and_replicas() {
        use crate::wire::{RangeReport, ReplicaReport};
        let replica = |node: &str, role: &str| ReplicaReport { node: node.into(), role: role.into() };
        let range = RangeReport {
            range: 14,
            leader: Some("node2".into()),
            term: Some(3),
            replicas: vec![replica("node1", "voter"), replica("node2", "voter"), replica("node4", "learner")],
        };
        let r = ShardsReport {
            generation: 0,
            base: 0,
            shards: vec![ShardReport {
                index: 0,
                node: "node2".into(),
                value: 5,
                writes: 5,
                replication: Some(range),
            }],
            skew: 1.0,
        };
        let text = shards("likes", &r);
        let lines: Vec<&str> = text.lines().map(str::trim_end).collect();
        assert_eq!(lines[0], "shard  node   value  writes  range  leader  term  replicas", "{text}");
        assert_eq!(
            lines[1], "0      node2  5      5       14     node2   3     node1,node2,node4(learner)",
            "{text}"
        );
    }

    #[test]
    fn values_say_when_they_are_partial() {
        let v = ValueRead {
            value: 7,
            consistency: "fresh".into(),
            as_of_ms: 1,
            staleness_ms: 0,
            complete: false,
            missing_shards: vec![2, 5],
        };
        let text = value("likes", &v);
        assert!(text.starts_with("likes = 7\n"), "{text}");
        assert!(text.contains("NO: shards 2, 5 did not answer"), "{text}");
    }

    #[test]
    fn frequencies_show_estimate_bound_and_items() {
        let f = FrequencyRead {
            item: "/home".into(),
            estimate: 12,
            lower_bound: 10,
            error_bound: 3,
            confidence: 0.99,
            total: 40,
            complete: false,
            missing_shards: vec![2],
        };
        let text = frequency("views", &f);
        assert!(
            text.starts_with("views: /home ~12 (at least 10; over by at most 3 with 99.00% confidence"),
            "{text}"
        );
        assert!(text.contains("INCOMPLETE: sketches of shards 2"), "{text}");
        let t = TopRead {
            items: vec![crate::wire::TopEntry { item: "/home".into(), estimate: 12, lower_bound: 10 }],
            error_bound: 3,
            confidence: 0.99,
            total: 40,
            complete: true,
            missing_shards: vec![],
        };
        let text = top_items("views", &t);
        assert!(text.contains("/home") && text.contains("AT LEAST"), "{text}");
    }

    #[test]
    fn counters_show_their_spec() {
        let info = CounterInfo {
            name: "likes".into(),
            spec: Spec {
                shards: 8,
                durability: "batched".into(),
                flush_ms: 200,
                rollup_ms: 0,
                router: "writer".into(),
                distinct: false,
                dedup_window_s: 86400,
                frequency: Some(crate::wire::Frequency { epsilon: 0.001, delta: 0.01 }),
                windows: vec!["1m".into(), "1h".into()],
                min: Some(0),
                max: None,
                limit: Some(crate::wire::Limit { window: "1m".into(), max: 100 }),
                replicas: Some(3),
            },
            generation: 1,
            layout_shards: 8,
            resharding: None,
            created_at_ms: 0,
        };
        let text = counter("created", &info);
        assert!(text.starts_with("created likes\n  shards          8\n"), "{text}");
        assert!(text.contains("frequency       epsilon 0.001 delta 0.01\n"), "{text}");
        assert!(text.contains("windows         1m, 1h\n"), "{text}");
        assert!(text.contains("rollup_ms       0 (no rollup)"), "{text}");
        assert!(text.contains("min             0\n") && !text.contains("max "), "{text}");
        assert!(text.contains("limit           100 per 1m\n"), "{text}");
        assert!(text.contains("replicas        3\n"), "{text}");
        assert_eq!("100/1m".parse(), Ok(crate::wire::Limit { window: "1m".into(), max: 100 }));
        assert!(
            "100".parse::<crate::wire::Limit>().is_err() && "x/1m".parse::<crate::wire::Limit>().is_err()
        );
    }
}
