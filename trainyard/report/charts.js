// The comparison page's charts, drawn with Plotly: each selected run's curves and its
// per-rank lanes. Function declarations only: inlined after page.js in the same script
// (page.py), whose data, state and views call them.

// --- curves ----------------------------------------------------------------

function curveMetrics(runs) {
  const names = new Set();
  runs.forEach((r) => Object.keys(r.curves).forEach((k) => k !== "epoch" && names.add(k)));
  // Losses first, then the rest; train before val within a metric.
  const metric = (k) => k.replace(/^(train|val)_/, "");
  return [...names].sort((a, b) => compare(metric(a) !== "loss", metric(b) !== "loss") ||
    compare(metric(a), metric(b)) || compare(a, b));
}

// A loss's axis is logarithmic when asked for and when every value drawn on it is above 0
// (a log axis would drop the rest without a word).
function logAxis(name, runs) {
  if (!state.logLosses || !LOG_METRICS.has(name.replace(/^(train|val)_/, ""))) return false;
  const values = runs.flatMap((r) => r.curves[name] || []).filter((v) => v !== null);
  return values.length > 0 && values.every((v) => v > 0);
}

function curveLayout(metrics, runs) {
  const cols = metrics.length > 1 ? 2 : 1, rows = Math.ceil(metrics.length / cols);
  // uirevision: a zoom survives the live refresh, and is reset when the scale changes.
  const layout = { height: Math.max(320, 260 * rows), margin: { t: 30, l: 60, r: 20, b: 40 },
    showlegend: false, annotations: [], uirevision: `log-${state.logLosses}` };
  metrics.forEach((name, i) => {
    const col = i % cols, row = Math.floor(i / cols), n = i ? i + 1 : "";
    const x = [col / cols + 0.04, (col + 1) / cols - 0.04];
    const y = [1 - (row + 1) / rows + 0.1, 1 - row / rows - 0.04];
    const bottom = i + cols >= metrics.length; // the x title only under the last row
    layout[`xaxis${n}`] = { domain: x, anchor: `y${n}`, title: { text: bottom ? "epoch" : "" } };
    const log = logAxis(name, runs);
    layout[`yaxis${n}`] = { domain: y, anchor: `x${n}`, type: log ? "log" : "linear" };
    layout.annotations.push({ text: plotText(log ? `${name} (log)` : name),
      x: (x[0] + x[1]) / 2, y: y[1] + 0.03, xref: "paper", yref: "paper", showarrow: false,
      font: { size: 13 } });
  });
  return layout;
}

function drawCurves() {
  const byId = runsById();
  const runs = state.selected.map((id) => byId.get(id)).filter(Boolean);
  const metrics = curveMetrics(runs);
  $("curves-empty").hidden = metrics.length > 0;
  $("curves-empty").textContent = curvesEmptyText(runs);
  if (!metrics.length) {
    if (window.Plotly) Plotly.purge($("curves-plot"));
    setHtml($("curves-legend"), "");
    return;
  }
  const traces = [];
  runs.forEach((run, r) => metrics.forEach((name, i) => {
    if (!run.curves[name]) return;
    const n = i ? i + 1 : "";
    traces.push({ type: "scatter", mode: "lines+markers", x: run.curves.epoch,
      y: run.curves[name], name: plotText(`${run.run_id} ${name}`), legendgroup: run.run_id,
      xaxis: `x${n}`, yaxis: `y${n}`,
      line: { color: COLORS[r % COLORS.length], dash: name.startsWith("train_") ? "dot" : "solid" } });
  }));
  // Plotly's legend would list every run × metric: one entry per run says more.
  setHtml($("curves-legend"), html`${runs.map((run, r) => html`<span class="swatch"
    style="border-color:${COLORS[r % COLORS.length]}"></span><span class="mono">${run.run_id}</span> `)}
    <span class="hint">· dotted: train, solid: val</span>`);
  ensurePlotly();
  Plotly.react($("curves-plot"), traces, curveLayout(metrics, runs),
    { displaylogo: false, responsive: true });
}

function curvesEmptyText(runs) {
  if (!runs.length) return "Tick runs in the table to overlay their train and val curves.";
  const going = runs.filter((r) => r.status === "running").map((r) => r.run_id);
  if (going.length) {
    return `${going.join(", ")}: running; curves appear here as epochs end (or when it ` +
      "finishes, for a run whose first worker trains on another machine).";
  }
  return "The selected runs have no per-epoch curves.";
}

// --- per-rank lanes ----------------------------------------------------------

function laneTraces(lanes) {
  const traces = [];
  lanes.own_step_ms[0].forEach((_, r) => {
    const line = { color: COLORS[r % COLORS.length] };
    const name = `rank ${r}`;
    traces.push({ type: "scatter", mode: "lines", x: lanes.steps, name, legendgroup: name,
      y: lanes.own_step_ms.map((w) => w[r]), line });
    traces.push({ type: "scatter", mode: "lines", x: lanes.steps, name, legendgroup: name,
      y: lanes.data_wait_ms.map((w) => w[r]), line, showlegend: false, xaxis: "x2", yaxis: "y2" });
  });
  return traces;
}

// Stragglers shaded over their slow windows, resumes as dashed lines, on both lanes.
function laneMarks(run) {
  const shapes = [];
  const annotations = [];
  // Straggler notes above the lanes, resume notes just inside them: they never overlap.
  const mark = (x, text, color, yanchor) => annotations.push({ xref: "x", yref: "paper", x,
    y: 1, xanchor: "left", yanchor, text: plotText(text), showarrow: false, font: { color, size: 11 },
    bgcolor: "rgba(255,255,255,0.8)" });
  run.stragglers.forEach((s) => {
    shapes.push({ type: "rect", xref: "x", yref: "paper", x0: s.first_step, x1: s.last_step,
      y0: 0, y1: 1, fillcolor: "#dc2626", opacity: 0.12, line: { width: 0 } });
    mark(s.first_step, `straggler: rank ${s.rank}, ${s.slowdown}× the others`, "#dc2626", "bottom");
  });
  run.resumes.forEach((e) => {
    shapes.push({ type: "line", xref: "x", yref: "paper", x0: e.step, x1: e.step, y0: 0, y1: 1,
      line: { color: "#4b5563", dash: "dash", width: 1 } });
    mark(e.step, e.label, "#4b5563", "top");
  });
  return { shapes, annotations };
}

function laneLayout(run) {
  return { height: 380, margin: { t: 30, l: 64, r: 16, b: 40 }, ...laneMarks(run),
    xaxis: { anchor: "y", matches: "x2", showticklabels: false },
    xaxis2: { anchor: "y2", title: { text: "step" } },
    yaxis: { domain: [0.45, 1], title: { text: "own step, ms" }, rangemode: "tozero" },
    yaxis2: { domain: [0, 0.38], title: { text: "data wait, ms" }, rangemode: "tozero" } };
}

function drawLanes() {
  const byId = runsById();
  const runs = state.selected.map((id) => byId.get(id)).filter((r) => r && r.lanes)
    .slice(0, MAX_LANE_RUNS);
  $("lanes-empty").hidden = runs.length > 0;
  const holder = $("lanes-plots");
  if (window.Plotly) holder.querySelectorAll(".lane-plot").forEach((el) => Plotly.purge(el));
  setHtml(holder, runs.map((r) => html`<h3 class="mono">${r.run_id}</h3>
    <div class="lane-plot" data-run="${r.run_id}"></div>`));
  if (!runs.length) return;
  ensurePlotly();
  holder.querySelectorAll(".lane-plot").forEach((el, i) => {
    Plotly.react(el, laneTraces(runs[i].lanes), laneLayout(runs[i]),
      { displaylogo: false, responsive: true });
  });
}
