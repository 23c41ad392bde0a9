// The live view: one panel per engine (one, or one per Ray replica), fed by the server-sent
// events of /v1/engine/events (see api/live.py for the event's fields).
"use strict";

const TIMELINE_STEPS = 240;  // steps the timeline shows
const panels = {};  // engine name -> {node, steps: [], lastStepsPerS}
let controller = null;
let paused = false;

function colour(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function setStatus(text, bad) {
  const node = document.getElementById("status");
  node.textContent = text;
  node.classList.toggle("bad", !!bad);
}

function panel(name) {
  if (panels[name]) return panels[name];
  const node = document.getElementById("engine-template").content.firstElementChild.cloneNode(true);
  node.querySelector("h2").textContent = name === "engine" ? "Engine" : "Replica " + name;
  node.setAttribute("aria-label", name);
  node.dataset.engine = name;
  document.getElementById("engines").appendChild(node);
  panels[name] = { node, steps: [] };
  return panels[name];
}

function field(p, key) { return p.node.querySelector(`[data-k="${key}"]`); }

function sizeCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 300;
  const height = canvas.clientHeight || 200;
  if (canvas.width !== Math.round(width * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return { ctx, width, height };
}

function drawTimeline(canvas, steps) {
  const { ctx, width, height } = sizeCanvas(canvas);
  ctx.clearRect(0, 0, width, height);
  if (!steps.length) return;
  const rows = steps.map((s) => s.decode_rows + s.prefill_tokens / 16);
  const top = Math.max(4, ...rows);
  const maxMs = Math.max(1, ...steps.map((s) => s.duration_ms));
  const bar = width / TIMELINE_STEPS;
  const x0 = width - steps.length * bar;
  steps.forEach((s, i) => {
    const x = x0 + i * bar;
    const hDecode = (s.decode_rows / top) * (height - 14);
    const hPrefill = (s.prefill_tokens / 16 / top) * (height - 14);
    ctx.fillStyle = colour("--used");
    ctx.fillRect(x, height - hDecode, Math.max(1, bar - 1), hDecode);
    ctx.fillStyle = colour("--prefill");
    ctx.fillRect(x, height - hDecode - hPrefill, Math.max(1, bar - 1), hPrefill);
    if (s.preemptions) {
      ctx.fillStyle = colour("--warn");
      ctx.fillRect(x, 0, Math.max(2, bar - 1), 6);
    }
  });
  ctx.strokeStyle = colour("--ink");
  ctx.beginPath();
  steps.forEach((s, i) => {
    const x = x0 + i * bar + bar / 2;
    const y = height - (s.duration_ms / maxMs) * (height - 14);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = colour("--muted");
  ctx.font = "11px system-ui";
  ctx.fillText(`rows ≤ ${top.toFixed(0)} · step ≤ ${maxMs.toFixed(1)} ms`, 4, 12);
}

function drawBlocks(canvas, blocks) {
  const { ctx, width, height } = sizeCanvas(canvas);
  ctx.clearRect(0, 0, width, height);
  const n = blocks.length;
  if (!n) return;
  // The largest square cell that fits n cells in the canvas.
  let cell = Math.floor(Math.sqrt((width * height) / n));
  while (cell > 1 && Math.floor(width / cell) * Math.floor(height / cell) < n) cell -= 1;
  const perRow = Math.max(1, Math.floor(width / cell));
  const fills = { "0": colour("--free"), "1": colour("--cached"), "2": colour("--used") };
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = fills[blocks[i]];
    const gap = cell > 3 ? 1 : 0;
    ctx.fillRect((i % perRow) * cell, Math.floor(i / perRow) * cell, cell - gap, cell - gap);
  }
}

function fmt(v) { return v === null || v === undefined ? "–" : String(v); }

function render(engine) {
  const p = panel(engine.name);
  const s = engine.stats;
  p.steps = p.steps.concat(engine.steps).slice(-TIMELINE_STEPS);
  const used = (engine.kv_blocks.match(/2/g) || []).length;
  const preempted = engine.requests.filter((r) => r.state === "preempted").length;
  const recent = p.steps.filter((x) => x.time >= Date.now() / 1000 - 2);
  field(p, "running").textContent = s.num_running;
  field(p, "waiting").textContent = s.num_waiting;
  field(p, "preempted").textContent = preempted;
  field(p, "kv_used").textContent = engine.kv_blocks ? used : s.num_kv_blocks - s.num_free_kv_blocks;
  field(p, "kv_usage").textContent = (100 * s.kv_cache_usage).toFixed(1) + "%";
  field(p, "hit_rate").textContent = s.prefix_cache_queries
    ? (100 * s.prefix_cache_hits / s.prefix_cache_queries).toFixed(1) + "%" : "–";
  field(p, "steps_per_s").textContent = (recent.length / 2).toFixed(1);
  field(p, "preemptions").textContent = s.num_preemptions;
  drawTimeline(field(p, "timeline"), p.steps);
  drawBlocks(field(p, "blocks"), engine.kv_blocks);
  const body = field(p, "requests");
  body.textContent = "";
  for (const r of engine.requests) {
    const tr = document.createElement("tr");
    const cells = [r.id, r.state, r.prompt_tokens, r.cached_tokens, r.output_tokens,
      Math.round(r.age_ms), fmt(r.ttft_ms && Math.round(r.ttft_ms)), fmt(r.itl_ms && r.itl_ms.toFixed(1))];
    cells.forEach((c, i) => tr.appendChild(el("td", i >= 2 ? { class: "num" } : {}, String(c))));
    body.appendChild(tr);
  }
  field(p, "shown").textContent = engine.num_requests > engine.requests.length
    ? `(${engine.requests.length} of ${engine.num_requests})` : `(${engine.num_requests})`;
}

function showRejected(rejected) {
  const parts = Object.entries(rejected).map(([why, n]) => `${why}: ${n}`);
  document.getElementById("rejected").textContent = parts.length
    ? "Refused at admission (429/503): " + parts.join(", ") : "";
  document.getElementById("rejected").dataset.total =
    Object.values(rejected).reduce((a, b) => a + b, 0);
}

async function connect() {
  if (controller) controller.abort();
  if (paused) return;
  controller = new AbortController();
  const interval = document.getElementById("rate").value;
  setStatus("connecting…");
  try {
    const response = await apiFetch(`/v1/engine/events?interval_ms=${interval}`,
      { signal: controller.signal });
    if (!response.ok) {
      setStatus(await errorText(response), true);
      return;
    }
    setStatus("live");
    await readEvents(response, (name, data) => {
      const event = JSON.parse(data);
      if (name === "error") { setStatus(event.error, true); return; }
      document.getElementById("model").textContent = event.model;
      showRejected(event.rejected);
      for (const engine of event.engines) render(engine);
      document.body.dataset.events = String(Number(document.body.dataset.events || 0) + 1);
    });
    setStatus("the server ended the stream", true);
  } catch (e) {
    if (e.name !== "AbortError") setStatus("disconnected: " + e.message, true);
  }
}

function init() {
  setupKeyField(connect);
  document.getElementById("rate").addEventListener("change", connect);
  document.getElementById("pause").addEventListener("click", (e) => {
    paused = !paused;
    e.target.textContent = paused ? "Resume" : "Pause";
    if (paused) { controller && controller.abort(); setStatus("paused"); } else connect();
  });
  connect();
}

init();
