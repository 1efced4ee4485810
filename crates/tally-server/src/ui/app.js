// The status page: polls the node's public JSON endpoints every second and redraws.
// No framework and no build step; every figure comes from /v1/cluster, /v1/stats and
// /v1/counters/{name}/shards. On a node with client tokens those answer 401 without
// one: the page then asks for a read token and keeps it in this tab's
// sessionStorage only (gone when the tab closes), sending it as a Bearer token.
"use strict";

const POLL_MS = 1000;
const STATS_LIMIT = 10;
let chosen = "";          // the counter of the heatmap; "" follows the busiest
let lastShards = null;    // { name, at, writes: Map(index → writes) } of the previous poll

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

const TOKEN_KEY = "tally-token";

async function getJson(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const r = await fetch(path, { cache: "no-store", headers });
  const body = await r.json().catch(() => null);
  if (r.status === 401) $("auth").hidden = false;
  if (!r.ok) {
    const msg = body && body.error ? `${body.error.code}: ${body.error.message}` : `HTTP ${r.status}`;
    throw new Error(`${path}: ${msg}`);
  }
  return body;
}

function fmtNum(n) {
  if (n === null || n === undefined) return "–";
  return Number(n).toLocaleString("en-US", { maximumFractionDigits: 1 });
}
function fmtUs(us) {
  return us >= 1000 ? `${(us / 1000).toFixed(1)} ms` : `${us} µs`;
}
function fmtMs(ms) {
  if (ms === null || ms === undefined) return "–";
  return ms >= 1000 ? `${(ms / 1000).toFixed(1)} s` : `${ms} ms`;
}

function renderCluster(c) {
  $("leader").textContent = c.leader || "none";
  $("term").textContent = c.term;
  $("epoch").textContent = c.placement_epoch;
  $("handoff").textContent = c.handoff.length ? c.handoff.join(", ") : "none";
  $("data-lost").textContent = c.data_lost && c.data_lost.length ? c.data_lost.join(", ") : "none";
  const body = $("members").tBodies[0];
  body.replaceChildren(...c.nodes.map((n) => {
    const role = [n.id === c.leader ? "leader" : "", n.member ? "member" : "spare",
      (c.data_lost || []).includes(n.id) ? "data lost" : ""].filter(Boolean).join(", ");
    return el("tr", { "data-node": n.id, "data-state": n.state },
      el("td", {}, n.id),
      el("td", { class: `state state-${n.state}` }, n.state),
      el("td", {}, role),
      el("td", {}, n.http));
  }));
  $("members").dataset.ready = "true";
}

function renderStats(s) {
  $("node").textContent = `node ${s.node}`;
  $("incr-rate").textContent = fmtNum(s.increment_rate);
  $("read-cached").textContent = `${fmtUs(s.reads.cached.p50_us)} / ${fmtUs(s.reads.cached.p99_us)}`;
  $("read-fresh").textContent = `${fmtUs(s.reads.fresh.p50_us)} / ${fmtUs(s.reads.fresh.p99_us)}`;
  const body = $("busiest").tBodies[0];
  body.replaceChildren(...s.counters.map((c) => {
    const tr = el("tr", { class: "pick" + (c.name === current(s) ? " selected" : ""), "data-counter": c.name },
      el("td", {}, c.name),
      el("td", { class: "num" }, fmtNum(c.write_rate)),
      el("td", { class: "num", title: c.error || "" }, c.value === null ? "unavailable" : fmtNum(c.value)),
      el("td", { class: "num" }, fmtMs(c.staleness_ms)),
      el("td", { class: "num" }, c.skew.toFixed(2)),
      el("td", { class: "num" }, c.drift === null ? "–" : fmtNum(c.drift)));
    tr.addEventListener("click", () => { chosen = c.name; $("counter").value = c.name; poll(); });
    return tr;
  }));
  if (!s.counters.length) body.append(el("tr", {}, el("td", { colSpan: 6, class: "muted" }, "no writes through this node yet")));
  $("counter-names").replaceChildren(...s.counters.map((c) => el("option", { value: c.name })));
  $("busiest").dataset.ready = "true";
}

function current(stats) {
  if (chosen) return chosen;
  return stats && stats.counters.length ? stats.counters[0].name : "";
}

function renderHeatmap(name, report, nodes) {
  const now = Date.now();
  const writes = new Map(report.shards.map((s) => [s.index, s.writes]));
  // Rate since the previous poll of the same counter; the first poll shows total writes.
  let heat = writes;
  if (lastShards && lastShards.name === name && now > lastShards.at) {
    const secs = (now - lastShards.at) / 1000;
    heat = new Map([...writes].map(([i, w]) => [i, Math.max(0, w - (lastShards.writes.get(i) || 0)) / secs]));
  }
  lastShards = { name, at: now, writes };
  // No write reached any shard since the last poll: show where the writes went so far.
  if (Math.max(0, ...heat.values()) === 0) heat = writes;
  const max = Math.max(0, ...heat.values());
  const owners = [...new Set([...nodes, ...report.shards.map((s) => s.node)])];
  const grid = $("heatmap");
  grid.style.gridTemplateColumns = `max-content repeat(${report.shards.length}, minmax(14px, 1fr))`;
  const cells = [el("div", {}, "")];
  for (const s of report.shards) cells.push(el("div", { class: "col-label" }, report.shards.length > 32 && s.index % 8 ? "" : s.index));
  for (const node of owners) {
    cells.push(el("div", { class: "row-label" }, node));
    for (const s of report.shards) {
      if (s.node !== node) { cells.push(el("div", { class: "cell empty" })); continue; }
      const h = heat.get(s.index) || 0;
      const alpha = max > 0 ? 0.15 + 0.85 * (h / max) : 0.15;
      const cell = el("div", { class: "cell", "data-shard": s.index, "data-node": s.node, "data-value": s.value,
        title: `shard ${s.index} on ${s.node}: value ${s.value}, ${fmtNum(h)} ${heat === writes ? "writes" : "writes/s"}` });
      cell.style.background = `rgba(var(--heat), ${alpha.toFixed(3)})`;
      cells.push(cell);
    }
  }
  grid.replaceChildren(...cells);
  grid.dataset.counter = name;
  grid.dataset.shards = report.shards.length;
  grid.dataset.ready = "true";
  $("skew").textContent = report.skew.toFixed(2);
}

function showError(e) {
  const p = $("error");
  if (e) { p.textContent = String(e.message || e); p.hidden = false; } else { p.hidden = true; }
}

let polling = false;
async function poll() {
  if (polling) return;
  polling = true;
  try {
    const [cluster, stats] = await Promise.all([getJson("/v1/cluster"), getJson(`/v1/stats?limit=${STATS_LIMIT}`)]);
    renderCluster(cluster);
    renderStats(stats);
    const name = current(stats);
    if (name) {
      const report = await getJson(`/v1/counters/${encodeURIComponent(name)}/shards`);
      renderHeatmap(name, report, cluster.nodes.filter((n) => n.member).map((n) => n.id));
    }
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    // For checks of narrow screens: whether the page is wider than the window.
    document.documentElement.dataset.overflowX = String(document.documentElement.scrollWidth > window.innerWidth);
    showError(null);
  } catch (e) {
    showError(e);
  } finally {
    polling = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const params = new URLSearchParams(location.search);
  chosen = params.get("counter") || "";
  $("counter").value = chosen;
  $("pick").addEventListener("submit", (e) => { e.preventDefault(); chosen = $("counter").value.trim(); poll(); });
  $("counter").addEventListener("change", () => { chosen = $("counter").value.trim(); poll(); });
  $("auth").addEventListener("submit", (e) => {
    e.preventDefault();
    const token = $("token").value.trim();
    if (token) sessionStorage.setItem(TOKEN_KEY, token); else sessionStorage.removeItem(TOKEN_KEY);
    $("token").value = "";
    $("auth").hidden = true;
    poll();
  });
  poll();
  setInterval(poll, POLL_MS);
});
