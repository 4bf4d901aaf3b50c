// The comparison page. Plain JavaScript over one data document (trainyard.report.data):
// no framework and no network, so the file works from file:// with the network off. The
// curves and lanes are drawn in charts.js, inlined after this file as one script.
"use strict";

const PAGE_SIZE = 50; // rows painted at once: 2,000 runs stay fast
const MAX_LANE_RUNS = 4; // one figure per selected run that has lanes (charts.js)
const LIVE_MS = 2000; // served by `trainyard ui`: fetch /data.json this often while a run runs
// Losses and errors fall by orders of magnitude: on a linear axis every epoch after the
// first is a flat line near 0. These are drawn on a log axis unless the reader says not.
const LOG_METRICS = new Set(["loss", "mse", "mae", "perplexity"]);
const LOG_KEY = "trainyard.logLosses";
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2",
  "#ca8a04", "#db2777", "#4b5563", "#65a30d"];

let DATA = JSON.parse(document.getElementById("trainyard-data").textContent);
const state = { view: "runs", sort: "created_at", desc: true, filter: "", page: 0,
  selected: [], sweep: DATA.selected_sweep, onlyDiff: false, logLosses: rememberedLog() };

// --- helpers -------------------------------------------------------------

const $ = (id) => document.getElementById(id);
const esc = (v) => String(v ?? "").replace(/[&<>"']/g,
  (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
// Every value from the data document reaches markup through `html`: each interpolation is
// escaped unless it is itself an `html` result (or a list of them), so no text from a record,
// sweep or registry document can become an element, attribute or script. innerHTML is only
// ever set through `setHtml`, which takes nothing else.
class Html { constructor(text) { this.text = text; } }
const piece = (v) => (v instanceof Html ? v.text : Array.isArray(v) ? v.map(piece).join("") : esc(v));
const html = (strings, ...values) => new Html(strings.reduce((out, s, i) => out + piece(values[i - 1]) + s));
const setHtml = (el, markup) => { el.innerHTML = piece(markup); };
// Plotly draws names, labels and notes as its own small HTML (<b>, <a href>, ...): text
// from the data goes in with its markup characters as entities, which Plotly shows as text.
const plotText = (v) => String(v ?? "").replace(/[&<>]/g,
  (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;" })[c]);
const short = (md5) => (md5 ? md5.slice(0, 8) : "");
const fmt = (v) => (typeof v === "number" && !Number.isInteger(v) ? v.toPrecision(5) :
  typeof v === "object" && v !== null ? JSON.stringify(v) : v ?? "");
const runsById = () => new Map(DATA.runs.map((r) => [r.run_id, r]));
const sweepLabel = (r) => (r.sweep_id ? `${r.sweep_id}#${r.trial}` : "");
const monitorText = (m) => (m ? `${m.name} ${fmt(m.value)}` : "");
const statusBadge = (s) => html`<span class="status status-${s}">${s}</span>`;
const runStatus = (r) => html`${statusBadge(r.status)}${r.progress ? html` <span class="hint">${r.progress}</span>` : ""}`;
const running = () => DATA.runs.some((r) => r.status === "running");

// The log-scale choice outlives the page (localStorage; a browser that refuses it for
// file:// pages just gets the default each time).
function rememberedLog() {
  try { return localStorage.getItem(LOG_KEY) !== "false"; } catch { return true; }
}

function rememberLog(on) {
  state.logLosses = on;
  try { localStorage.setItem(LOG_KEY, String(on)); } catch { /* not remembered */ }
}

// Plotly's 4.8 MB of JavaScript ship as text and are compiled after the first paint, or
// as soon as a chart is wanted: the runs table shows without waiting for them.
function ensurePlotly() {
  if (window.Plotly) return;
  const code = document.createElement("script");
  code.textContent = $("plotly-src").textContent;
  document.head.appendChild(code); // an inline script runs as it is inserted
}

function sortKey(run, key) {
  if (key === "monitor") return run.monitor ? run.monitor.value : null;
  if (key === "sweep") return sweepLabel(run);
  return run[key];
}

function compare(a, b) {
  if (a === b) return 0;
  if (a === null || a === undefined || a === "") return 1; // blanks last either way
  if (b === null || b === undefined || b === "") return -1;
  return a < b ? -1 : 1;
}

// --- runs table ------------------------------------------------------------

function visibleRuns() {
  const words = state.filter.toLowerCase().split(/\s+/).filter(Boolean);
  const rows = DATA.runs.filter((r) => {
    const text = [r.run_id, r.status, r.task, r.model, r.dataset_md5, sweepLabel(r),
      r.code_commit].join(" ").toLowerCase();
    return words.every((w) => text.includes(w));
  });
  const sign = state.desc ? -1 : 1;
  rows.sort((a, b) => {
    const ka = sortKey(a, state.sort), kb = sortKey(b, state.sort);
    const blank = (k) => k === null || k === undefined || k === "";
    if (blank(ka) || blank(kb)) return compare(ka, kb);
    return sign * compare(ka, kb);
  });
  return rows;
}

function runRowHtml(r) {
  const on = state.selected.includes(r.run_id);
  return html`<tr class="${on ? "selected" : ""}" data-run="${r.run_id}">
    <td><input type="checkbox" class="pick" data-run="${r.run_id}" ${on ? html`checked` : ""}
      aria-label="select ${r.run_id}"></td>
    <td class="mono run-id">${r.run_id}</td><td>${runStatus(r)}</td>
    <td>${r.task}</td><td>${r.model}</td>
    <td class="mono" title="${r.dataset_md5}">${short(r.dataset_md5)}</td>
    <td class="mono">${sweepLabel(r)}</td><td>${r.created_at}</td>
    <td class="num">${monitorText(r.monitor)}</td></tr>`;
}

function renderRuns() {
  const rows = visibleRuns();
  const pages = Math.max(1, Math.ceil(rows.length / PAGE_SIZE));
  state.page = Math.min(state.page, pages - 1);
  const start = state.page * PAGE_SIZE;
  const shown = rows.slice(start, start + PAGE_SIZE);
  setHtml(document.querySelector("#runs-table tbody"), shown.map(runRowHtml));
  $("page-info").textContent = rows.length
    ? `runs ${start + 1}–${start + shown.length} of ${rows.length} (page ${state.page + 1} of ${pages})`
    : "no runs match";
  $("prev-page").disabled = state.page === 0;
  $("next-page").disabled = state.page >= pages - 1;
  document.querySelectorAll("#runs-table th[data-sort]").forEach((th) => {
    th.classList.toggle("sorted-asc", th.dataset.sort === state.sort && !state.desc);
    th.classList.toggle("sorted-desc", th.dataset.sort === state.sort && state.desc);
  });
  renderSelection();
}

function renderSelection() {
  const n = state.selected.length;
  $("selection").textContent = n ? `${n} selected: ${state.selected.join(", ")}` +
    (n >= 2 ? " (Compare shows the first two)" : "") : "no runs selected";
}

function toggleRun(runId, on) {
  state.selected = state.selected.filter((id) => id !== runId);
  if (on) state.selected.push(runId);
  renderRuns();
  drawSelected();
}

function drawSelected() {
  drawCurves();
  drawLanes();
}

// --- compare two runs ------------------------------------------------------

function compareRows(a, b) {
  const keys = (x, y) => [...new Set([...Object.keys(x), ...Object.keys(y)])].sort();
  const rows = [["group", "run"],
    ["status", a.status, b.status], ["created", a.created_at, b.created_at],
    ["dataset", a.dataset_path, b.dataset_path], ["dataset md5", a.dataset_md5, b.dataset_md5],
    ["code commit", a.code_commit, b.code_commit], ["code dirty", a.code_dirty, b.code_dirty],
    ["sweep", sweepLabel(a), sweepLabel(b)], ["workers", a.world_size, b.world_size],
    ["nodes", a.nodes, b.nodes],
    ["monitored", monitorText(a.monitor), monitorText(b.monitor)], ["group", "metrics"]];
  keys(a.metrics, b.metrics).forEach((k) => rows.push([k, a.metrics[k], b.metrics[k]]));
  rows.push(["group", "params"]);
  keys(a.params, b.params).forEach((k) => rows.push([k, a.params[k], b.params[k]]));
  return rows;
}

function renderCompare() {
  const byId = runsById();
  const [a, b] = state.selected.map((id) => byId.get(id)).filter(Boolean);
  $("compare-note").textContent = b ? "" : "Select two runs in the Runs table to compare them.";
  if (!b) { setHtml($("compare-table"), ""); return; }
  const same = (x, y) => JSON.stringify(x ?? null) === JSON.stringify(y ?? null);
  const body = compareRows(a, b).map(([name, x, y]) => {
    if (name === "group") return html`<tr class="group"><td colspan="3">${x}</td></tr>`;
    const differs = !same(x, y);
    if (state.onlyDiff && !differs) return "";
    return html`<tr class="${differs ? "diff" : ""}"><td class="mono">${name}</td>
      <td class="value">${fmt(x)}</td><td class="value">${fmt(y)}</td></tr>`;
  });
  setHtml($("compare-table"), html`<thead><tr><th></th><th class="mono">${a.run_id}</th>
    <th class="mono">${b.run_id}</th></tr></thead><tbody>${body}</tbody>`);
}

// --- registry ----------------------------------------------------------------

function evidenceText(e) {
  const values = e.metric ? ` ${e.metric} ${fmt(e.from_value)} → ${fmt(e.to_value)}` : "";
  const detail = Object.keys(e.detail || {}).length ? ` ${JSON.stringify(e.detail)}` : "";
  return `${e.rule}${values}${detail}`;
}

function modelHtml(m) {
  const aliasesOf = (v) => Object.entries(m.aliases).filter(([, n]) => n === v)
    .map(([a]) => html`<span class="alias">${a}</span>`);
  const versions = m.versions.slice().reverse().map((v) => html`<tr><td class="num">v${v.version}</td>
    <td>${aliasesOf(v.version)}</td><td class="mono">${v.run_id}</td>
    <td class="num">${monitorText(v.monitor)}</td><td class="mono">${short(v.dataset_md5)}</td>
    <td class="mono">${short(v.code_commit)}</td><td>${v.created_at}</td>
    <td>${v.registered_by}</td></tr>`);
  const history = m.history.slice().reverse().map((h) => html`<tr><td class="num">${h.seq}</td>
    <td>${h.at}</td><td><span class="alias">${h.alias}</span></td><td>${h.action}</td>
    <td>${h.from_version ? "v" + h.from_version : "–"} → v${h.to_version}</td><td>${h.by}</td>
    <td>${evidenceText(h.evidence)}</td></tr>`);
  const aliases = Object.entries(m.aliases).map(([a, v]) => html`<span class="alias">${a} → v${v}</span>`);
  return html`<div class="model"><h2>${m.name} ${aliases}</h2>
    <table class="grid"><thead><tr><th>version</th><th>aliases</th><th>run id</th><th>monitored</th>
    <th>dataset md5</th><th>code</th><th>registered</th><th>by</th></tr></thead><tbody>${versions}</tbody></table>
    <h2>Promotion history <small>newest first</small></h2>
    <table class="grid"><thead><tr><th>#</th><th>at</th><th>alias</th><th>action</th><th>change</th>
    <th>by</th><th>evidence</th></tr></thead><tbody>${history.length ? history :
      html`<tr><td colspan="7" class="hint">no alias changes yet</td></tr>`}</tbody></table></div>`;
}

function renderRegistry() {
  setHtml($("view-registry"), DATA.models.length ? DATA.models.map(modelHtml)
    : html`<p class="hint">No registered models (<code>trainyard models register RUN_ID</code>).</p>`);
}

// --- sweeps --------------------------------------------------------------------

function parcoordsDimension(name, values) {
  if (values.every((v) => typeof v === "number")) return { label: plotText(name), values };
  const levels = [...new Set(values.map(String))].sort();
  return { label: plotText(name), values: values.map((v) => levels.indexOf(String(v))),
    tickvals: levels.map((_, i) => i), ticktext: levels.map(plotText) };
}

function drawParcoords(sweep) {
  const done = sweep.trials.filter((t) => t.value !== null);
  const names = [...new Set(done.flatMap((t) => Object.keys(t.params)))].sort();
  ensurePlotly();
  if (!done.length) { Plotly.purge($("sweep-parcoords")); return; }
  const values = done.map((t) => t.value);
  const dims = names.map((n) => parcoordsDimension(n, done.map((t) => t.params[n] ?? "")));
  dims.push({ label: plotText(sweep.objective), values });
  Plotly.react($("sweep-parcoords"), [{ type: "parcoords", dimensions: dims,
    line: { color: values, colorscale: "Viridis", showscale: true,
      reversescale: sweep.direction === "minimize" } }],
  { height: 380, margin: { t: 50, l: 60, r: 60, b: 30 } }, { displaylogo: false, responsive: true });
}

function renderSweeps() {
  const select = $("sweep-select");
  const sweeps = DATA.sweeps;
  if (!sweeps.length) {
    setHtml($("sweep-summary"), html`<p class="hint">No sweeps (<code>trainyard sweep run</code>).</p>`);
    return;
  }
  setHtml(select, sweeps.map((s) => html`<option value="${s.sweep_id}">${s.sweep_id}</option>`));
  const sweep = sweeps.find((s) => s.sweep_id === state.sweep) || sweeps[0];
  state.sweep = select.value = sweep.sweep_id;
  const counts = Object.entries(sweep.counts).filter(([, n]) => n).map(([k, n]) => `${n} ${k.toLowerCase()}`);
  const best = sweep.best ? `best: trial ${sweep.best.trial}, ${sweep.objective} ${fmt(sweep.best.value)} (run ${sweep.best.run_id})` : "no completed trial yet";
  setHtml($("sweep-summary"), html`<p>${sweep.direction} <b>${sweep.objective}</b> on dataset
    <span class="mono">${short(sweep.dataset_md5)}</span> · ${counts.join(", ")} · ${best}</p>
    ${sweep.error ? html`<p class="error">${sweep.error}</p>` : ""}`);
  const names = [...new Set(sweep.trials.flatMap((t) => Object.keys(t.params)))].sort();
  setHtml($("sweep-trials"), html`<thead><tr><th>trial</th><th>state</th><th class="num">${sweep.objective}</th>
    <th>run id</th>${names.map((n) => html`<th>${n}</th>`)}<th>last epoch</th><th>duration s</th></tr></thead>
    <tbody>${sweep.trials.map((t) => html`<tr><td class="num">${t.number}</td><td>${statusBadge(String(t.state).toLowerCase())}</td>
    <td class="num">${fmt(t.value)}</td><td class="mono">${t.run_id}</td>
    ${names.map((n) => html`<td>${fmt(t.params[n])}</td>`)}
    <td class="num">${t.last_epoch}</td><td class="num">${t.duration_s}</td></tr>`)}</tbody>`);
  drawParcoords(sweep);
}

// --- views, events, live refresh ------------------------------------------------

const RENDER = { runs: () => { renderRuns(); drawSelected(); }, compare: renderCompare,
  registry: renderRegistry, sweeps: renderSweeps };

function show(view) {
  state.view = view;
  document.querySelectorAll("#tabs button").forEach((b) => b.classList.toggle("active", b.dataset.view === view));
  document.querySelectorAll(".view").forEach((s) => { s.hidden = s.id !== `view-${view}`; });
  RENDER[view]();
}

function renderMeta() {
  const following = location.protocol.startsWith("http") && running()
    ? ` · following running runs every ${LIVE_MS / 1000} s` : "";
  $("meta").textContent = `${DATA.runs.length} runs · ${DATA.where} · built ${DATA.generated_at}${following}`;
  // Damaged documents are left out of the views; the count says so, the tooltip says which.
  const skipped = DATA.skipped || [];
  $("skipped").hidden = !skipped.length;
  $("skipped").textContent = `${skipped.length} unreadable document${skipped.length === 1 ? "" : "s"} skipped`;
  $("skipped").title = skipped.map((d) => `${d.uri}: ${d.reason}`).join("\n");
}

function bindEvents() {
  $("tabs").addEventListener("click", (e) => e.target.dataset.view && show(e.target.dataset.view));
  $("filter").addEventListener("input", (e) => { state.filter = e.target.value; state.page = 0; renderRuns(); });
  $("prev-page").addEventListener("click", () => { state.page -= 1; renderRuns(); });
  $("next-page").addEventListener("click", () => { state.page += 1; renderRuns(); });
  $("clear-selection").addEventListener("click", () => { state.selected = []; renderRuns(); drawSelected(); });
  document.querySelector("#runs-table thead").addEventListener("click", (e) => {
    const key = e.target.dataset.sort;
    if (!key) return;
    state.desc = state.sort === key ? !state.desc : key === "created_at";
    state.sort = key;
    renderRuns();
  });
  document.querySelector("#runs-table tbody").addEventListener("change", (e) => {
    if (e.target.classList.contains("pick")) toggleRun(e.target.dataset.run, e.target.checked);
  });
  $("only-diff").addEventListener("change", (e) => { state.onlyDiff = e.target.checked; renderCompare(); });
  $("sweep-select").addEventListener("change", (e) => { state.sweep = e.target.value; renderSweeps(); });
  $("log-losses").checked = state.logLosses;
  $("log-losses").addEventListener("change", (e) => { rememberLog(e.target.checked); drawCurves(); });
}

// Served by `trainyard ui`: fetch the document again so running runs update in place, every
// LIVE_MS while a run is running and the page is in view; otherwise once each time the page
// comes back into view (a run started meanwhile shows then). From file:// there is nothing
// to fetch; the page is the snapshot it was built as.
const live = { last: "", timer: null, busy: false };

async function refresh() {
  if (live.busy) return;
  live.busy = true;
  try {
    const fresh = await (await fetch("data.json", { cache: "no-store" })).json();
    const text = JSON.stringify({ ...fresh, generated_at: null });
    DATA = fresh;
    renderMeta();
    if (text !== live.last) { live.last = text; RENDER[state.view](); }
  } catch (err) {
    $("meta").textContent = `refresh failed (${err}); showing the last data`;
  } finally {
    live.busy = false;
  }
  planRefresh();
}

// The next fetch is planned when this one ends: a slow store never piles requests up.
function planRefresh() {
  clearTimeout(live.timer);
  live.timer = running() && !document.hidden ? setTimeout(refresh, LIVE_MS) : null;
}

function liveRefresh() {
  if (!location.protocol.startsWith("http")) return;
  live.last = JSON.stringify({ ...DATA, generated_at: null });
  const back = () => { if (!document.hidden && !live.timer) refresh(); };
  document.addEventListener("visibilitychange", back);
  window.addEventListener("focus", back);
  planRefresh();
}

// A link opens the page on given runs or a sweep: #runs=ID,ID (selected, their curves
// drawn) or #sweep=ID; what a run's and a sweep's Prefect artifacts link to.
function viewFromHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  const known = runsById();
  // `trainyard report A B` and `trainyard ui A B` open on A and B; a link's #runs= wins.
  const wanted = params.has("runs") ? params.get("runs").split(",") : DATA.selected_runs || [];
  state.selected = wanted.filter((id) => known.has(id));
  if (params.get("sweep")) {
    state.sweep = params.get("sweep");
    return "sweeps";
  }
  return "runs";
}

bindEvents();
renderMeta();
show(viewFromHash());
performance.mark("trainyard-first-render");
requestAnimationFrame(() => setTimeout(ensurePlotly, 0)); // after that frame is painted
liveRefresh();
