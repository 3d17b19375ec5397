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
];

const view = {
  points: [], events: [], replicas: [], since: 0, interval: 2, historyS: 900,
  metric: "inflight", picked: null, sort: { key: "id", dir: 1 }, waitingForToken: false,
};
window.consoleView = view;  // for the browser test and for the curious

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
  drawTable();
  drawEvents();
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
  const columns = Math.max(Math.round(view.historyS / view.interval), 1);
  const cellW = width / columns;
  const start = view.points.length - columns;
  let max = 0;
  for (const p of view.points) for (const v of Object.values(p.replicas)) max = Math.max(max, v[view.metric] || 0);
  const scale = max > 0 ? max : 1;
  let painted = 0;
  view.points.forEach((p, i) => {
    const x = (i - start) * cellW;
    if (x + cellW < 0) return;
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
  });
  canvas.dataset.rows = rows.length;
  canvas.dataset.cells = painted;
  $("#heat-max").textContent = `max ${view.metric === "qps" ? max.toFixed(1) + " req/s" : max + " in flight"}`;
  const labels = $("#heat-labels");
  labels.replaceChildren(...rows.map((id) => {
    const span = document.createElement("span");
    span.textContent = id;
    span.style.height = span.style.lineHeight = rowH + "px";
    span.classList.toggle("picked", id === view.picked);
    span.addEventListener("click", () => pick(id));
    return span;
  }));
  const minutes = Math.round(view.historyS / 60);
  $("#heat-axis").replaceChildren(...[`${minutes} min ago`, "now"].map((text) => {
    const span = document.createElement("span");
    span.textContent = text;
    return span;
  }));
}

function polyline(values, t0, span) {
  const out = [];
  view.points.forEach((p, i) => {
    const v = values[i];
    if (v === null || v === undefined) return;
    out.push(`${(((p.t - t0) / span) * 1000).toFixed(1)},${(200 - v * 196 - 2).toFixed(1)}`);
  });
  return out.join(" ");
}

function drawCurve() {
  const svg = $("#hitcurve");
  const last = view.points[view.points.length - 1];
  const t1 = last ? last.t : Date.now() / 1000;
  const t0 = t1 - view.historyS;
  const fleet = view.points.map((p) => p.hit);
  const jump = view.points.map((p) => p.jump);
  const predicted = view.points.map((p) => p.predicted);
  const replica = view.points.map((p) => (view.picked && p.replicas[view.picked] ? p.replicas[view.picked].hit : null));
  svg.querySelector("polyline.fleet").setAttribute("points", polyline(fleet, t0, view.historyS));
  svg.querySelector("polyline.jump").setAttribute("points", polyline(jump, t0, view.historyS));
  svg.querySelector("polyline.predicted").setAttribute("points", polyline(predicted, t0, view.historyS));
  svg.querySelector("polyline.replica").setAttribute("points", polyline(replica, t0, view.historyS));
  svg.dataset.points = fleet.filter((v) => v !== null && v !== undefined).length;
  const grid = svg.querySelector(".grid");
  if (!grid.childElementCount) {
    for (const level of [0.25, 0.5, 0.75]) {
      const line = document.createElementNS("http://www.w3.org/2000/svg", "line");
      line.setAttribute("x1", 0);
      line.setAttribute("x2", 1000);
      line.setAttribute("y1", 200 - level * 196 - 2);
      line.setAttribute("y2", 200 - level * 196 - 2);
      grid.append(line);
    }
  }
  const latest = [...view.points].reverse().find((p) => p.hit !== null && p.hit !== undefined);
  const jumpNow = [...view.points].reverse().find((p) => p.jump !== null && p.jump !== undefined);
  const guess = [...view.points].reverse().find((p) => p.predicted !== null && p.predicted !== undefined);
  const exact = last && last.exact ? Object.entries(last.exact).filter(([, v]) => v !== null && v !== undefined) : [];
  $("#hit-now").textContent =
    (latest ? `hit ${percent(latest.hit)}` : "no prompt tokens yet") +
    (guess ? ` · predicted ${percent(guess.predicted)} vs reported ${percent(guess.reported)}` : "") +
    (exact.length ? ` · predicted exactly: ${exact.map(([s, v]) => `${s} ${percent(v)}`).join(", ")}` : "") +
    (jumpNow ? ` · jumps ${percent(jumpNow.jump)}` : "");
  $("#selected-name").textContent = view.picked ? view.picked : "click a replica to add its curve";
  $("#hit-axis").textContent = `${Math.round(view.historyS / 60)} min ago · 0 to 100%, a line every 25%`;
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
        if (name !== "id" && name !== "models") td.className = "num";
      }
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
  if (name === "qps" || name === "latency_ratio") return value.toFixed(1);
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
    view.sort = { key, dir: view.sort.key === key ? -view.sort.dir : ["id", "state", "models"].includes(key) ? 1 : -1 };
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
