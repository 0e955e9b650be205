// The PlexRL dashboard: polls /dashboard/data and draws device lanes, queues and the jobs table.
// No library and nothing from elsewhere: every file comes from the server that serves this page.
"use strict";
const params = new URLSearchParams(location.search);
const INTERVAL_MS = Math.max(250, Number(params.get("interval") || 1000));
const WINDOW = params.get("window");
const HISTORY = 120; // queue depth samples kept per node group, one a poll
const SVG = "http://www.w3.org/2000/svg";
const queueHistory = {};
let timer = null;

function colour(job) {
  let h = 0;
  for (const c of job) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${h % 360}, 65%, 52%)`;
}

function fmt(x, digits = 2) {
  return x === null || x === undefined ? "–" : Number(x).toFixed(digits);
}

function headers() {
  const key = sessionStorage.getItem("plexrl-operator-key");
  return key ? { "X-API-Key": key } : {};
}

function el(tag, attrs = {}, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function drawLanes(doc) {
  const box = document.getElementById("lanes");
  box.replaceChildren();
  const t1 = doc.now, t0 = Math.max(0, doc.now - doc.window_s); // times count from the cluster's start
  const jobs = new Set();
  for (const d of doc.devices) {
    const lane = el("div", { class: "lane", "data-device": d.device });
    lane.append(el("span", { class: "name" }, `node ${d.node} · dev ${d.device}`));
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", "0 0 1000 22");
    svg.setAttribute("preserveAspectRatio", "none");
    for (const [a, b, job, what, kind] of d.spans) {
      const x = Math.max(0, (a - t0) / (t1 - t0)) * 1000;
      const w = Math.max(0.8, ((Math.min(b, t1) - Math.max(a, t0)) / (t1 - t0)) * 1000);
      const r = document.createElementNS(SVG, "rect");
      r.setAttribute("x", x.toFixed(2));
      r.setAttribute("width", w.toFixed(2));
      r.setAttribute("y", kind === "call" ? 3 : 0);
      r.setAttribute("height", kind === "call" ? 16 : 22);
      r.setAttribute("class", kind);
      r.setAttribute("data-job", job);
      if (kind === "call") { r.setAttribute("fill", colour(job)); jobs.add(job); }
      const title = document.createElementNS(SVG, "title");
      title.textContent = `${job} ${what} ${fmt(b - a, 3)} s`;
      r.append(title);
      svg.append(r);
    }
    lane.append(svg);
    lane.append(el("span", { class: "busy" }, `${fmt(d.busy_s, 1)} busy-s`));
    box.append(lane);
  }
  const legend = document.getElementById("legend");
  legend.replaceChildren();
  for (const job of [...jobs].sort()) {
    const s = el("span", { "data-job": job });
    const i = el("i");
    i.style.background = colour(job);
    s.append(i, document.createTextNode(job));
    legend.append(s);
  }
  for (const [cls, name] of [["switch", "switch (load/offload)"], ["prefetch", "prefetch"]]) {
    const s = el("span");
    s.append(el("i", { style: `background:${cls === "switch" ? "#111" : "#888"}` }), document.createTextNode(name));
    legend.append(s);
  }
  document.getElementById("window").textContent = `last ${fmt(t1 - t0, 0)} s`;
}

function drawQueues(doc) {
  const box = document.getElementById("queues");
  box.replaceChildren();
  for (const q of doc.queues) {
    const past = (queueHistory[q.node] = queueHistory[q.node] || []);
    past.push(q.queued);
    if (past.length > HISTORY) past.shift();
    const row = el("div", { class: "queue", "data-node": q.node });
    row.append(el("span", {}, `node ${q.node}`), el("span", { class: "depth" }, String(q.queued)));
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${HISTORY} 24`);
    svg.setAttribute("preserveAspectRatio", "none");
    const top = Math.max(1, ...past);
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", past.map((v, i) => `${i},${23 - (v / top) * 22}`).join(" "));
    svg.append(line);
    row.append(svg);
    box.append(row);
  }
}

function drawJobs(doc) {
  const body = document.querySelector("#jobs tbody");
  body.replaceChildren();
  for (const j of doc.jobs) {
    const tr = el("tr", { "data-job": j.job });
    const over = j.slowdown !== null && j.slack !== null && j.slowdown > j.slack;
    const cells = [
      ["job", j.job], ["tenant", j.tenant || "–"],
      ["consumed_device_s", fmt(j.consumed_device_s, 3)], ["dedicated_device_s", fmt(j.dedicated_device_s, 3)],
      ["cost_ratio", j.cost_ratio === null ? "–" : `${(100 * j.cost_ratio).toFixed(0)}%`],
      ["slowdown", j.slowdown === null ? "–" : `${(100 * j.slowdown).toFixed(1)}%`],
      ["slack", j.slack === null ? "–" : `${(100 * j.slack).toFixed(0)}%`],
      ["states", `${j.states.device} / ${j.states.host} / ${j.states.disk}`],
      ["requests", String(j.requests)], ["queue_wait_s", fmt(j.queue_wait_s, 3)],
    ];
    for (const [field, text] of cells) {
      const td = el("td", { "data-field": field }, text);
      if (field === "slowdown" && over) td.className = "over";
      tr.append(td);
    }
    body.append(tr);
  }
}

function draw(doc) {
  drawLanes(doc);
  drawQueues(doc);
  drawJobs(doc);
  const t = doc.totals;
  document.getElementById("totals").textContent =
    `up ${fmt(t.uptime_s, 0)} s · ${t.switches} switches · ${fmt(t.device_busy_s, 1)} device-s busy · ${t.queued} queued`;
  document.body.setAttribute("data-polls", String(Number(document.body.getAttribute("data-polls") || 0) + 1));
}

function status(state, text) {
  const s = document.getElementById("status");
  s.dataset.state = state;
  s.textContent = text;
}

async function poll() {
  const url = "/dashboard/data" + (WINDOW ? `?window=${encodeURIComponent(WINDOW)}` : "");
  try {
    const answer = await fetch(url, { headers: headers(), cache: "no-store" });
    if (answer.status === 401 || answer.status === 403) {
      const body = await answer.json();
      document.getElementById("login").hidden = false;
      document.getElementById("login-error").textContent = body.error || "";
      status("error", "operator key needed");
      return;
    }
    if (!answer.ok) throw new Error(`HTTP ${answer.status}`);
    draw(await answer.json());
    status("live", `live · every ${INTERVAL_MS / 1000} s`);
  } catch (err) {
    status("error", `no data: ${err.message}`);
  }
  timer = setTimeout(poll, INTERVAL_MS);
}

document.getElementById("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("plexrl-operator-key", document.getElementById("key").value.trim());
  document.getElementById("login").hidden = true;
  clearTimeout(timer);
  poll();
});

poll();
