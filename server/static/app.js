// Strata's web app: a chat that streams from /v1/chat/completions, and a Monitor that polls /metrics.
// No build step: plain DOM code. The conversation lives in localStorage, so a reload keeps it.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "strata.conversation", KEY_STORE = "strata.apiKey", MAX_STORE = "strata.maxTokens";
let conversation = loadConversation();
let controller = null;       // the running request's AbortController (Stop aborts it; the server then STOPs the worker)
let monitorTimer = null;

function loadConversation() {
  try { return JSON.parse(localStorage.getItem(STORE)) || []; } catch (e) { return []; }
}
function saveConversation() { localStorage.setItem(STORE, JSON.stringify(conversation)); }

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// --- chat -------------------------------------------------------------------------------------------------------
function messageNode(m) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  if (m.reasoning) {
    const d = document.createElement("details");
    const s = document.createElement("summary");
    s.textContent = m.streaming && !m.content ? "Thinking…" : "Reasoning";
    const body = document.createElement("div");
    body.className = "reasoning";
    body.textContent = m.reasoning;
    d.append(s, body);
    div.append(d);
  }
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = m.content;
  div.append(content);
  if (m.meta) {
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = m.meta;
    div.append(meta);
  }
  return div;
}

function render() {
  const box = $("messages");
  box.replaceChildren(...conversation.map(messageNode));
  box.scrollTop = box.scrollHeight;
}

function updateLast() {
  const box = $("messages");
  const last = conversation[conversation.length - 1];
  const old = box.lastElementChild;
  const open = old && old.querySelector("details") && old.querySelector("details").open;
  const node = messageNode(last);
  if (open && node.querySelector("details")) node.querySelector("details").open = true;
  if (old) box.replaceChild(node, old); else box.append(node);
  box.scrollTop = box.scrollHeight;
}

// Every request names its limit: without one the server lets an answer run to the end of the context.
function maxTokens() {
  const n = parseInt($("max-tokens").value, 10);
  return Number.isFinite(n) && n > 0 ? n : 1024;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "", reasoning: "", streaming: true };
  conversation.push(reply);
  saveConversation();
  render();
  setBusy(true);
  controller = new AbortController();
  const history = conversation.filter((m) => m !== reply && m.role !== "error")
                              .map((m) => ({ role: m.role, content: m.content }));
  try {
    const resp = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({ messages: history, stream: true, stream_options: { include_usage: true },
                             max_tokens: maxTokens() }),
    });
    if (!resp.ok) {
      let msg = resp.status + " " + resp.statusText;
      try { msg = (await resp.json()).error.message; } catch (e) { /* not JSON */ }
      throw new Error(msg);
    }
    await readStream(resp, reply);
  } catch (e) {
    if (e.name === "AbortError") {
      reply.meta = "stopped";
    } else {
      conversation.push({ role: "error", content: String(e.message || e) });
    }
  } finally {
    reply.streaming = false;
    controller = null;
    if (!reply.content && !reply.reasoning && reply.meta !== "stopped") conversation.splice(conversation.indexOf(reply), 1);
    saveConversation();
    render();
    setBusy(false);
  }
}

async function readStream(resp, reply) {
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) throw new Error(obj.error.message);
        if (obj.choices && obj.choices.length) {
          const d = obj.choices[0].delta || {};
          if (d.reasoning_content) reply.reasoning += d.reasoning_content;
          if (d.content) reply.content += d.content;
          if (obj.choices[0].finish_reason === "length") reply.meta = "cut at the token limit";
          if (obj.timings) reply.meta = [reply.meta, obj.timings.predicted_per_second.toFixed(1) + " tok/s"]
                                           .filter(Boolean).join(" · ");
          updateLast();
        }
      }
    }
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation = [];
  saveConversation();
  render();
});
$("max-tokens").value = localStorage.getItem(MAX_STORE) || "1024";
$("max-tokens").addEventListener("change", () => localStorage.setItem(MAX_STORE, String(maxTokens())));
$("api-key").value = localStorage.getItem(KEY_STORE) || "";
$("api-key").addEventListener("change", () => localStorage.setItem(KEY_STORE, $("api-key").value.trim()));

// --- tabs -------------------------------------------------------------------------------------------------------
for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => {
    for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t === tab);
    for (const v of document.querySelectorAll(".view")) v.classList.toggle("hidden", v.id !== tab.dataset.view);
    if (tab.dataset.view === "monitor") startMonitor(); else stopMonitor();
  });
}

// --- monitor ----------------------------------------------------------------------------------------------------
function startMonitor() {
  if (monitorTimer) return;
  poll();
  monitorTimer = setInterval(poll, 500);
}
function stopMonitor() { clearInterval(monitorTimer); monitorTimer = null; }

async function poll() {
  let m;
  try {
    const resp = await fetch("metrics", { headers: headers() });
    let body = null;
    try { body = await resp.json(); } catch (e) { /* not JSON: said below */ }
    if (!resp.ok || !body) {
      const why = body && body.error ? body.error.message : resp.status + " " + resp.statusText;
      throw new Error("the server answered /metrics with " + why);
    }
    m = body;
  } catch (e) {
    return monitorFailed(e.name === "TypeError" ? "the server cannot be reached (" + e.message + ")" : e.message);
  }
  try {
    showMetrics(m);
    $("monitor-error").classList.add("hidden");
  } catch (e) {
    monitorFailed("the metrics could not be shown: " + e.message);
  }
}

// A failed poll says so in words, over figures that are then marked stale (never a blank box).
function monitorFailed(msg) {
  const box = $("monitor-error");
  box.textContent = "Metrics unavailable: " + msg + " — retrying every half second; the figures below are stale.";
  box.classList.remove("hidden");
  $("phase").textContent = "unknown";
}

function showMetrics(m) {
  const t = m.totals, info = m.worker.info || {};
  $("model-name").textContent = m.model;
  $("phase").textContent = m.phase;
  $("toks").textContent = m.tok_s.toFixed(1);
  $("queue").textContent = (m.queue.running ? "1 running" : "idle") + ", " + m.queue.waiting + " waiting";
  $("hitrate").textContent = t.hit_rate === null ? "n/a" : (100 * t.hit_rate).toFixed(1) + " %";
  $("spec").textContent = speculationText(t, info);
  $("requests").textContent = t.requests + " (" + t.cancel + " cancelled, " + t.error + " failed)";
  $("engine").textContent = [info.backend, info.arch, m.worker.max_context ? "ctx " + m.worker.max_context : ""]
                              .filter(Boolean).join(" · ") || (m.worker.alive ? "-" : "not loaded");
  const p = m.progress;
  if (p && p.prompt_tokens) {
    $("progress-bar").style.width = (100 * p.position / p.prompt_tokens).toFixed(1) + "%";
    $("progress-text").textContent = p.position + " / " + p.prompt_tokens + " tokens, " + p.tok_s.toFixed(0) + " tok/s";
  } else {
    $("progress-bar").style.width = m.phase === "generating" ? "100%" : "0";
    $("progress-text").textContent = m.phase === "generating" ? "prompt read; generating" : "no prompt being read";
  }
  $("last-error").textContent = m.worker.last_error || "none";
  drawCache(m.cache, info);
  drawRate(m.tok_s_series || []);
  const rows = m.history.slice(-50).reverse().map((h) => {
    const tr = document.createElement("tr");
    const cells = [h.id, h.endpoint, h.finish, h.prompt_tokens, h.cached_tokens, h.prompt_read, h.generated,
                   h.prompt_tok_s ?? "", h.decode_tok_s ?? "", h.lookups ? h.hits + "/" + h.lookups : "",
                   h.drafts_offered ? h.drafts_accepted + "/" + h.drafts_offered : "",
                   new Date(h.ended * 1000).toLocaleTimeString()];
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = c;
      if (h.error && c === h.finish) { td.className = "error"; td.title = h.error; }
      tr.append(td);
    }
    return tr;
  });
  $("history").tBodies[0].replaceChildren(...rows);
}

// Speculative decoding's figures (server/service.py speculation): acceptance and tokens per window, or why none.
function speculationText(t, info) {
  if (t.draft_acceptance === null || t.draft_acceptance === undefined) {
    return !info.draft || info.draft === "off" ? "off" : info.draft + " drafts: none offered yet";
  }
  return (info.draft ? info.draft + ": " : "") + (100 * t.draft_acceptance).toFixed(0) + " % accepted, " +
         (t.tokens_per_window === null ? "-" : t.tokens_per_window.toFixed(2)) + " tokens/window";
}

function drawCache(cache, info) {
  const canvas = $("cache-canvas"), note = $("cache-note");
  if (!cache) {
    canvas.classList.add("hidden");
    if (info.n_expert === "0") note.textContent = "no experts: this model is dense";
    else if (!info.n_expert) note.textContent = "no cache picture: the worker is not loaded";
    else if (info.backend === "cpu") note.textContent = "no expert cache: the cpu backend keeps every expert in RAM";
    else note.textContent = "no cache picture yet (the worker sends one after a request)";
    return;
  }
  canvas.classList.remove("hidden");
  const cw = Math.max(1, Math.min(16, Math.floor(1000 / cache.n_expert)));
  const ch = Math.max(2, Math.min(16, Math.floor(480 / cache.n_layer)));
  canvas.width = cw * cache.n_expert;
  canvas.height = ch * cache.n_layer;
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(canvas.width, canvas.height);
  for (let l = 0; l < cache.n_layer; l++) {
    for (let e = 0; e < cache.n_expert; e++) {
      const heat = cache.heat[l][e] / 255;
      // resident: blue, darker when hot; not resident: grey, turning orange when hot (a hot miss stands out)
      const rgb = cache.resident[l][e]
        ? [200 - 170 * heat, 215 - 130 * heat, 255 - 35 * heat]
        : [235 - 10 * heat, 235 - 95 * heat, 235 - 200 * heat];
      for (let y = l * ch; y < (l + 1) * ch; y++) {
        for (let x = e * cw; x < (e + 1) * cw; x++) {
          const i = 4 * (y * canvas.width + x);
          img.data[i] = rgb[0]; img.data[i + 1] = rgb[1]; img.data[i + 2] = rgb[2]; img.data[i + 3] = 255;
        }
      }
    }
  }
  ctx.putImageData(img, 0, 0);
  note.textContent = cache.n_layer + " layers × " + cache.n_expert + " experts, " + cache.resident_count +
                     " resident in VRAM";
}

function drawRate(series) {
  const canvas = $("toks-chart");
  const w = canvas.clientWidth || 800, h = canvas.clientHeight || 120;
  if (canvas.width !== w) canvas.width = w;
  if (canvas.height !== h) canvas.height = h;
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, w, h);
  const done = series.slice(0, -1);      // the current second is still counting: leave it out
  const top = Math.max(1, ...done);
  const pad = 14;
  ctx.fillStyle = "#6b6b70";
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText(top + " tok/s", 4, 11);
  ctx.fillText("-5 min", 4, h - 3);
  ctx.fillText("now", w - 24, h - 3);
  ctx.strokeStyle = "#2f6fde";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  done.forEach((v, i) => {
    const x = (i / Math.max(1, done.length - 1)) * (w - 2) + 1;
    const y = h - pad - (v / top) * (h - 2 * pad);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
  const recent = done.slice(-60).filter((v) => v > 0);
  $("toks-note").textContent = recent.length
    ? "last minute: " + (recent.reduce((a, b) => a + b, 0) / 60).toFixed(1) + " tok/s on average, peak " +
      Math.max(...recent) + " tok/s"
    : "no tokens generated in the last minute";
}

render();
fetch("metrics", { headers: headers() }).then((r) => r.json()).then((m) => { if (m.model) $("model-name").textContent = m.model; })
  .catch(() => {});
