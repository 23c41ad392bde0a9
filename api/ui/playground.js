// The playground: builds the same request body the API documents, streams the answer, and
// shows TTFT, tokens/s, cached prompt tokens and the finish reason of each response.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], model: null, controller: null, lastRequest: null };

function numberField(id) {
  const raw = $(id).value.trim();
  return raw === "" ? null : Number(raw);
}

// The request body, from the settings (the same field names as the API).
function requestBody() {
  const mode = $("mode").value;
  const body = { model: state.model, stream: true, stream_options: { include_usage: true } };
  for (const id of ["temperature", "top_p", "max_tokens", "seed"]) {
    const v = numberField(id);
    if (v !== null) body[id] = v;
  }
  const topK = numberField("top_k");
  if (topK !== null && topK !== -1) body.top_k = topK;
  const stops = $("stop").value.split("\n").filter((s) => s.length > 0);
  if (stops.length) body.stop = stops;
  if (mode === "chat") {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    body.messages = messages.concat(state.messages);
    if ($("json-mode").checked) {
      body.response_format = { type: "json_schema",
        json_schema: { name: "playground", schema: JSON.parse($("schema").value) } };
    }
    if ($("tools-mode").checked) body.tools = JSON.parse($("tools").value);
  } else {
    body.prompt = $("prompt").value;
    if ($("logprobs").checked) body.logprobs = 5;
    if ($("json-mode").checked) {
      body.response_format = { type: "json_schema",
        json_schema: { name: "playground", schema: JSON.parse($("schema").value) } };
    }
  }
  return body;
}

function endpoint() {
  return $("mode").value === "chat" ? "/v1/chat/completions" : "/v1/completions";
}

// ---- copy as curl / openai-python ---------------------------------------------------------

function curlSnippet(path, body) {
  const key = apiKey() ? ' \\\n  -H "Authorization: Bearer $OPENAI_API_KEY"' : "";
  const json = JSON.stringify(body, null, 2).replace(/'/g, "'\\''");
  return `curl ${location.origin}${path} \\\n  -H "Content-Type: application/json"${key} \\\n` +
    `  -d '${json}'`;
}

function pyValue(v, indent) {
  const pad = "    ".repeat(indent);
  if (v === null) return "None";
  if (v === true) return "True";
  if (v === false) return "False";
  if (Array.isArray(v)) {
    if (!v.length) return "[]";
    return "[\n" + v.map((x) => pad + "    " + pyValue(x, indent + 1)).join(",\n") + ",\n" + pad + "]";
  }
  if (typeof v === "object") {
    const keys = Object.keys(v);
    if (!keys.length) return "{}";
    return "{\n" + keys.map((k) => pad + "    " + JSON.stringify(k) + ": " + pyValue(v[k], indent + 1))
      .join(",\n") + ",\n" + pad + "}";
  }
  return JSON.stringify(v);
}

// The SDK's own arguments where it has them; the rest (top_k, ...) go in extra_body.
const SDK_ARGS = new Set(["model", "messages", "prompt", "stream", "stream_options", "temperature",
  "top_p", "max_tokens", "seed", "stop", "response_format", "tools", "logprobs", "n"]);

function pythonSnippet(path, body) {
  const method = path === "/v1/chat/completions" ? "chat.completions" : "completions";
  const args = [];
  const extra = {};
  for (const [k, v] of Object.entries(body)) {
    if (SDK_ARGS.has(k)) args.push(`    ${k}=${pyValue(v, 1)},`);
    else extra[k] = v;
  }
  if (Object.keys(extra).length) args.push(`    extra_body=${pyValue(extra, 1)},`);
  const key = apiKey() ? 'os.environ["OPENAI_API_KEY"]' : '"none"';
  const read = body.stream
    ? (method === "chat.completions"
      ? "for chunk in response:\n    if chunk.choices:\n        print(chunk.choices[0].delta.content or \"\", end=\"\")\n"
      : "for chunk in response:\n    if chunk.choices:\n        print(chunk.choices[0].text, end=\"\")\n")
    : "print(response)\n";
  return `import os\n\nfrom openai import OpenAI\n\nclient = OpenAI(base_url="${location.origin}/v1", api_key=${key})\n` +
    `response = client.${method}.create(\n${args.join("\n")}\n)\n${read}`;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch (e) {  // no clipboard (an insecure origin): the snippet is shown to copy by hand
    $("request-details").open = true;
    button.textContent = "Shown below";
  }
  setTimeout(() => { button.textContent = button.dataset.label; }, 1500);
}

// ---- rendering ----------------------------------------------------------------------------

function addMessage(role, text) {
  const node = el("div", { class: "msg " + role }, text);
  $("log").appendChild(node);
  return node;
}

function showStats(s) {
  const parts = [];
  if (s.ttft !== null) parts.push(`TTFT ${s.ttft.toFixed(0)} ms`);
  if (s.tokensPerSecond !== null) parts.push(`${s.tokensPerSecond.toFixed(1)} tokens/s`);
  if (s.usage) {
    parts.push(`${s.usage.prompt_tokens} prompt tokens` +
      (s.usage.prompt_tokens_details ? ` (${s.usage.prompt_tokens_details.cached_tokens} cached)` : ""));
    parts.push(`${s.usage.completion_tokens} completion tokens`);
  }
  if (s.finish) parts.push(`finish_reason: ${s.finish}`);
  $("stats").textContent = parts.join(" · ");
  $("stats").dataset.finish = s.finish || "";
}

// A token's background: green for likely, red for unlikely (by its probability).
function tokenColour(logprob) {
  const p = Math.exp(logprob);
  const hue = Math.round(120 * p);
  return `hsla(${hue}, 75%, 55%, 0.35)`;
}

function showTip(node, event) {
  const tip = $("tip");
  tip.textContent = node.dataset.tip;
  tip.classList.remove("hidden");
  const box = node.getBoundingClientRect();
  tip.style.left = Math.min(box.left, window.innerWidth - 260) + "px";
  tip.style.top = (box.bottom + 6) + "px";
}

function hideTip() { $("tip").classList.add("hidden"); }

function addTokens(container, choice) {
  const lp = choice.logprobs;
  if (!lp || !lp.tokens || !lp.tokens.length) {
    container.appendChild(document.createTextNode(choice.text));
    return;
  }
  lp.tokens.forEach((token, i) => {
    const logprob = lp.token_logprobs[i];
    const top = lp.top_logprobs ? lp.top_logprobs[i] : null;
    const span = el("span", { class: "tok", tabindex: "0" }, token);
    if (logprob !== null && logprob !== undefined) {
      span.style.background = tokenColour(logprob);
      const lines = [`${JSON.stringify(token)}  p=${Math.exp(logprob).toFixed(3)}`];
      if (top) {
        for (const [alt, v] of Object.entries(top).sort((a, b) => b[1] - a[1])) {
          lines.push(`${JSON.stringify(alt).padEnd(16)} ${Math.exp(v).toFixed(3)}`);
        }
      }
      span.dataset.tip = lines.join("\n");
      span.setAttribute("aria-label", lines.join("; "));
      span.addEventListener("mouseenter", (e) => showTip(span, e));
      span.addEventListener("focus", (e) => showTip(span, e));
      span.addEventListener("mouseleave", hideTip);
      span.addEventListener("blur", hideTip);
    }
    container.appendChild(span);
  });
}

// ---- sending ------------------------------------------------------------------------------

async function send() {
  const mode = $("mode").value;
  if (mode === "chat") {
    const text = $("message").value;
    if (!text.trim()) return;
    state.messages.push({ role: "user", content: text });
    addMessage("user", text);
    $("message").value = "";
  }
  let body;
  try {
    body = requestBody();
  } catch (e) {
    addMessage("error", "Invalid JSON in the schema or tools box: " + e.message);
    if (mode === "chat") state.messages.pop();
    return;
  }
  const path = endpoint();
  state.lastRequest = { path, body };
  $("snippet").textContent = curlSnippet(path, body);
  for (const id of ["copy-curl", "copy-python"]) $(id).disabled = false;
  await stream(path, body, mode);
}

async function stream(path, body, mode) {
  const controller = new AbortController();
  state.controller = controller;
  $("send").disabled = true;
  $("stop-btn").disabled = false;
  const out = mode === "chat" ? addMessage("assistant", "") : $("completion-out");
  if (mode !== "chat") out.textContent = "";
  out.dataset.done = "false";
  const started = performance.now();
  const s = { ttft: null, tokensPerSecond: null, usage: null, finish: null };
  let first = null;
  let text = "";
  const calls = {};
  try {
    const response = await apiFetch(path, { method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json" }, signal: controller.signal });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (name, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) s.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = mode === "chat" ? (choice.delta.content || "") : choice.text;
        if ((piece || (choice.delta && choice.delta.tool_calls)) && first === null) {
          first = performance.now();
          s.ttft = first - started;
        }
        if (mode === "chat") {
          text += piece;
          for (const call of choice.delta.tool_calls || []) {
            const c = calls[call.index] = calls[call.index] || { name: "", arguments: "" };
            if (call.function && call.function.name) c.name = call.function.name;
            if (call.function && call.function.arguments) c.arguments += call.function.arguments;
          }
          out.textContent = text;
        } else {
          text += piece;
          addTokens(out, choice);
        }
        if (choice.finish_reason) s.finish = choice.finish_reason;
      }
    });
    const names = Object.values(calls);
    if (names.length) {
      out.appendChild(el("div", { class: "calls" },
        names.map((c) => `→ ${c.name}(${c.arguments})`).join("\n")));
    }
    if (mode === "chat") {
      const message = { role: "assistant", content: text };
      if (names.length) {
        message.tool_calls = names.map((c, i) => ({ id: "call_" + i, type: "function",
          function: { name: c.name, arguments: c.arguments } }));
      }
      state.messages.push(message);
    }
  } catch (e) {
    if (e.name === "AbortError") s.finish = s.finish || "stopped by you";
    else addMessage("error", String(e.message || e));
    if (mode === "chat" && text) state.messages.push({ role: "assistant", content: text });
  } finally {
    const end = performance.now();
    if (first !== null && s.usage && s.usage.completion_tokens > 1 && end > first) {
      s.tokensPerSecond = (s.usage.completion_tokens - 1) / ((end - first) / 1000);
    }
    showStats(s);
    out.dataset.done = "true";
    state.controller = null;
    $("send").disabled = false;
    $("stop-btn").disabled = true;
  }
}

// ---- wiring -------------------------------------------------------------------------------

function showMode() {
  const chat = $("mode").value === "chat";
  for (const id of ["system-box", "chat-box", "tools-check", "log"]) $(id).classList.toggle("hidden", !chat);
  for (const id of ["completion-box", "logprobs-check"]) $(id).classList.toggle("hidden", chat);
  $("tools").classList.toggle("hidden", !chat || !$("tools-mode").checked);
}

async function loadModel() {
  try {
    const response = await apiFetch("/v1/models");
    if (!response.ok) throw new Error(await errorText(response));
    const models = await response.json();
    state.model = models.data[0].id;
    $("model").textContent = state.model;
  } catch (e) {
    $("model").textContent = "models: " + e.message;
  }
}

function init() {
  setupKeyField(loadModel);
  $("mode").addEventListener("change", showMode);
  $("json-mode").addEventListener("change", () => $("schema").classList.toggle("hidden", !$("json-mode").checked));
  $("tools-mode").addEventListener("change", showMode);
  $("send").addEventListener("click", send);
  $("stop-btn").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => {
    state.messages = [];
    $("log").textContent = "";
    $("completion-out").textContent = "";
    $("stats").textContent = "";
  });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  for (const [id, make] of [["copy-curl", curlSnippet], ["copy-python", pythonSnippet]]) {
    const button = $(id);
    button.dataset.label = button.textContent;
    button.addEventListener("click", () => {
      if (!state.lastRequest) return;
      const text = make(state.lastRequest.path, state.lastRequest.body);
      $("snippet").textContent = text;
      copyText(text, button);
    });
  }
  showMode();
  loadModel();
}

init();
