// disagg-mesh's dashboard: draws /api/dashboard, then follows /api/dashboard/events.
// Plain JavaScript and uPlot (vendored beside this file); nothing leaves the router.
"use strict";

const token = new URLSearchParams(location.search).get("token");
const withToken = (path) => (token ? `${path}?token=${encodeURIComponent(token)}` : path);
const $ = (id) => document.getElementById(id);
const charts = new Map(); // chart key -> {plot, data}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children) node.append(child);
  return node;
}

const num = (v, digits = 2) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));
function seconds(v) {
  if (v === null || v === undefined) return "–";
  return v < 1 ? `${(1000 * v).toFixed(v < 0.01 ? 1 : 0)} ms` : `${Number(v).toFixed(2)} s`;
}
const bytes = (v) => (v ? `${(v / 2 ** 30).toFixed(1)} GiB` : "–");

function duration(s) {
  if (s === null || s === undefined) return "–";
  if (s < 120) return `${Math.round(s)} s`;
  if (s < 7200) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function drawTargets(targets) {
  const box = $("targets");
  box.replaceChildren();
  for (const t of targets) {
    const state = t.ok === null ? "unknown" : t.ok ? "ok" : "bad";
    const value = t.value === null ? "no data" : `${num(t.value)} ${t.unit}`;
    const goal = `${t.key === "end_to_end_p95" || t.key === "error_rate" || t.key === "failover" ? "<" : ">"} ${t.goal} ${t.unit}`;
    box.append(
      el("div", { class: `tile ${state}`, "data-target": t.key, "data-ok": String(t.ok) },
        el("div", { class: "what" }, `${t.what} (goal ${goal})`),
        el("div", { class: "value" }, value)));
  }
}

function usageLine(u) {
  if (!u) return "no figures yet (no node of this machine answered)";
  const parts = [
    `CPU ${num(u.cpu_busy_percent, 0)} % of ${u.cpu_cores} cores`,
    `memory ${bytes(u.memory_used_bytes)} of ${bytes(u.memory_total_bytes)}`,
  ];
  if (u.gpu_name) {
    parts.push(`GPU ${u.gpu_name}: ${num(u.gpu_utilization_percent, 0)} %, ` +
      `${bytes(u.gpu_memory_used_bytes)} of ${bytes(u.gpu_memory_total_bytes)}`);
  }
  for (const why of u.unavailable) parts.push(`unavailable: ${why}`);
  return `${u.hostname}: ${parts.join(" · ")}`;
}

function drawHosts(state) {
  // A big mesh's nodes are asked in turn: an answer older than two ticks says its age.
  const asked = (n) => [n.problem, n.asked_seconds_ago > 2 * state.sample_every_seconds
    ? `answered ${Math.round(n.asked_seconds_ago)} s ago` : ""].filter(Boolean).join("; ");
  const box = $("hosts");
  box.replaceChildren();
  const byName = new Map(state.nodes.map((n) => [n.name, n]));
  for (const host of state.hosts) {
    const rows = host.nodes.map((name) => {
      const n = byName.get(name);
      const health = n.health.replace(" ", "-");
      const where = n.backend ? `${n.backend}${n.model_layers ? `, ${n.gpu_layers}/${n.model_layers} on GPU` : ""}` : "";
      return el("tr", { "data-node": n.name, class: health },
        el("td", {}, n.name), el("td", {}, n.role), el("td", {}, n.models.join(", ")),
        el("td", {}, n.engine), el("td", {}, where),
        el("td", { class: `health ${health}`, "data-health": n.health, title: asked(n) }, n.health),
        el("td", {}, n.role === "router" ? "" : `${n.slots_busy}/${n.slots}`),
        el("td", {}, n.role === "router" ? "" : String(n.queue_depth)),
        el("td", {}, String(n.restarts)), el("td", {}, duration(n.uptime_seconds)));
    });
    const head = el("tr", {}, ...["node", "role", "models", "engine", "runs on", "health",
      "slots busy", "queue", "restarts", "uptime"].map((h) => el("th", {}, h)));
    box.append(el("div", { class: "host", "data-host": host.host },
      el("h3", {}, host.host),
      el("div", { class: "usage" }, usageLine(host.usage)),
      el("table", {}, head, ...rows)));
  }
}

function figure(label, value) {
  return el("div", {}, el("span", {}, `${label}: `), value);
}

function drawModels(state) {
  const box = $("models");
  for (const [name, f] of Object.entries(state.models)) {
    let card = box.querySelector(`[data-model="${CSS.escape(name)}"]`);
    if (!card) {
      card = el("div", { class: "model", "data-model": name },
        el("h3", {}, name), el("div", { class: "figures" }), el("div", { class: "charts" }));
      box.append(card);
    }
    const errors = Object.entries(f.errors).map(([c, n]) => `${c} ${n}`).join(", ") || "none";
    const q = (d) => `${seconds(d.p50)} / ${seconds(d.p95)} / ${seconds(d.p99)}`;
    card.querySelector(".figures").replaceChildren(
      figure("requests", el("b", { "data-figure": "requests" }, String(f.requests))),
      figure("requests/s", num(f.requests_per_second)),
      figure("tokens/s", el("b", { "data-figure": "tokens_per_second" }, num(f.tokens_per_second, 1))),
      figure("TTFT p50/p95/p99", q(f.ttft_seconds)),
      figure("end-to-end p50/p95/p99", q(f.total_seconds)),
      figure("KV handoff p50", seconds(f.kv_handoff_seconds_p50)),
      figure("KV MB/s", num(f.kv_megabytes_per_second, 0)),
      figure("prefix-cache hit rate", f.prefix_cache_hit_rate === null ? "–" : `${num(100 * f.prefix_cache_hit_rate, 0)} %`),
      figure("migrations", String(f.migrations)),
      figure("failovers", String(f.failovers)),
      figure("errors", errors));
    const area = card.querySelector(".charts");
    chart(`${name}/rate`, area, "requests/s (left) and tokens/s (right)", ["requests/s", "tokens/s"],
      ["y", "tokens"]);
    chart(`${name}/ttft`, area, "time to first token (s)", ["p50", "p95", "p99"]);
    chart(`${name}/total`, area, "end-to-end (s)", ["p50", "p95", "p99"]);
  }
}

const COLOURS = ["#0969da", "#bf8700", "#cf222e", "#8250df"];

// scales: each series' y scale ("y" unless named); a second scale gets an axis on the right.
function chart(key, parent, title, labels, scales = []) {
  if (charts.has(key)) return;
  const box = el("div", { class: "chart", "data-chart": key }, el("h4", {}, title));
  parent.append(box);
  const series = [{}, ...labels.map((label, i) => ({
    label, stroke: COLOURS[i % COLOURS.length], width: 1.5, scale: scales[i] || "y" }))];
  const axes = [{}, { scale: "y" }];
  for (const name of new Set(scales)) {
    if (name !== "y") axes.push({ scale: name, side: 1, grid: { show: false } });
  }
  const data = [[], ...labels.map(() => [])];
  const plot = new uPlot({ width: 420, height: 180, series, axes, scales: { x: { time: true } },
    legend: { live: false } }, data, box);
  charts.set(key, { plot, data });
}

function push(key, t, values) {
  const c = charts.get(key);
  if (!c) return;
  c.data[0].push(t);
  values.forEach((v, i) => c.data[i + 1].push(v === undefined ? null : v));
  const keep = 1800; // an hour of 2 s samples
  if (c.data[0].length > keep) c.data.forEach((column) => column.splice(0, column.length - keep));
  c.plot.setData(c.data);
}

function addSample(sample) {
  for (const [name, m] of Object.entries(sample.models)) {
    push(`${name}/rate`, sample.t, [m.rps, m.tps]);
    push(`${name}/ttft`, sample.t, [m.ttft_p50, m.ttft_p95, m.ttft_p99]);
    push(`${name}/total`, sample.t, [m.total_p50, m.total_p95, m.total_p99]);
  }
  for (const [host, h] of Object.entries(sample.hosts)) {
    chart(`host/${host}`, $("host-charts"), `${host}: CPU, memory, GPU (%)`, ["CPU", "memory", "GPU"]);
    push(`host/${host}`, sample.t, [h.cpu, h.memory, h.gpu]);
  }
}

function draw(state) {
  $("router").textContent = `router ${state.router}`;
  $("window").textContent = String(state.window_seconds);
  $("updated").textContent = `updated ${new Date(state.generated_at * 1000).toLocaleTimeString()}`;
  drawTargets(state.targets);
  drawHosts(state);
  drawModels(state);
}

function setStatus(text, cls) {
  const s = $("status");
  s.textContent = text;
  s.className = `status ${cls}`;
}

async function load() {
  const reply = await fetch(withToken("/api/dashboard"), { cache: "no-store" });
  if (!reply.ok) throw new Error(`GET /api/dashboard: HTTP ${reply.status}`);
  const state = await reply.json();
  for (const c of charts.values()) c.data.forEach((column) => column.splice(0));
  draw(state);
  for (const sample of state.history) addSample(sample);
}

function follow() {
  const events = new EventSource(withToken("/api/dashboard/events"));
  let opened = false;
  events.addEventListener("open", () => {
    setStatus("live", "live");
    // After a reconnect (a router restart), the history may have moved on: draw it again.
    if (opened) load().catch(() => setStatus("reconnecting…", "down"));
    opened = true;
  });
  events.addEventListener("update", (event) => {
    const update = JSON.parse(event.data);
    draw(update);
    addSample(update.sample);
  });
  events.addEventListener("error", () => setStatus("reconnecting…", "down"));
}

load()
  .catch(() => setStatus("reconnecting…", "down"))
  .finally(follow);
