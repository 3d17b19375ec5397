// kv-affinity-router console: polls /console/api/state and draws the heatmap, the hit-rate
// curve, the replica table and the events. No framework, no build step, nothing from elsewhere.
"use strict";

const TOKEN_KEY = "kvar-console-token";
const STATE_COLOURS = {
  removed: "#4a5562", left: "#4a5562", draining: "#b07cf0", warming: "#3ec5d6", recovering: "#6fcf70",
};
const RAMP = [[0x16, 0x26, 0x3a], [0x1f, 0x6f, 0x8b], [0x6c, 0xc0, 0x70], [0xf2, 0xb1, 0x34], [0xe5, 0x53, 0x3d]];
const COLUMNS = [
  ["id", (r) => r.id],
  ["state", (r) => r.state],
  // with prefill replicas (shown only then): prefill, decode or both
  ["role", (r) => r.role],
  // what it serves (from its /v1/models or the pins; "any": it does not say), and the adapters it has loaded
  ["models", (r) => (r.models ? r.models.join(", ") + (r.adapters && r.adapters.length ? " · loaded: " + r.adapters.join(", ") : "") : r.state === "left" ? null : "any")],
  ["score", (r) => r.score],
  ["weight", (r) => r.weight],
  ["ring_share", (r) => r.ring_share],
  ["inflight", (r) => r.inflight],
  ["qps", (r) => r.qps],
  ["hit", (r) => r.hit],
  ["ttft_p99", (r) => (typeof r.ttft_p99 === "string" ? Infinity : r.ttft_p99)],  // "> 300 s"
  ["waiting", (r) => r.inputs && r.inputs.waiting],
  ["kv_usage", (r) => r.inputs && r.inputs.kv_usage],
  ["fragmentation", (r) => r.inputs && r.inputs.fragmentation],
  ["latency_ratio", (r) => r.inputs && r.inputs.latency_ratio],
  ["error_rate", (r) => r.inputs && r.inputs.error_rate],
  // a decode replica's KV transfers from prefill replicas, as its engine reports them: mean time, failed
  ["transfer_ms", (r) => r.transfer_ms],
  ["failed_transfers", (r) => r.failed_transfers],
];
const ROLE_COLUMNS = ["role", "transfer_ms", "failed_transfers"];  // shown with prefill replicas only

const view = {
  points: [], events: [], replicas: [], since: 0, interval: 2, historyS: 900,
  metric: "inflight", picked: null, sort: { key: "id", dir: 1 }, waitingForToken: false,
  jumpWords: { groups: {}, reasons: {} },
};
window.consoleView = view;  // for the browser test and for the curious
window.consoleChart = { runs, pathData, ago };  // the drawing's pure parts, for the browser test

const $ = (selector) => document.querySelector(selector);

function authHeaders() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: "Bearer " + token } : {};
}

async function api(path) {
  const response = await fetch(path, { headers: authHeaders(), cache: "no-store" });
  if (response.status === 401) {
    askForToken();
    throw new Error("the admin token is needed");
  }
  const body = await response.json();
  if (!response.ok) {
    throw new Error((body.error && body.error.message) || response.statusText);
  }
  return body;
}

function askForToken() {
  view.waitingForToken = true;
  $("#token-form").hidden = false;
  $("main").hidden = true;
  $("#token").focus();
}

$("#token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("#token").value);
  $("#token").value = "";
  $("#token-form").hidden = true;
  $("main").hidden = false;
  view.waitingForToken = false;
  poll();
});

// -- data ----------------------------------------------------------------------------------------

let timer = null;
let polling = false;

async function poll() {
  clearTimeout(timer);
  if (polling) return;  // one poll at a time: a second would add the same points and events twice
  polling = true;
  try {
    const data = await api("/console/api/state?since=" + view.since);
    merge(data);
    render();
    $("#live").classList.add("ok");
    $("#live").title = "latest sample " + clock(view.since);
  } catch (error) {
    $("#live").classList.remove("ok");
    $("#summary").textContent = error.message;
  }
  polling = false;
  if (!view.waitingForToken) {
    timer = setTimeout(poll, view.interval * 1000);
  }
}

function merge(data) {
  view.interval = data.interval_s;
  view.historyS = data.history_s;
  view.replicas = data.replicas;
  view.policy = data.policy;
  view.worker = data.worker;
  view.jumpWords = data.jump_words;
  for (const p of data.points) {
    if (p.t > view.since) view.points.push(p);
  }
  // with worker processes, each keeps its own history (sampled at its own moments): the same
  // event may come from two of them, a sample apart; twins are the same event from two workers
  const near = 2 * view.interval + 0.5;
  for (const e of data.events) {
    e.worker = data.worker;
    const twin =
      data.worker !== null &&
      view.events.slice(-200).some(
        (x) => x.worker !== e.worker && x.kind === e.kind && x.text === e.text && Math.abs(x.t - e.t) <= near,
      );
    if (!twin) view.events.push(e);
  }
  if (view.points.length) view.since = view.points[view.points.length - 1].t;
  const oldest = data.now - view.historyS;
  while (view.points.length && view.points[0].t < oldest) view.points.shift();
  if (view.events.length > 300) view.events.splice(0, view.events.length - 300);
}

// -- drawing -------------------------------------------------------------------------------------

const SVG_NS = "http://www.w3.org/2000/svg";
const PLOT_H = 200;  // every curve's viewBox is 1000 x PLOT_H; PAD keeps a line at 0 or the top visible
const PAD = 2;
const JUMP_SCALES = [0.05, 0.1, 0.2, 0.5, 1];  // the jump chart's top: the first that holds every value

function render() {
  const last = view.points[view.points.length - 1];
  const routable = view.replicas.filter((r) => !["removed", "left", "draining"].includes(r.state)).length;
  $("#summary").textContent =
    `${view.policy} · ${routable}/${view.replicas.length} replicas routable` +
    (last ? ` · ${last.qps.toFixed(1)} req/s · ${last.inflight} in flight` : "") +
    (last && (last.queued || last.shed) ? ` · ${last.queued} held · ${last.shed.toFixed(1)} shed/s` : "") +
    (view.worker !== null && view.worker !== undefined ? ` · worker ${view.worker}` : "");
  drawHeatmap();
  drawCurve();
  drawJumps();
  drawTable();
  drawLegs(last);
  drawEvents();
}

// with prefill replicas: the split requests' legs (means over the last window) and the share split
function drawLegs(last) {
  const line = $("#legs");
  const legs = last && last.legs ? Object.entries(last.legs).filter(([, v]) => v !== null && v !== undefined) : [];
  const split = last ? last.split : null;
  line.hidden = !legs.length && (split === null || split === undefined);
  const ms = (v) => (v < 1 ? `${(v * 1000).toFixed(v < 0.01 ? 1 : 0)} ms` : `${v.toFixed(2)} s`);
  const order = ["prefill", "transfer", "decode"];
  legs.sort(([a], [b]) => order.indexOf(a) - order.indexOf(b));
  line.textContent =
    "split requests: " + (legs.length ? legs.map(([leg, v]) => `${leg} ${ms(v)}`).join(" · ") : "none lately") +
    (split !== null && split !== undefined ? ` · ${percent(split)} of requests split` : "");
}

function rampColour(x) {
  const t = Math.max(0, Math.min(1, x)) * (RAMP.length - 1);
  const i = Math.min(Math.floor(t), RAMP.length - 2);
  const f = t - i;
  const c = RAMP[i].map((v, k) => Math.round(v + (RAMP[i + 1][k] - v) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

function heatRows() {
  const ids = new Set(view.replicas.map((r) => r.id));
  for (const p of view.points) for (const id of Object.keys(p.replicas)) ids.add(id);
  return [...ids].sort();
}

// the window every chart shows: the latest sample and history_s before it
function timeWindow() {
  const last = view.points[view.points.length - 1];
  const t1 = last ? last.t : Date.now() / 1000;
  return { t0: t1 - view.historyS, t1, span: view.historyS };
}

function ago(seconds) {
  if (seconds <= 0) return "now";
  return seconds >= 120 ? `${Math.round(seconds / 60)} min ago` : `${Math.round(seconds)} s ago`;
}

// the time axis under a chart: history_s ago at the left edge, now at the right, two ticks between
function drawTimeAxis(axis) {
  const ticks = [0, 1, 2, 3].map((i) => {
    const span = document.createElement("span");
    span.textContent = ago(view.historyS * (1 - i / 3));
    span.style.left = (i / 3) * 100 + "%";
    return span;
  });
  axis.replaceChildren(...ticks);
}

function yOf(value, top) {
  return PLOT_H - PAD - (Math.min(value, top) / top) * (PLOT_H - 2 * PAD);
}

function tickText(value) {
  return +(value * 100).toFixed(1) + "%";
}

// the value axis beside a chart (its unit written along it, ticks where the grid lines are), and
// the grid lines themselves
function drawValueAxis(axis, svg, unit, ticks, top) {
  const title = document.createElement("span");
  title.className = "unit";
  title.textContent = unit;
  axis.replaceChildren(title, ...ticks.map((value) => {
    const span = document.createElement("span");
    span.className = "tick";
    span.textContent = tickText(value);
    span.style.top = (yOf(value, top) / PLOT_H) * 100 + "%";
    return span;
  }));
  svg.querySelector(".grid").replaceChildren(...ticks.filter((v) => v > 0 && v < top).map((value) => {
    const line = document.createElementNS(SVG_NS, "line");
    line.setAttribute("x1", 0);
    line.setAttribute("x2", 1000);
    line.setAttribute("y1", yOf(value, top));
    line.setAttribute("y2", yOf(value, top));
    return line;
  }));
}

// the stretches of a series a line may join: a point without a value (nothing to divide by: no
// requests in its window) ends one, and so do samples missing for longer than two intervals (the
// router was down, or the tab slept); a line never crosses either
function runs(points, value, interval) {
  const out = [];
  let run = null;
  let previous = null;
  for (const p of points) {
    const v = value(p);
    const missing = previous !== null && p.t - previous > 2.5 * interval;
    previous = p.t;
    if (typeof v !== "number") {
      run = null;
      continue;
    }
    if (run === null || missing) {
      run = [];
      out.push(run);
    }
    run.push([p.t, v]);
  }
  return out;
}

// SVG path data for those stretches: one subpath each (a lone point is drawn as a dot)
function pathData(stretches, t0, span, top) {
  return stretches
    .map((run) =>
      run
        .map(([t, v], i) => `${i ? "L" : "M"}${(((t - t0) / span) * 1000).toFixed(1)},${yOf(v, top).toFixed(1)}`)
        .join(" ") + (run.length === 1 ? " h0.5" : ""),
    )
    .join(" ");
}

function drawSeries(path, value, top) {
  const { t0, span } = timeWindow();
  const stretches = runs(view.points, value, view.interval);
  path.setAttribute("d", pathData(stretches, t0, span, top));
  path.dataset.runs = stretches.length;
  return stretches;
}

function drawHeatmap() {
  const canvas = $("#heatmap");
  const rows = heatRows();
  const rowH = rows.length > 24 ? Math.max(4, Math.floor(480 / rows.length)) : 18;
  const width = canvas.clientWidth || 800;
  canvas.width = width;
  canvas.height = Math.max(rows.length * rowH, 20);
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#0b1016";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  // each sample is a column at its own time (samples missing leave the background: no data)
  const { t0, span } = timeWindow();
  const cellW = (view.interval / span) * width;
  let max = 0;
  for (const p of view.points) for (const v of Object.values(p.replicas)) max = Math.max(max, v[view.metric] || 0);
  const scale = max > 0 ? max : 1;
  let painted = 0;
  for (const p of view.points) {
    const x = ((p.t - t0) / span) * width - cellW;
    if (x + cellW < 0) continue;
    rows.forEach((id, row) => {
      const cell = p.replicas[id];
      if (!cell) return;
      const y = row * rowH;
      const gone = cell.state === "removed" || cell.state === "left";
      ctx.fillStyle = gone ? STATE_COLOURS.removed : rampColour((cell[view.metric] || 0) / scale);
      ctx.fillRect(x, y, Math.ceil(cellW), rowH - 1);
      painted += 1;
      const mark = STATE_COLOURS[cell.state];
      if (mark && !gone) {
        ctx.fillStyle = mark;
        ctx.fillRect(x, y, Math.ceil(cellW), Math.max(2, Math.floor(rowH / 4)));
      }
    });
  }
  canvas.dataset.rows = rows.length;
  canvas.dataset.cells = painted;
  $("#heat-max").textContent = view.metric === "qps" ? `${max.toFixed(1)} req/s` : `${max} in flight`;
  const labels = $("#heat-labels");
  labels.replaceChildren(...rows.map((id) => {
    const span = document.createElement("span");
    span.textContent = id;
    span.style.height = span.style.lineHeight = rowH + "px";
    span.classList.toggle("picked", id === view.picked);
    span.addEventListener("click", () => pick(id));
    return span;
  }));
  drawTimeAxis($("#heat-axis"));
}

function drawCurve() {
  const svg = $("#hitcurve");
  const last = view.points[view.points.length - 1];
  const picked = view.picked;
  const fleet = drawSeries(svg.querySelector(".fleet"), (p) => p.hit, 1);
  drawSeries(svg.querySelector(".predicted"), (p) => p.predicted, 1);
  drawSeries(svg.querySelector(".replica"), (p) => (picked && p.replicas[picked] ? p.replicas[picked].hit : null), 1);
  svg.dataset.points = fleet.reduce((n, run) => n + run.length, 0);
  drawValueAxis($("#hit-y"), svg, "KV hit, % of prompt tokens", [0, 0.25, 0.5, 0.75, 1], 1);
  drawTimeAxis($("#hit-x"));
  const latest = [...view.points].reverse().find((p) => p.hit !== null && p.hit !== undefined);
  const guess = [...view.points].reverse().find((p) => p.predicted !== null && p.predicted !== undefined);
  const exact = last && last.exact ? Object.entries(last.exact).filter(([, v]) => v !== null && v !== undefined) : [];
  $("#hit-now").textContent =
    (latest ? `hit ${percent(latest.hit)}` : "no prompt tokens yet") +
    (last && latest !== last ? ` (${ago(last.t - latest.t)}; none since)` : "") +
    (guess ? ` · predicted ${percent(guess.predicted)} vs reported ${percent(guess.reported)}` : "") +
    (exact.length ? ` · predicted exactly: ${exact.map(([s, v]) => `${s} ${percent(v)}`).join(", ")}` : "");
  $("#selected-name").textContent = picked ? picked : "click a replica to add its curve";
}

// the jump rate, a line for each group of reasons (who moved the session), on a scale that fits
function drawJumps() {
  const svg = $("#jumpcurve");
  const groups = Object.keys(view.jumpWords.groups);
  const group = (p, g) => (p.jumps ? p.jumps[g] : null);
  let max = 0;
  for (const p of view.points) for (const g of groups) max = Math.max(max, group(p, g) || 0);
  const top = JUMP_SCALES.find((s) => s >= max) || 1;
  const lines = svg.querySelector(".lines");
  const paths = groups.map((g) => {
    let path = lines.querySelector(`path[data-group="${g}"]`);
    if (!path) {
      path = document.createElementNS(SVG_NS, "path");
      path.dataset.group = g;
      path.setAttribute("class", "jumps " + g);
      lines.append(path);
    }
    drawSeries(path, (p) => group(p, g), top);
    return path;
  });
  svg.dataset.top = top;
  drawValueAxis($("#jump-y"), svg, "% of follow-up requests", [0, top / 2, top], top);
  drawTimeAxis($("#jump-x"));
  // the legend: every group but `other`, which shows only while some reason has no words here
  const shown = groups.filter((g) => g !== "other" || view.points.some((p) => group(p, g)));
  $("#jump-legend").replaceChildren(...shown.flatMap((g) => {
    const mark = document.createElement("span");
    mark.className = "line jumps " + g;
    return [mark, document.createTextNode(view.jumpWords.groups[g])];
  }));
  paths.forEach((path, i) => (path.style.display = shown.includes(groups[i]) ? "" : "none"));
  const latest = [...view.points].reverse().find((p) => p.jump !== null && p.jump !== undefined);
  const why = $("#jump-why");
  if (!latest) {
    $("#jump-now").textContent = "no follow-up requests yet";
    why.replaceChildren();
    return;
  }
  const last = view.points[view.points.length - 1];
  $("#jump-now").textContent =
    `jumps ${percent(latest.jump)} of follow-up requests` + (latest !== last ? ` (${ago(last.t - latest.t)}; none since)` : "");
  // each reason that counted, biggest first, in words: who moved the session and why
  const reasons = Object.entries(latest.jump_reasons || {}).sort((a, b) => b[1] - a[1]);
  why.replaceChildren(...reasons.map(([reason, share]) => {
    const words = view.jumpWords.reasons[reason] || { group: "other", text: reason };
    const li = document.createElement("li");
    const mark = document.createElement("span");
    mark.className = "line jumps " + words.group;
    li.append(mark, document.createTextNode(
      `${percent(share)} ${view.jumpWords.groups[words.group] || words.group}: ${words.text} (${reason})`,
    ));
    return li;
  }));
  if (!reasons.length) {
    const li = document.createElement("li");
    li.className = "muted";
    li.textContent = "every follow-up request went where its session was served before";
    why.append(li);
  }
}

function drawTable() {
  const { key, dir } = view.sort;
  const getter = (COLUMNS.find(([name]) => name === key) || COLUMNS[0])[1];
  const rows = [...view.replicas].sort((a, b) => {
    const x = getter(a);
    const y = getter(b);
    if (x === y) return a.id < b.id ? -1 : 1;
    if (x === null || x === undefined) return 1;
    if (y === null || y === undefined) return -1;
    return (x < y ? -1 : 1) * dir;
  });
  const roles = view.replicas.some((r) => r.role && r.role !== "both");
  $("#replicas").classList.toggle("roles", roles);
  const body = $("#replicas tbody");
  body.replaceChildren(...rows.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.replica = r.id;
    tr.classList.toggle("picked", r.id === view.picked);
    tr.addEventListener("click", () => pick(r.id));
    for (const [name, get] of COLUMNS) {
      const td = document.createElement("td");
      const value = name === "ttft_p99" ? r.ttft_p99 : get(r);
      if (name === "state") {
        const badge = document.createElement("span");
        badge.className = "state " + r.state;
        badge.textContent = r.state === "left" ? "removed (left)" : r.state;
        td.append(badge);
      } else {
        td.textContent = format(name, value);
        if (!["id", "models", "role"].includes(name)) td.className = "num";
      }
      if (ROLE_COLUMNS.includes(name)) td.classList.add("by-role");
      tr.append(td);
    }
    return tr;
  }));
  for (const th of document.querySelectorAll("#replicas th")) {
    th.classList.toggle("sorted", th.dataset.key === key);
    th.classList.toggle("up", th.dataset.key === key && dir < 0);
  }
}

function format(name, value) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "string") return value;
  if (["hit", "ring_share", "kv_usage", "fragmentation", "error_rate"].includes(name)) return percent(value);
  if (name === "ttft_p99") return value < 1 ? `${Math.round(value * 1000)} ms` : `${value} s`;
  if (name === "qps" || name === "latency_ratio" || name === "transfer_ms") return value.toFixed(1);
  if (name === "score" || name === "weight") return value.toFixed(2);
  return String(value);
}

function percent(x) {
  return (x * 100).toFixed(1) + "%";
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

function drawEvents() {
  const list = $("#events");
  const shown = view.events.slice(-100).reverse();
  list.replaceChildren(...shown.map((e) => {
    const li = document.createElement("li");
    const time = document.createElement("time");
    time.textContent = clock(e.t);
    const kind = document.createElement("span");
    kind.className = "kind " + e.kind;
    kind.textContent = e.kind;
    li.append(time, kind, document.createTextNode(e.text));
    return li;
  }));
  if (!shown.length) {
    const li = document.createElement("li");
    li.className = "muted";
    li.textContent = "nothing yet: removals, returns, drains, migrations, spills and warm-ups show here";
    list.append(li);
  }
}

function pick(id) {
  view.picked = view.picked === id ? null : id;
  render();
}

// -- controls ------------------------------------------------------------------------------------

for (const input of document.querySelectorAll("input[name=metric]")) {
  input.addEventListener("change", () => {
    view.metric = input.value;
    drawHeatmap();
  });
}

for (const th of document.querySelectorAll("#replicas th")) {
  th.addEventListener("click", () => {
    const key = th.dataset.key;
    view.sort = { key, dir: view.sort.key === key ? -view.sort.dir : ["id", "state", "role", "models"].includes(key) ? 1 : -1 };
    drawTable();
  });
}

$("#key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const answer = $("#key-answer");
  const key = $("#key").value;
  if (!key) return;
  try {
    const r = await api("/console/api/route?key=" + encodeURIComponent(key));
    answer.replaceChildren();
    const to = document.createElement("span");
    to.className = "to";
    to.textContent = r.replica ? `→ ${r.replica}` : "→ nowhere";
    const vnode = r.vnode ? `${r.vnode.origin}#${r.vnode.number}` : "–";
    answer.append(
      to,
      document.createTextNode(
        ` (${r.reason}) · ring owner ${r.ring_owner || "–"}, vnode ${vnode}` +
          (r.sticky ? ` · last served by ${r.sticky}` : " · no live session"),
      ),
    );
  } catch (error) {
    answer.replaceChildren();
    const span = document.createElement("span");
    span.className = "error";
    span.textContent = error.message;
    answer.append(span);
  }
});

async function start() {
  // ask first whether a token is needed, so that a page opened without one is not an error
  try {
    const response = await fetch("/console/api/auth", { headers: authHeaders(), cache: "no-store" });
    const auth = await response.json();
    if (auth.required && !auth.accepted) {
      askForToken();
      return;
    }
  } catch (error) {
    $("#summary").textContent = "the router does not answer: " + error.message;
  }
  poll();
}

window.addEventListener("resize", () => drawHeatmap());
start();
