// Shared by the playground and the live view: the API key (kept in session storage, sent as
// `Authorization: Bearer`), fetch with it, and reading a server-sent-event stream from a
// fetch response (EventSource cannot send headers).
"use strict";

const KEY_STORAGE = "pagedserve-api-key";

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// The key field in the page header: its value lives in session storage (this tab only).
function setupKeyField(onChange) {
  const field = document.getElementById("api-key");
  if (!field) return;
  field.value = apiKey();
  field.addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, field.value.trim());
    if (onChange) onChange();
  });
}

// An error answer (OpenAI's shape) as one line of text.
async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error) return response.status + ": " + body.error.message;
  } catch (e) { /* not JSON */ }
  return "HTTP " + response.status;
}

async function apiFetch(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = headers(opts.headers);
  return fetch(path, opts);
}

// Calls onEvent(eventName, data) for each event of a text/event-stream response body, until
// the stream ends or the signal aborts it.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    buffer = buffer.replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
