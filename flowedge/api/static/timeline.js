// flowedge dashboard, the timeline: one series of samples { t, tps, queued, running, loads } drawn on a canvas.
// Its past comes from the head (/v1/timeline: a sample a second of the last ten minutes, fetched once when the
// page opens), its present from each status the stream brings. `loads` maps a row ("head", "stage 1", ...)
// to that node's busy fraction, null for an empty stage slot. Uses dashboard.js's helpers ($, num, text, who).
"use strict";
const KEEP_S = 600;                      // the longest span the page offers, and what the head keeps
const series = [];

// one status from the stream, as a sample
function liveSample(t, nodes, tps) {
  const loads = {};
  nodes.forEach((n, i) => {
    if (i > 0 && n.role !== "stage") return;   // drafters have no row
    loads[who(n, i)] = n.missing ? null : Math.min(1, Math.max(0, num(n.load) || 0));
  });
  const live = nodes[0].requests || {};
  return { t: t, tps: tps, queued: num(live.queued) || 0, running: num(live.running) || 0, loads: loads };
}

// the head's past: [t, tokens_per_s, queued, running, head_load, [[stage, load, step_ms, kv_tokens], ...]]
// read by the field names it sends, so a field added later or moved does not shift the rest
function pastSamples(past) {
  const f = Array.isArray(past.fields) ? past.fields : [], sf = Array.isArray(past.stage_fields) ? past.stage_fields : [];
  const at = (name) => f.indexOf(name), st = (name) => sf.indexOf(name);
  const samples = Array.isArray(past.samples) ? past.samples : [];
  return samples.filter((s) => Array.isArray(s) && num(s[at("t")]) != null).map((s) => {
    const loads = { head: Math.min(1, Math.max(0, num(s[at("head_load")]) || 0)) };
    (Array.isArray(s[at("stages")]) ? s[at("stages")] : []).forEach((g) => {
      if (!Array.isArray(g)) return;
      const load = num(g[st("load")]);
      loads["stage " + text(g[st("stage")])] = load == null ? null : Math.min(1, Math.max(0, load));
    });
    return { t: s[at("t")], tps: num(s[at("tokens_per_s")]) || 0, queued: num(s[at("queued")]) || 0,
             running: num(s[at("running")]) || 0, loads: loads };
  });
}

function addSample(s) {
  series.push(s);
  while (series.length && series[0].t < s.t - KEEP_S) series.shift();
}

// the head's past goes before what the stream has brought since the page opened
function addPast(past) {
  const first = series.length ? series[0].t : Infinity;
  const older = pastSamples(past).filter((s) => s.t < first);
  series.unshift(...older);
  document.body.dataset.past = older.length;
  if (older.length) document.body.dataset.pastFrom = older[0].t;
  drawTimeline();
}

function drawTimeline() {
  const c = $("timeline");
  if (!series.length || c.offsetParent === null) return;   // nothing yet, or the page is not shown
  const span = Number($("spansel").value) || 120, now = series[series.length - 1].t;
  const rows = Object.keys(series[series.length - 1].loads), label = 70, rowH = 24, axis = 16;
  const w = c.clientWidth || 600, h = (rows.length + 2) * rowH + axis;
  if (c.width !== w) c.width = w;
  if (c.height !== h) c.height = h;
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const x = (t) => label + (c.width - label) * (1 - (now - t) / span);
  const shown = series.filter((s) => s.t >= now - span - 5);
  const maxTps = Math.max(1, ...shown.map((s) => s.tps)), maxReq = Math.max(1, ...shown.map((s) => s.running + s.queued));
  $("tpsmax").textContent = maxTps.toFixed(1);
  $("reqmax").textContent = maxReq;
  g.font = "12px system-ui";
  g.fillStyle = "#8a96a3";
  [...rows, "tokens/s", "requests"].forEach((name, r) => g.fillText(name, 4, r * rowH + rowH / 2 + 4));
  for (let i = 1; i < shown.length; i++) {
    const a = shown[i - 1], b = shown[i];
    const x0 = Math.max(label, x(a.t)), wd = Math.max(1, x(b.t) - x0 - 1);
    if (b.t - a.t > 10 || x(b.t) < label) continue;   // a gap in what was seen: leave it empty
    rows.forEach((name, r) => {
      if (!(name in b.loads)) return;
      const load = b.loads[name];
      g.fillStyle = load == null ? "rgba(248,81,73,0.5)" : `rgba(88,166,255,${0.08 + 0.92 * load})`;
      g.fillRect(x0, r * rowH + 3, wd, rowH - 6);
    });
    bars(g, x0, wd, (rows.length + 1) * rowH - 3, rowH - 6, [[b.tps / maxTps, "#3fb950"]]);
    bars(g, x0, wd, (rows.length + 2) * rowH - 3, rowH - 6,
         [[b.running / maxReq, "#d29922"], [b.queued / maxReq, "#8a96a3"]]);
  }
  ticks(g, label, c.width, (rows.length + 2) * rowH + 12, span);
}

// stacked bars from the bottom `y` up, each [fraction of `height`, colour]
function bars(g, x0, wd, y, height, parts) {
  for (const [frac, colour] of parts) {
    const bh = height * Math.min(1, Math.max(0, frac));
    g.fillStyle = colour;
    g.fillRect(x0, y - bh, wd, bh);
    y -= bh;
  }
}

function ticks(g, left, right, y, span) {
  g.fillStyle = "#8a96a3";
  const step = span <= 60 ? 10 : span <= 180 ? 30 : 120;
  for (let ago = 0; ago <= span; ago += step) {
    const at = left + (right - left) * (1 - ago / span);
    const name = ago === 0 ? "now" : ago < 60 ? "-" + ago + " s" : "-" + ago / 60 + " min";
    g.fillText(name, Math.min(right - 28, Math.max(left, at - 12)), y);
  }
}
