// The live page: polls /dashboard/data every second, keeps the last few minutes of points in
// the browser, and draws them with uPlot. `window.everystopDashboard` exposes the state (the
// browser test reads it).
"use strict";

const POLL_MS = 1000;
const KEEP_POINTS = 300;
const TIERS = ["0", "1", "2"];
const TIER_NAMES = { "0": "premium", "1": "standard", "2": "best-effort" };
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563",
                "#ca8a04", "#db2777", "#65a30d"];

const state = { updates: 0, errors: [], last: null, charts: {}, times: [] };
window.everystopDashboard = state;

let adminKey = null;
const fromHash = new URLSearchParams(location.hash.slice(1)).get("key");
if (fromHash) {
  sessionStorage.setItem("everystopAdminKey", fromHash);
  history.replaceState(null, "", location.pathname);  // keep the key out of the address bar
}
adminKey = sessionStorage.getItem("everystopAdminKey");

// -- what each chart plots: a function of (snapshot, previous snapshot, seconds between) ------
function percentilesBy(group, metric) {
  return (d) => {
    const out = [];
    const groups = d.window[group];
    const names = group === "by_tier" ? TIERS : Object.keys(groups).sort();
    for (const name of names) {
      const g = groups[name] || {};
      const label = group === "by_tier" ? `tier ${name}` : name;
      out.push([`${label} p50`, g[`${metric}_p50_s`] ?? null]);
      out.push([`${label} p99`, g[`${metric}_p99_s`] ?? null]);
    }
    return out;
  };
}

function counterRate(value) {
  return (d, prev, dt) => (prev && dt > 0 ? Math.max(0, (value(d) - value(prev)) / dt) : null);
}

const CHARTS = [
  { id: "throughput", title: "Throughput (tokens/s)", series: (d) => [
      ["prompt", d.window.prompt_tokens_per_s], ["generated", d.window.generation_tokens_per_s]] },
  { id: "tenant_tokens", title: "Generated tokens/s by tenant", series: (d) =>
      Object.entries(d.window.by_tenant).map(([t, g]) => [t, g.generation_tokens_per_s]) },
  { id: "ttft_tier", title: "TTFT by tier (s)", series: percentilesBy("by_tier", "ttft") },
  { id: "ttft_tenant", title: "TTFT by tenant (s)", series: percentilesBy("by_tenant", "ttft") },
  { id: "tpot_tier", title: "TPOT by tier (s)", series: percentilesBy("by_tier", "tpot") },
  { id: "tpot_tenant", title: "TPOT by tenant (s)", series: percentilesBy("by_tenant", "tpot") },
  { id: "itl_tier", title: "ITL by tier (s)", series: percentilesBy("by_tier", "itl") },
  { id: "itl_tenant", title: "ITL by tenant (s)", series: percentilesBy("by_tenant", "itl") },
  { id: "queue_tier", title: "Queue wait by tier (s)", series: (d) => {
      const out = percentilesBy("by_tier", "queue")(d);
      const g = d.guardrails;
      if (g) for (const t of TIERS) out.push([`tier ${t} guardrail p99`, g.queue_wait_p99_s[t] ?? null]);
      return out;
    } },
  { id: "scheduler", title: "Running / waiting / swapped", series: (d) => [
      ["running", d.engine.num_running], ["waiting", d.engine.num_waiting],
      ["swapped", d.engine.num_swapped]] },
  { id: "kv", title: "KV cache usage and watermark (fraction)", series: (d) => [
      ["usage", d.engine.kv_usage], ["watermark", d.engine.kv_watermark]] },
  { id: "preemptions", title: "Preemptions/s by strategy", series: (d, prev, dt) => [
      ["recompute", counterRate((x) => x.engine.preemptions.recompute)(d, prev, dt)],
      ["swap", counterRate((x) => x.engine.preemptions.swap)(d, prev, dt)]] },
  { id: "prefix", title: "Prefix-cache hit rate (tokens, since start)", series: (d) => [
      ["hit rate", d.engine.prefix_hit_rate]] },
  { id: "lora", title: "LoRA requests/s by adapter", series: (d, prev, dt) => {
      const r = Object.keys(d.lora.adapters).map((name) => [name, counterRate(
        (x) => (x.lora.adapters[name] ? x.lora.adapters[name].requests : 0))(d, prev, dt)]);
      return r.length ? r : [["none", 0]];
    } },
  { id: "rejected", title: "429s/s by reason", series: (d) => {
      const r = Object.entries(d.window.rejected_per_s);
      return r.length ? r : [["none", 0]];
    } },
  { id: "alerts", title: "Guardrail alerts (total)", series: (d) => {
      const totals = {};
      for (const a of (d.guardrails ? d.guardrails.alerts : [])) {
        totals[a.kind] = (totals[a.kind] || 0) + a.count;
      }
      const r = Object.entries(totals);
      return r.length ? r : [["none", 0]];
    } },
];

// -- charts -----------------------------------------------------------------------------------
function panel(spec) {
  const div = document.createElement("div");
  div.className = "panel";
  div.id = `panel-${spec.id}`;
  const now = document.createElement("div");
  now.className = "now";
  document.getElementById("charts").appendChild(div);
  return { div, now, plot: null, names: [], values: {} };
}

function build(chart, spec) {
  if (chart.plot) chart.plot.destroy();
  chart.div.replaceChildren();
  const width = Math.max(300, chart.div.clientWidth - 10);
  const series = [{}].concat(chart.names.map((name, i) => ({
    label: name, stroke: COLORS[i % COLORS.length], width: 1.5,
    dash: name.endsWith(" p50") ? [4, 3] : undefined, spanGaps: true,
  })));
  const data = [state.times].concat(chart.names.map((n) => chart.values[n]));
  chart.plot = new uPlot({ title: spec.title, width, height: 200, series,
                           scales: { x: { time: true } }, legend: { live: false } },
                         data, chart.div);
  chart.div.appendChild(chart.now);
}

function record(chart, spec, pairs) {
  const names = pairs.map((p) => p[0]);
  const n = state.times.length;
  for (const name of names) {
    if (!(name in chart.values)) chart.values[name] = new Array(n - 1).fill(null);
  }
  for (const name of Object.keys(chart.values)) {
    const pair = pairs.find((p) => p[0] === name);
    chart.values[name].push(pair ? pair[1] : null);
    if (chart.values[name].length > KEEP_POINTS) chart.values[name].shift();
  }
  const all = Object.keys(chart.values);
  if (all.join("\u0000") !== chart.names.join("\u0000")) {
    chart.names = all;
    build(chart, spec);
  } else {
    chart.plot.setData([state.times].concat(chart.names.map((x) => chart.values[x])));
  }
  chart.now.textContent = pairs.map(([k, v]) => `${k}: ${fmt(v)}`).join("  ·  ");
}

// -- tables -------------------------------------------------------------------------------------
function fmt(v, unit) {
  if (v === null || v === undefined) return "–";
  if (unit === "s") return v >= 1 ? `${v.toFixed(2)} s` : `${(v * 1000).toFixed(1)} ms`;
  if (Math.abs(v) >= 100) return v.toFixed(0);
  return Number.isInteger(v) ? String(v) : v.toFixed(3);
}

function cells(tr, values) {
  for (const [text, cls] of values) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    tr.appendChild(td);
  }
}

function renderRows(d) {
  const body = document.querySelector("#rows tbody");
  body.replaceChildren();
  for (const r of d.window.rows) {
    const tr = document.createElement("tr");
    tr.className = r.sla;
    tr.dataset.tenant = r.tenant;
    tr.dataset.tier = String(r.tier);
    tr.dataset.requests = String(r.requests);
    tr.dataset.ttftP99 = String(r.ttft_p99_s ?? "");
    cells(tr, [[r.tenant], [`${r.tier} ${TIER_NAMES[r.tier] || ""}`], [String(r.requests)],
               [fmt(r.requests_per_s)], [fmt(r.generation_tokens_per_s)],
               [fmt(r.ttft_p50_s, "s")], [fmt(r.ttft_p99_s, "s")], [fmt(r.tpot_p50_s, "s")],
               [fmt(r.tpot_p99_s, "s")], [fmt(r.itl_p50_s, "s")], [fmt(r.itl_p99_s, "s")],
               [fmt(r.queue_p50_s, "s")], [fmt(r.queue_p99_s, "s")],
               [`${r.sla} (${r.sla_s === null ? "no SLA" : fmt(r.sla_s, "s")})`, "sla"]]);
    body.appendChild(tr);
  }
  document.getElementById("window").textContent = String(d.window.window_s);
}

function renderAlerts(d) {
  const body = document.querySelector("#alerts tbody");
  body.replaceChildren();
  for (const a of (d.guardrails ? d.guardrails.alerts : [])) {
    const tr = document.createElement("tr");
    cells(tr, [[a.kind], [a.tier || "all"], [String(a.count)]]);
    body.appendChild(tr);
  }
}

function renderConfig(d) {
  const body = document.querySelector("#config tbody");
  body.replaceChildren();
  const snap = d.scheduler_config;
  if (!snap) return;
  document.getElementById("config-version").textContent = `version ${snap.version}`;
  for (const [k, v] of Object.entries(snap.config)) {
    const tr = document.createElement("tr");
    if (snap.adjustable.includes(k)) tr.className = "adjustable";
    cells(tr, [[k], [JSON.stringify(v)]]);
    body.appendChild(tr);
  }
  const hist = document.querySelector("#history tbody");
  hist.replaceChildren();
  for (const h of d.config_history.slice().reverse()) {
    const tr = document.createElement("tr");
    cells(tr, [[String(h.version)], [h.source], [new Date(h.updated_at * 1000).toLocaleTimeString()],
               [String(h.max_num_seqs)], [String(h.max_num_batched_tokens)], [String(h.chunk_size)],
               [fmt(h.kv_watermark_pct)], [String(h.max_queued_per_tenant)]]);
    hist.appendChild(tr);
  }
}

// -- polling ------------------------------------------------------------------------------------
function askForKey(message) {
  const form = document.getElementById("keyform");
  form.hidden = false;
  document.getElementById("status").textContent = message;
  form.onsubmit = (ev) => {
    ev.preventDefault();
    adminKey = document.getElementById("keyinput").value;
    sessionStorage.setItem("everystopAdminKey", adminKey);
    form.hidden = true;
    poll();
  };
}

const charts = {};

function update(d) {
  const prev = state.last;
  const dt = prev ? d.time - prev.time : 0;
  state.times.push(d.time);
  if (state.times.length > KEEP_POINTS) state.times.shift();
  for (const spec of CHARTS) {
    if (!charts[spec.id]) charts[spec.id] = panel(spec);
    record(charts[spec.id], spec, spec.series(d, prev, dt));
    state.charts[spec.id] = { names: charts[spec.id].names, values: charts[spec.id].values };
  }
  renderRows(d);
  renderAlerts(d);
  renderConfig(d);
  document.getElementById("model").textContent = `${d.model_name} · everystop ${d.version}`;
  const status = document.getElementById("status");
  status.textContent = `updated ${new Date(d.time * 1000).toLocaleTimeString()}`;
  status.className = "";
  state.last = d;
  state.updates += 1;
}

async function poll() {
  try {
    const headers = adminKey ? { "X-Admin-Key": adminKey } : {};
    const r = await fetch("/dashboard/data", { headers, cache: "no-store" });
    if (r.status === 401) {
      askForKey(adminKey ? "wrong admin key" : "this server needs its admin key");
      return;
    }
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    update(await r.json());
  } catch (err) {
    state.errors.push(String(err));
    const status = document.getElementById("status");
    status.textContent = `no data: ${err}`;
    status.className = "stale";
  }
  setTimeout(poll, POLL_MS);
}

poll();
