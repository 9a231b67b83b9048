// flowedge dashboard: one fetch-based SSE reader on /v1/status/stream (fetch, not EventSource, so the
// API key can go in the Authorization header), the cluster and its requests drawn from each status, a
// timeline (timeline.js) whose past the head keeps (/v1/timeline, fetched once), and a chat box on
// /v1/chat/completions. Until the first status arrives the page says what it waits for instead of drawing
// an empty cluster. It holds no inline script (its Content-Security-Policy allows none) and never turns
// data into HTML.
"use strict";
const $ = (id) => document.getElementById(id);
// `history`: the last few statuses (link rates, and tokens/s from an older head that does not measure it)
const state = { history: [], prev: null, updates: 0, maxTps: 0, maxRunning: 0, events: [], shown: false };

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
    if (r.status === 401) {
      setConn("API key needed", "bad");
      waiting("This dashboard needs an API key", "Type one of the keys `flowedge http` was started with.");
      $("keyform").hidden = false;
      return;
    }
    if (!r.ok) throw new Error("HTTP " + r.status);
    $("keyform").hidden = true;
    if (!state.shown) waiting("Connecting to the head…", "The page draws the cluster once its first status arrives.");
    await readEvents(r, (data) => update(JSON.parse(data)));
    throw new Error("stream ended");
  } catch (err) {
    setConn("reconnecting", "bad");
    if (!state.shown) waiting("Cannot reach this server", "Trying again every 2 s (" + err.message + ").");
    setTimeout(connect, 2000);
  }
}

// the head's last minutes, once the head answers (asked again after a failure, with the next status): a page
// opened late draws what came before it
async function loadPast() {
  if (state.pastLoaded || state.pastLoading) return;
  state.pastLoading = true;
  try {
    const r = await fetch("/v1/timeline", { headers: headers() });
    if (r.ok) { addPast(await r.json()); state.pastLoaded = true; }
  } catch (err) {
    note("timeline: " + err.message);
  } finally {
    state.pastLoading = false;
  }
}

function setConn(text, cls) { const c = $("conn"); c.textContent = text; c.className = "pill " + cls; }

// before the first status: a message in place of the (empty) cluster, timeline and figures
function waiting(title, why) {
  state.shown = false;
  $("waiting").hidden = false;
  $("live").hidden = true;
  $("waittitle").textContent = title;
  $("waitwhy").textContent = why;
}
function showLive() {
  if (state.shown) return;
  state.shown = true;
  $("waiting").hidden = true;
  $("live").hidden = false;
  if (query.has("ask")) $("send").focus({ preventScroll: true });   // the question is in view; the cluster stays on top
}

// ---- one status ------------------------------------------------------------------------------------
function update(snap) {
  state.updates += 1;
  document.body.dataset.updates = state.updates;
  const nodes = snap.nodes;
  if (!nodes || !nodes.length) {
    setConn("head unreachable", "bad");
    note("the head does not answer");
    if (!state.shown) waiting("The head does not answer", "`flowedge http` is up; its head is not. Asking again every half second.");
    return;
  }
  const head = nodes[0];
  showLive();
  loadPast();
  setConn(head.ready ? "serving" : "waiting for stages", head.ready ? "ok" : "warn");
  $("model").textContent = text(head.model).split("/").pop() + " · " + text(head.strategy);
  about(head, snap.t);
  state.history.push({ t: snap.t, nodes: nodes, tokens: num((head.served || {}).tokens) || 0 });
  while (state.history.length > 10) state.history.shift();
  const tps = figures(head);
  drawClients(head.clients);
  drawMembership(head.membership);
  drawNodes(nodes);
  drawRequests(head);
  addSample(liveSample(snap.t, nodes, tps));
  drawTimeline();
  watchTrouble(nodes, state.prev);
  state.prev = nodes;
}

// the version the head runs and how long it has been up
function about(head, t) {
  const up = num(head.uptime_s) != null ? head.uptime_s : (num(head.started_unix) != null ? t - head.started_unix : null);
  $("about").textContent = (head.version ? "flowedge " + text(head.version) : "") + (up != null ? " · up " + duration(up) : "");
}
function duration(s) {
  if (s < 60) return Math.floor(s) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min";
  if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
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
  const tps = num(live.tokens_per_s) != null ? live.tokens_per_s : rate();   // the head's own figure when it has one
  state.maxTps = Math.max(state.maxTps, tps);
  state.maxRunning = Math.max(state.maxRunning, live.running || 0);
  document.body.dataset.maxTps = state.maxTps.toFixed(2);
  document.body.dataset.maxRunning = state.maxRunning;
  if (tps > 0 && (live.running || 0) >= 1 && !document.body.dataset.answered) {
    document.body.dataset.movedWhileAnswering = "yes";   // what the browser test checks, free of its polling
  }
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
  return tps;
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

// a stage's KV entries against the budget the head admits requests by; the head: what running requests reserve
function kvFacts(n) {
  if (n.role === "head") return num(n.kv_reserved_tokens) != null ? [["KV reserved", n.kv_reserved_tokens + " tokens"]] : [];
  const used = num(n.kv_tokens), budget = num(n.kv_budget_tokens);
  if (used == null && budget == null) return [];
  return [["KV cache", (used == null ? "-" : used) + (budget != null ? " / " + budget : "") + " tokens"]];
}
// the head's fencing term and the standby heads that follow it (node/standby_status.py)
function standbyFacts(n) {
  if (n.role !== "head" || num(n.term) == null) return [];
  const rows = Array.isArray(n.standbys) ? n.standbys : [];
  return [["term", String(n.term)], ...rows.map((r) => r || {}).map((r) => ["standby",
    text(r.node_id) + " at " + (text(r.address) || "-") + ", log " + fixed(r.log_behind_tokens, 0)
    + " tokens behind, heard " + fixed(r.last_seen_s, 1) + " s ago"])];
}
function kvFrac(n) {
  const used = num(n.kv_tokens), budget = num(n.kv_budget_tokens);
  return used != null && budget ? Math.min(1, used / budget) : null;
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
           ["link", (text(n.address) || "-") + ", " + linkRate(n, i)],
           ["rtt", num(n.rtt_ms) != null ? n.rtt_ms + " ms" : "-"], ["heartbeat", seen], ...kvFacts(n),
           ...standbyFacts(n)]));
  node.dataset.node = i;
  if (memFrac) node.append(bar("bar mem", memFrac, "memory used"));
  if (kvFrac(n) != null) node.append(bar("bar kv", kvFrac(n), "KV cache used of its budget"));
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

// boards lost, re-plans onto the boards left, spares waiting (node/shrink.py), the latest last
function drawMembership(m) {
  const events = m && Array.isArray(m.events) ? m.events.slice(-6) : [];
  const spares = m && Array.isArray(m.spares) ? m.spares : [];
  $("membership-box").hidden = !events.length && !spares.length;
  const when = (e) => num(e.at_unix) != null ? new Date(e.at_unix * 1000).toLocaleTimeString() + " " : "";
  $("membership").replaceChildren(...events.map((e) => el("li", "event " + text(e.kind), when(e) + text(e.text))),
    ...(spares.length ? [el("li", "spare", "spares: " + spares.map(text).join(", "))] : []));
  document.body.dataset.membership = events.length;
}

// ---- the requests running now ------------------------------------------------------------------------
function cell(v) { return el("td", "", v); }
function drawRequests(head) {
  const live = head.requests || {};
  const active = Array.isArray(live.active) ? live.active : [];
  const rows = active.map((r) => el("tr", "", cell(text(r && r.id)), cell(text(r && r.client) || "-"),
    cell(text(r && r.state)), cell(num(r && r.tokens) != null ? r.tokens : "-"), cell(fixed(r && r.tokens_per_s, 1)),
    cell(fixed(r && r.elapsed_s, 1) + " s"), cell(fixed(r && r.mean_accept_len, 2))));
  if (!rows.length) rows.push(el("tr", "muted", el("td", "", "no request running")));
  $("requests").replaceChildren(...rows);
  const queued = num(live.queued) || 0;
  $("reqnote").textContent = queued ? queued + " more queued" : "";
  document.body.dataset.requests = active.length;
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
$("spansel").addEventListener("change", () => drawTimeline());
window.addEventListener("resize", () => drawTimeline());
const query = new URLSearchParams(location.search);
if (query.has("ask")) {   // ?ask=TEXT[&max=N]: that question in the box, sent only when the user presses send
  $("prompt").value = query.get("ask");   // (a link must not spend the user's key on a question they never saw)
  if (query.has("max")) $("maxtok").value = query.get("max");
}
document.addEventListener("DOMContentLoaded", connect);   // after timeline.js, which the page loads next
