// flowedge dashboard: one fetch-based SSE reader on /v1/status/stream (fetch, not EventSource, so the
// API key can go in the Authorization header), the cluster drawn from each status, a timeline kept in
// the browser (the head sends only its current state), and a chat box on /v1/chat/completions. The page
// holds no inline script (its Content-Security-Policy allows none) and never turns data into HTML.
"use strict";
const SPAN_S = 30;
const $ = (id) => document.getElementById(id);
const state = { history: [], prev: null, updates: 0, maxTps: 0, maxRunning: 0, events: [] };

// The API key lives in sessionStorage: this tab only, gone when it closes, never written to disk for good
// (older pages kept it in localStorage, which every later visit and every tab of the origin could read).
const KEY = "flowedge-key";
localStorage.removeItem(KEY);
function key() { return sessionStorage.getItem(KEY) || ""; }
function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (key()) h.Authorization = "Bearer " + key();
  return h;
}

// ---- server-sent events over fetch ---------------------------------------------------------------
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) onData(data);
    }
  }
}

async function connect() {
  try {
    const r = await fetch("/v1/status/stream", { headers: headers() });
    if (r.status === 401) { setConn("API key needed", "bad"); $("keyform").hidden = false; return; }
    if (!r.ok) throw new Error("HTTP " + r.status);
    $("keyform").hidden = true;
    await readEvents(r, (data) => update(JSON.parse(data)));
    throw new Error("stream ended");
  } catch (err) {
    setConn("reconnecting", "bad");
    setTimeout(connect, 2000);
  }
}

function setConn(text, cls) { const c = $("conn"); c.textContent = text; c.className = "pill " + cls; }

// ---- one status ------------------------------------------------------------------------------------
function update(snap) {
  state.updates += 1;
  document.body.dataset.updates = state.updates;
  const nodes = snap.nodes;
  if (!nodes || !nodes.length) { setConn("head unreachable", "bad"); note("the head does not answer"); return; }
  const head = nodes[0];
  setConn(head.ready ? "serving" : "waiting for stages", head.ready ? "ok" : "warn");
  $("model").textContent = text(head.model).split("/").pop() + " · " + text(head.strategy);
  state.history.push({ t: snap.t, nodes: nodes, tokens: (head.served || {}).tokens || 0 });
  while (state.history.length && state.history[0].t < snap.t - SPAN_S) state.history.shift();
  figures(head);
  drawClients(head.clients);
  drawNodes(nodes);
  drawTimeline();
  watchTrouble(nodes, state.prev);
  state.prev = nodes;
}

function rate() {
  // tokens/s over the last 2 s of history (the head counts tokens as they stream)
  const h = state.history;
  if (h.length < 2) return 0;
  const last = h[h.length - 1];
  let first = h[h.length - 2];
  for (let i = h.length - 2; i >= 0 && last.t - h[i].t <= 2.0; i--) first = h[i];
  return last.t > first.t ? Math.max(0, last.tokens - first.tokens) / (last.t - first.t) : 0;
}

function figures(head) {
  const live = (head.requests || {});
  const tps = rate();
  state.maxTps = Math.max(state.maxTps, tps);
  state.maxRunning = Math.max(state.maxRunning, live.running || 0);
  document.body.dataset.maxTps = state.maxTps.toFixed(2);
  document.body.dataset.maxRunning = state.maxRunning;
  $("tps").textContent = tps.toFixed(1);
  const accepts = (live.active || []).map((r) => r.mean_accept_len).filter((a) => a != null);
  const last = (head.last_request || {}).mean_accept_len;
  $("accept").textContent = accepts.length ? (accepts.reduce((a, b) => a + b, 0) / accepts.length).toFixed(2)
    : (last != null ? last.toFixed(2) : "-");
  $("queued").textContent = live.queued || 0;
  $("running").textContent = live.running || 0;
  $("paused").textContent = live.paused || 0;
  const s = head.served || {};
  $("served").textContent = (s.requests || 0) + (s.failed ? " / " + s.failed + " failed" : "");
}

// ---- the cluster as a picture ----------------------------------------------------------------------
// A node's row carries what a peer reported (checked at the head, but the page trusts none of it): every
// value is drawn as text (createElement / textContent, never HTML), numbers only where they are numbers.
function num(v) { return typeof v === "number" && isFinite(v) ? v : null; }
function fixed(v, digits) { const x = num(v); return x == null ? "-" : x.toFixed(digits); }
function text(v) { return v == null ? "" : String(v); }
function el(tag, cls, ...children) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  e.append(...children.filter((c) => c != null).map((c) => (c instanceof Node ? c : String(c))));
  return e;
}
const MB = (b) => num(b) == null ? "-" : (b / 1e6).toFixed(0) + " MB";
function who(n, i) { return i === 0 ? "head" : n.role === "drafter" ? "drafter" : "stage " + text(n.stage); }
function layers(n) {
  const l = n.layers;
  if (!Array.isArray(l)) return text(l) || "-";
  return num(l[0]) != null && num(l[1]) != null ? "layers " + l[0] + "–" + (l[1] - 1) : "-";
}
function wireBytes(n) {
  const wire = n.wire && typeof n.wire === "object" ? n.wire : {};
  return Object.values(wire).reduce((a, w) => a + ((w && num(w.wire_bytes)) || 0), 0);
}
function linkRate(n, i) {
  const h = state.history;
  if (h.length < 2) return "-";
  const a = h[Math.max(0, h.length - 5)], b = h[h.length - 1];
  const na = a.nodes[i], nb = b.nodes[i];
  if (!na || !nb || b.t <= a.t || na.node_id !== nb.node_id) return "-";
  return ((wireBytes(nb) - wireBytes(na)) / (b.t - a.t) / 1e3).toFixed(1) + " kB/s";
}
function bar(cls, frac, title) {
  const fill = document.createElement("i");
  fill.style.width = (100 * frac).toFixed(0) + "%";   // CSSOM, which the page's style-src allows
  const b = el("div", cls, fill);
  b.title = title;
  return b;
}
function facts(pairs) {
  return el("dl", "", ...pairs.flatMap(([term, value]) => [el("dt", "", term), el("dd", "", value)]));
}

function card(n, i) {
  const load = Math.min(1, Math.max(0, num(n.load) || 0));
  const rss = num(n.rss_bytes), free = num(n.free_memory_bytes);
  const memFrac = rss && free ? rss / (rss + free) : 0;
  const step = n.role === "head" ? (num(n.turn_ms_longest) != null ? n.turn_ms_longest + " ms (longest turn)" : "-")
    : (num(n.step_ms_median) != null ? n.step_ms_median + " ms" : "-");
  const seen = num(n.last_seen_s) != null ? n.last_seen_s.toFixed(1) + " s ago" : "-";
  const node = el("div", "node" + (n.missing ? " missing" : (n.ready ? " ready" : "")),
    el("h3", "", el("span", "", who(n, i)), el("span", "muted", n.missing ? "(empty slot)" : (text(n.node_id) || "-"))),
    el("div", "muted", layers(n) + " · " + text(n.device)),
    bar("bar", load, "busy"),
    facts([["busy", (100 * load).toFixed(0) + " %"], ["step", step],
           ["memory", MB(rss) + " used" + (free != null ? ", " + MB(free) + " free" : "")],
           ["link", (text(n.address) || "-") + ", " + linkRate(n, i)], ["heartbeat", seen]]));
  node.dataset.node = i;
  if (memFrac) node.append(bar("bar mem", memFrac, "memory used"));
  if (n.error) node.append(el("div", "pill bad", text(n.error)));
  return node;
}

function drawNodes(nodes) {
  const parts = nodes.flatMap((n, i) => (i ? [el("div", "arrow", "→"), card(n, i)] : [card(n, i)]));
  $("pipeline").replaceChildren(...parts);
  document.body.dataset.nodes = nodes.length;
}

// ---- the head's queue by client (its fair queue: one lane per client) --------------------------------
function drawClients(rows) {
  rows = Array.isArray(rows) ? rows : [];
  $("clients-box").hidden = !rows.length;
  $("clients").tBodies[0].replaceChildren(...rows.map((r) => el("tr", "", el("td", "", text(r.client)),
    ...[r.weight, r.queued, r.running, r.refused].map((v) => el("td", "", num(v) == null ? "-" : String(v))))));
  document.body.dataset.clients = rows.length;
}

// ---- the timeline: busy fraction per node per status, tokens made per status ---------------------
function drawTimeline() {
  const c = $("timeline"), h = state.history;
  const w = c.clientWidth || 600;
  if (c.width !== w) c.width = w;
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  if (!h.length) return;
  const now = h[h.length - 1].t, rows = h[h.length - 1].nodes.length + 1;
  const label = 70, rowH = c.height / rows, x = (t) => label + (c.width - label) * (1 - (now - t) / SPAN_S);
  g.font = "12px system-ui";
  h[h.length - 1].nodes.forEach((n, r) => {
    g.fillStyle = "#8a96a3";
    g.fillText(who(n, r), 4, r * rowH + rowH / 2 + 4);
  });
  g.fillText("tokens", 4, (rows - 1) * rowH + rowH / 2 + 4);
  let maxTok = 1;
  for (let i = 1; i < h.length; i++) maxTok = Math.max(maxTok, h[i].tokens - h[i - 1].tokens);
  for (let i = 1; i < h.length; i++) {
    const x0 = x(h[i - 1].t), x1 = x(h[i].t);
    h[i].nodes.forEach((n, r) => {
      const load = Math.min(1, Math.max(0, num(n.load) || 0));
      g.fillStyle = n.missing ? "rgba(248,81,73,0.5)" : `rgba(88,166,255,${0.08 + 0.92 * load})`;
      g.fillRect(x0, r * rowH + 3, Math.max(1, x1 - x0 - 1), rowH - 6);
    });
    const made = Math.max(0, h[i].tokens - h[i - 1].tokens);
    const bh = (rowH - 6) * made / maxTok;
    g.fillStyle = "#3fb950";
    g.fillRect(x0, rows * rowH - 3 - bh, Math.max(1, x1 - x0 - 1), bh);
  }
}

// ---- errors and drops ------------------------------------------------------------------------------
function note(line) {
  const last = state.events[state.events.length - 1];
  if (last && last.text === line) return;
  state.events.push({ t: new Date(), text: line });
  if (state.events.length > 50) state.events.shift();
  $("events").replaceChildren(...state.events.slice().reverse().map((e) =>
    el("li", "", el("time", "", e.t.toLocaleTimeString()), e.text)));
}
function sum(o) { return Object.values(o && typeof o === "object" ? o : {}).reduce((a, b) => a + (num(b) || 0), 0); }
function watchTrouble(nodes, prev) {
  nodes.forEach((n, i) => {
    const p = prev && prev[i];
    const name = who(n, i);
    if (n.missing && !(p && p.missing)) note(name + ": no node in this slot");
    if (n.error && !(p && p.error === n.error)) note(name + ": " + text(n.error));
    if (p && sum(n.dropped) > sum(p.dropped)) {
      note(name + " dropped " + (sum(n.dropped) - sum(p.dropped)) + " message(s): " + JSON.stringify(n.dropped));
    }
  });
  const s = nodes[0].served || {}, ps = prev && prev[0] && prev[0].served;
  if (ps && s.failed > ps.failed) note((s.failed - ps.failed) + " request(s) failed");
  if (ps && s.cancelled > ps.cancelled) note((s.cancelled - ps.cancelled) + " request(s) cancelled");
}

// ---- chat --------------------------------------------------------------------------------------------
async function chat(ev) {
  ev.preventDefault();
  const out = $("answer"), button = $("send");
  out.textContent = "";
  button.disabled = true;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ messages: [{ role: "user", content: $("prompt").value }], stream: true,
                             max_tokens: parseInt($("maxtok").value, 10) || 64 }),
    });
    if (!r.ok) throw new Error(((await r.json()).error || {}).message || "HTTP " + r.status);
    await readEvents(r, (data) => {
      if (data === "[DONE]") return;
      const obj = JSON.parse(data);
      if (obj.error) throw new Error(obj.error.message);
      const delta = ((obj.choices || [])[0] || {}).delta || {};
      if (delta.content) out.textContent += delta.content;
    });
    document.body.dataset.answered = "yes";
  } catch (err) {
    out.textContent += "\n[error: " + err.message + "]";
    note("chat: " + err.message);
  } finally {
    button.disabled = false;
  }
}

$("chat").addEventListener("submit", chat);
$("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY, $("key").value.trim());
  connect();
});
const query = new URLSearchParams(location.search);
if (query.has("ask")) {   // ?ask=TEXT[&max=N]: that question in the box, sent only when the user presses send
  $("prompt").value = query.get("ask");   // (a link must not spend the user's key on a question they never saw)
  if (query.has("max")) $("maxtok").value = query.get("max");
  $("send").focus();
}
connect();
