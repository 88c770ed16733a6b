// The DSec web console: plain DOM, no framework. The API key lives in sessionStorage (this tab
// only, gone when it closes) and goes out as a Bearer header on the public /v1 API, so the
// console sees exactly what the key sees there. Data is put in the page as text, never as HTML.
"use strict";

const KEY = "dsecKey";
const POLL_MS = 2000;
let timers = [];   // polls of the current view, stopped when the view changes
let teardown = []; // sockets and terminals of the current view

function key() { return sessionStorage.getItem(KEY); }

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c !== null && c !== undefined) el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

function showError(message) {
  const box = document.getElementById("error");
  box.textContent = message || "";
  box.hidden = !message;
}

async function api(method, path, opts = {}) {
  const headers = { Authorization: "Bearer " + key() };
  let body = opts.body;
  if (opts.json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(opts.json);
  }
  const resp = await fetch(path, { method, headers, body });
  if (resp.status === 401) {
    sessionStorage.removeItem(KEY);
    render();
    throw new Error("the API key was refused");
  }
  if (!resp.ok) {
    let message = `${resp.status} ${resp.statusText}`;
    try {
      const err = (await resp.json()).error;
      message = err.message + (err.request_id ? ` (request ${err.request_id})` : "");
    } catch (_) { /* not a DSec error body */ }
    throw new Error(message);
  }
  return opts.raw ? resp : resp.json();
}

function guarded(fn) {
  return async (...args) => {
    try { showError(""); await fn(...args); } catch (e) { showError(e.message); }
  };
}

function when(ts) { return ts ? new Date(ts * 1000).toISOString().replace("T", " ").slice(0, 19) : ""; }

function table(columns, rows, attrs) {
  return h("table", attrs,
    h("thead", {}, h("tr", {}, columns.map(([title]) => h("th", {}, title)))),
    h("tbody", {}, rows.map((row) => h("tr", { "data-id": row.id },
      columns.map(([, cell]) => h("td", {}, cell(row)))))));
}

// -- login ---------------------------------------------------------------------------------

function loginView(main) {
  const input = h("input", { id: "login-key", type: "password", size: 60, autocomplete: "off",
                             placeholder: "dsec_..." });
  const submit = guarded(async (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, input.value.trim());
    await api("GET", "/v1/sandboxes"); // any key may list: a refused key is a 401 here
    location.hash = "#/sandboxes";
    render();
  });
  main.append(h("h2", {}, "Log in"),
    h("p", { class: "muted" }, "With an API key; it stays in this tab (sessionStorage) and sees what it sees on the API."),
    h("form", { onsubmit: submit }, input, " ", h("button", { id: "login-button", type: "submit" }, "Log in")));
  input.focus();
}

// -- sandboxes -----------------------------------------------------------------------------

function hashQuery() { return new URLSearchParams(location.hash.split("?")[1] || ""); }

async function sandboxesView(main) {
  const q = hashQuery();
  const field = (name, title) => h("label", {}, title,
    h("input", { id: "f-" + name, name, value: q.get(name) || "", size: 14 }));
  const state = h("select", { id: "f-state", name: "state" },
    ["", "running", "paused", "creating", "stopped"].map((s) =>
      h("option", { value: s, selected: (q.get("state") || "") === s }, s || "any")));
  const form = h("form", { class: "filters", id: "filters" },
    field("project", "project"), field("job", "job label"), field("node", "node"),
    h("label", {}, "state", state), h("button", { type: "submit", id: "apply" }, "Filter"));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const next = new URLSearchParams();
    for (const [k, v] of new FormData(form)) if (v) next.set(k, v);
    location.hash = "#/sandboxes?" + next;
  });
  const job = q.get("job");
  const bulk = (action) => guarded(async () => {
    const path = action === "stop" ? "/v1/sandboxes" : `/v1/sandboxes/${action}`;
    const result = await api(action === "stop" ? "DELETE" : "POST",
      `${path}?label=${encodeURIComponent("job=" + job)}`);
    document.getElementById("bulk-result").textContent =
      `${action}: ${result.done.length} done` + (Object.keys(result.failed || {}).length ? `, failed: ${JSON.stringify(result.failed)}` : "")
      + (result.unreachable_nodes.length ? `, unreachable nodes: ${result.unreachable_nodes.join(", ")}` : "");
    await load();
  });
  const actions = h("div", { class: "actions" },
    h("span", {}, job ? `Job ${job}:` : "Filter by a job label to act on a job."),
    ["pause", "resume", "stop"].map((a) =>
      h("button", { id: "bulk-" + a, type: "button", disabled: !job, onclick: bulk(a) }, a[0].toUpperCase() + a.slice(1) + " job")),
    h("span", { id: "bulk-result", class: "muted" }));
  const holder = h("div", { id: "sandboxes-holder" });
  main.append(h("h2", {}, "Sandboxes"), form, actions, holder);

  const load = guarded(async () => {
    const path = "/v1/sandboxes" + (job ? "?label=" + encodeURIComponent("job=" + job) : "");
    let rows = await api("GET", path);
    const want = { project: q.get("project"), node: q.get("node"), state: q.get("state") };
    rows = rows.filter((s) => (!want.project || s.project === want.project || s.project.startsWith(want.project + "/"))
      && (!want.node || s.node === want.node) && (!want.state || s.state === want.state));
    holder.replaceChildren(h("p", { class: "muted" }, `${rows.length} sandboxes`), table([
      ["ID", (s) => h("a", { href: "#/sandbox/" + s.id, class: "sandbox-link" }, s.id)],
      ["state", (s) => s.state + (s.pause_reason ? ` (${s.pause_reason})` : "")],
      ["project", (s) => s.project], ["node", (s) => s.node], ["backend", (s) => s.backend],
      ["labels", (s) => Object.entries(s.labels).map(([k, v]) => `${k}=${v}`).join(" ")],
      ["memory MiB", (s) => s.memory_limit_mb], ["created", (s) => when(s.created_at)],
    ], rows, { id: "sandboxes" }));
  });
  await load();
  timers.push(setInterval(load, POLL_MS * 2.5));
}

// -- one sandbox ---------------------------------------------------------------------------

async function sandboxView(main, id) {
  const base = `/v1/sandboxes/${encodeURIComponent(id)}`;
  const info = h("div", { id: "sb-info" });
  let state = null;
  const trajectory = h("tbody", { id: "trajectory" });
  const act = (what, method, path) => guarded(async () => { await api(method, path); await loadInfo(); });
  main.append(h("h2", {}, "Sandbox ", h("code", {}, id)),
    h("div", { class: "actions" },
      h("button", { type: "button", id: "sb-pause", onclick: act("pause", "POST", base + "/pause") }, "Pause"),
      h("button", { type: "button", id: "sb-resume", onclick: act("resume", "POST", base + "/resume") }, "Resume"),
      h("button", { type: "button", id: "sb-stop", onclick: act("stop", "DELETE", base) }, "Stop")),
    h("section", {}, h("h3", {}, "Info"), info));
  const loadInfo = guarded(async () => {
    const s = await api("GET", base);
    const fields = [["ID", s.id], ["state", s.state + (s.pause_reason ? ` (${s.pause_reason})` : "")],
      ["project", s.project], ["node", s.node], ["backend", s.backend], ["image", (s.refs || []).join(" ")],
      ["labels", Object.entries(s.labels).map(([k, v]) => `${k}=${v}`).join(" ")],
      ["limits", `${s.cpu_cores_limit} cores, ${s.memory_limit_mb} MiB`], ["user", s.init_user],
      ["created", when(s.created_at)], ["last active", when(s.last_active_at)]];
    info.replaceChildren(h("table", {}, h("tbody", {}, fields.map(([k, v]) => h("tr", {}, h("th", {}, k), h("td", {}, v))))),
      h("details", {}, h("summary", {}, "every field"), h("pre", {}, JSON.stringify(s, null, 2))));
    state = s.state;
  });
  await loadInfo();

  // Terminal
  const termBox = h("div", { id: "terminal" });
  const termButton = h("button", { type: "button", id: "open-terminal" }, "Open a terminal");
  const termState = h("span", { id: "terminal-state", class: "muted" });
  termButton.addEventListener("click", () => openTerminal(id, termBox, termState, termButton));
  main.append(h("section", {}, h("h3", {}, "Terminal"), h("div", { class: "actions" }, termButton, termState), termBox));

  // Files
  const pathInput = h("input", { id: "files-path", value: "/tmp", size: 40 });
  const listing = h("div", { id: "files" });
  const upload = h("input", { id: "upload-input", type: "file" });
  const listDir = guarded(async () => {
    const path = pathInput.value || "/";
    const entries = await api("GET", `${base}/files/list?path=${encodeURIComponent(path)}`);
    entries.sort((a, b) => a.name.localeCompare(b.name));
    const up = path.replace(/\/[^/]*\/?$/, "") || "/";
    listing.replaceChildren(
      h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); pathInput.value = up; listDir(); } }, ".. (up)"),
      table([
        ["name", (f) => f.type === "dir"
          ? h("a", { href: "#", class: "dir", onclick: (ev) => { ev.preventDefault(); pathInput.value = f.path; listDir(); } }, f.name + "/")
          : h("a", { href: "#", class: "file", onclick: (ev) => { ev.preventDefault(); download(f.path, f.name); } }, f.name)],
        ["type", (f) => f.type], ["size", (f) => f.size], ["modified", (f) => when(f.mtime)],
      ], entries.map((f) => ({ ...f, id: f.path })), { id: "files-table" }));
  });
  const download = guarded(async (path, name) => {
    const resp = await api("GET", `${base}/files/content?path=${encodeURIComponent(path)}`, { raw: true });
    const url = URL.createObjectURL(await resp.blob());
    const a = h("a", { href: url, download: name });
    document.body.append(a); a.click(); a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  });
  const sendFile = guarded(async () => {
    const file = upload.files[0];
    if (!file) throw new Error("choose a file to upload first");
    const dir = (pathInput.value || "/").replace(/\/$/, "");
    await api("PUT", `${base}/files/content?path=${encodeURIComponent(dir + "/" + file.name)}`, { body: file });
    await listDir();
  });
  main.append(h("section", {}, h("h3", {}, "Files"),
    h("form", { class: "actions", onsubmit: (ev) => { ev.preventDefault(); listDir(); } },
      pathInput, h("button", { type: "submit", id: "files-go" }, "List")),
    listing,
    h("div", { class: "actions" }, upload, h("button", { type: "button", id: "upload-button", onclick: sendFile }, "Upload here"))));
  // A file operation resumes a paused sandbox: looking at its page must not.
  if (state === "paused") listing.replaceChildren(h("p", { class: "muted" }, "Paused: List resumes it."));
  else await listDir();

  // Trajectory, polled: the entries after the last one seen
  let after = 0;
  main.append(h("section", {}, h("h3", {}, "Trajectory"),
    h("table", {}, h("thead", {}, h("tr", {}, ["#", "kind", "status", "started", "request"].map((t) => h("th", {}, t)))), trajectory)));
  const poll = guarded(async () => {
    const entries = await api("GET", `${base}/trajectory?after=${after}&limit=200`);
    for (const e of entries) {
      after = Math.max(after, e.seq);
      const existing = trajectory.querySelector(`tr[data-seq="${e.seq}"]`);
      const row = h("tr", { "data-seq": e.seq }, h("td", {}, e.seq), h("td", {}, e.kind), h("td", {}, e.status),
        h("td", {}, when(e.started_at)), h("td", {}, JSON.stringify(e.request).slice(0, 200)));
      if (existing) existing.replaceWith(row); else trajectory.append(row);
    }
  });
  await poll();
  timers.push(setInterval(poll, POLL_MS));
}

function openTerminal(id, box, stateEl, button) {
  if (typeof Terminal === "undefined") {
    stateEl.textContent = "xterm.js is not installed on this apiserver (see the notice at the top).";
    return;
  }
  button.disabled = true;
  const term = new Terminal({ cursorBlink: true, convertEol: false, scrollback: 2000 });
  const fit = new FitAddon.FitAddon();
  term.loadAddon(fit);
  box.replaceChildren();
  term.open(box);
  fit.fit();
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const url = `${scheme}//${location.host}/console/ws/sandboxes/${encodeURIComponent(id)}/terminal?rows=${term.rows}&cols=${term.cols}`;
  // A browser cannot set headers on a WebSocket: the key rides as a second offered subprotocol.
  const ws = new WebSocket(url, ["dsec-console", "key." + key()]);
  ws.binaryType = "arraybuffer";
  const encoder = new TextEncoder();
  ws.onopen = () => { stateEl.textContent = "connected"; term.focus(); };
  ws.onmessage = (ev) => {
    if (typeof ev.data === "string") {
      const msg = JSON.parse(ev.data);
      if (msg.t === "end") stateEl.textContent = `ended, exit code ${msg.exit_code}` + (msg.error ? ` (${msg.error})` : "");
      return;
    }
    term.write(new Uint8Array(ev.data));
  };
  ws.onclose = (ev) => {
    if (!stateEl.textContent.startsWith("ended")) stateEl.textContent = `closed (${ev.code}${ev.reason ? ": " + ev.reason : ""})`;
    button.disabled = false;
  };
  term.onData((data) => { if (ws.readyState === WebSocket.OPEN) ws.send(encoder.encode(data)); });
  term.onResize(({ rows, cols }) => {
    if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ t: "resize", rows, cols }));
  });
  const onWindow = () => fit.fit();
  window.addEventListener("resize", onWindow);
  window.dsecTerminal = term; // for tests and the devtools console
  teardown.push(() => { window.removeEventListener("resize", onWindow); ws.close(); term.dispose(); });
}

// -- nodes and projects --------------------------------------------------------------------

const GiB = 1 << 30;
function gib(bytes) { return typeof bytes === "number" ? (bytes / GiB).toFixed(1) : ""; }

async function nodesView(main) {
  const holder = h("div", { id: "nodes-holder" });
  main.append(h("h2", {}, "Nodes"), holder);
  const load = guarded(async () => {
    const nodes = await api("GET", "/v1/nodes");
    holder.replaceChildren(table([
      ["node", (n) => n.node], ["healthy", (n) => String(n.healthy)],
      ["sandboxes", (n) => `${n.running ?? ""} / ${n.capacity ?? ""}`],
      ["of capacity", (n) => n.capacity ? `${(100 * (n.running || 0) / n.capacity).toFixed(1)}%` : ""],
      ["paused", (n) => n.paused ?? ""],
      ["admitted (memory, CPU ...)", (n) => Object.entries(n.admitted || {})
        .map(([k, v]) => `${k} ${typeof v === "number" ? Math.round(100 * v) + "%" : JSON.stringify(v)}`).join(", ")],
      ["swap free", (n) => n.swap_free_bytes !== undefined ? `${gib(n.swap_free_bytes)} GiB` : ""],
      ["KSM", (n) => n.ksm ? JSON.stringify(n.ksm).slice(0, 160) : ""],
      ["backends", (n) => (n.backends || []).join(", ")],
      ["hardware", (n) => n.hardware ? JSON.stringify(n.hardware).slice(0, 160) : ""],
      ["details", (n) => h("details", {}, h("summary", {}, "capabilities and the rest"),
        h("pre", {}, JSON.stringify(n, null, 2)))],
      ["last seen", (n) => when(n.last_seen)],
    ], nodes.map((n) => ({ ...n, id: n.node })), { id: "nodes" }));
  });
  await load();
  timers.push(setInterval(load, POLL_MS * 2.5));
  const charts = h("div", { id: "creates-holder" }, h("p", { class: "muted" }, "measuring..."));
  main.append(h("h3", {}, "Creates on this apiserver"), charts);
  const sample = createsChart(charts);
  await sample();
  timers.push(setInterval(sample, POLL_MS));
}

// The live creates/s and p99 chart: this apiserver's own /metrics (admin keys), single creates
// (POST /v1/sandboxes), their rate and the p99 of their latency between two scrapes.
const CREATE_ROUTE = { route: "/v1/sandboxes", method: "POST" };
const HISTORY = 90; // points: three minutes at one per POLL_MS

function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    samples.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return samples;
}

function createBuckets(samples) {
  const buckets = new Map(); // upper bound (s) -> cumulative count
  for (const s of samples) {
    if (s.name === "dsec_api_http_request_seconds_bucket" && s.labels.route === CREATE_ROUTE.route
        && s.labels.method === CREATE_ROUTE.method) {
      buckets.set(s.labels.le === "+Inf" ? Infinity : Number(s.labels.le), s.value);
    }
  }
  return buckets;
}

function p99(before, now) {
  const bounds = [...now.keys()].sort((a, b) => a - b);
  const delta = (le) => (now.get(le) || 0) - (before.get(le) || 0);
  const total = delta(Infinity);
  if (!total) return null;
  for (const le of bounds) if (delta(le) >= 0.99 * total) return le;
  return Infinity;
}

function sparkline(points, title, unit) {
  const w = 360, ht = 80, finite = points.filter((v) => v !== null && isFinite(v));
  const top = Math.max(1e-9, ...finite);
  const xy = points.map((v, i) => (v === null || !isFinite(v) ? null
    : `${(w - (points.length - 1 - i) * w / (HISTORY - 1)).toFixed(1)},${(ht - (v / top) * (ht - 4)).toFixed(1)}`))
    .filter(Boolean); // the newest point at the right edge
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", w); svg.setAttribute("height", ht); svg.setAttribute("class", "chart");
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", xy.join(" "));
  svg.append(line);
  if (xy.length) {
    const [cx, cy] = xy[xy.length - 1].split(",");
    const dot = document.createElementNS("http://www.w3.org/2000/svg", "circle");
    dot.setAttribute("cx", cx); dot.setAttribute("cy", cy); dot.setAttribute("r", 2.5);
    svg.append(dot);
  }
  const last = points[points.length - 1];
  const shown = last === null || last === undefined ? "-" : !isFinite(last) ? "over the top bucket" : `${+last.toFixed(3)} ${unit}`;
  return h("figure", {}, svg, h("figcaption", {}, `${title}: ${shown} (max ${+top.toFixed(3)})`));
}

function createsChart(holder) {
  const rates = [], tails = [];
  let last = null;
  return guarded(async () => {
    const resp = await api("GET", "/metrics", { raw: true });
    const now = { at: performance.now(), buckets: createBuckets(parseMetrics(await resp.text())) };
    if (last) {
      const seconds = (now.at - last.at) / 1000;
      const count = (now.buckets.get(Infinity) || 0) - (last.buckets.get(Infinity) || 0);
      const tail = p99(last.buckets, now.buckets);
      rates.push(count / seconds); tails.push(tail === null ? null : tail * 1000);
      if (rates.length > HISTORY) { rates.shift(); tails.shift(); }
      holder.replaceChildren(h("div", { id: "creates-now", class: "charts" },
        sparkline(rates, "creates/s", "/s"), sparkline(tails, "create p99 (bucket bound)", "ms")));
    }
    last = now;
  });
}

async function projectsView(main) {
  main.append(h("h2", {}, "Projects"));
  const [projects, keys] = await Promise.all([
    api("GET", "/v1/projects"), api("GET", "/v1/keys").catch((e) => ({ error: e.message }))]);
  const quota = (v) => (v === null || v === undefined ? "none" : v);
  main.append(table([
    ["project", (p) => p.id],
    ["sandboxes", (p) => `${p.usage.sandboxes} / ${quota(p.quota.sandboxes)}`],
    ["CPU cores", (p) => `${p.usage.cpu_cores} / ${quota(p.quota.cpu_cores)}`],
    ["memory MiB", (p) => `${p.usage.memory_mib} / ${quota(p.quota.memory_mib)}`],
    ["storage", (p) => `${((p.usage.storage_bytes || 0) / (1 << 20)).toFixed(1)} MiB / ${quota(p.quota.storage_mib)}`],
  ], projects, { id: "projects" }));
  main.append(h("h3", {}, "Keys"), keys.error ? h("p", { class: "muted" }, keys.error) : table([
    ["key ID", (k) => k.key_id], ["project", (k) => k.project], ["name", (k) => k.name],
    ["admin", (k) => String(k.admin)], ["revoked", (k) => String(k.revoked)], ["created", (k) => when(k.created_at)],
  ], keys.map((k) => ({ ...k, id: k.key_id })), { id: "keys" }));
}

// -- routing -------------------------------------------------------------------------------

async function render() {
  timers.forEach(clearInterval); timers = [];
  teardown.forEach((f) => f()); teardown = [];
  const main = document.getElementById("main");
  main.replaceChildren();
  document.getElementById("nav").hidden = !key();
  if (!key()) { loginView(main); return; }
  const whoami = document.getElementById("whoami");
  if (!whoami.textContent) { // the key's own project heads the list of what it sees
    api("GET", "/v1/projects").then((p) => { whoami.textContent = p.length ? `project ${p[0].id}` : ""; }, () => {});
  }
  const route = location.hash.replace(/^#\//, "").split("?")[0];
  const [page, ...rest] = route.split("/");
  const view = guarded(async () => {
    if (page === "sandbox" && rest.length) await sandboxView(main, decodeURIComponent(rest.join("/")));
    else if (page === "nodes") await nodesView(main);
    else if (page === "projects") await projectsView(main);
    else await sandboxesView(main);
  });
  await view();
}

document.getElementById("logout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  document.getElementById("whoami").textContent = "";
  location.hash = "";
  render();
});
window.addEventListener("hashchange", render);
render();
