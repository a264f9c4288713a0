// The playground: one chat completion at a time over /v1/ws, with a per-tab playground key.
"use strict";

const form = document.getElementById("playground");
if (form) {
  const $ = (selector) => document.querySelector(selector);
  const storeKey = `inferplane-playground-${form.dataset.tenant}`;
  let socket = null;
  let current = null;

  const csrf = () => form.querySelector("input[name=csrfmiddlewaretoken]").value;

  async function playgroundKey(fresh) {
    let key = fresh ? null : sessionStorage.getItem(storeKey);
    if (!key) {
      const response = await fetch(form.dataset.keyUrl, {
        method: "POST", headers: { "X-CSRFToken": csrf() }, credentials: "same-origin",
      });
      if (!response.ok) throw new Error(`Could not create a playground key (HTTP ${response.status}).`);
      const body = await response.json();
      key = body.key;
      sessionStorage.setItem(storeKey, key);
      $("[data-key]").textContent = `key ${body.prefix}`;
    }
    return key;
  }

  function connect(key) {
    return new Promise((resolve, reject) => {
      const ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/ws`);
      ws.onopen = () => ws.send(JSON.stringify({ type: "auth", api_key: key }));
      ws.onmessage = (event) => {
        const message = JSON.parse(event.data);
        if (message.type === "authenticated") { ws.onmessage = receive; resolve(ws); }
        else if (message.type === "error") { ws.close(); reject(message.error); }
      };
      ws.onerror = () => reject({ message: "The WebSocket could not connect." });
    });
  }

  async function ensureSocket() {
    if (socket && socket.readyState === WebSocket.OPEN) return socket;
    try {
      socket = await connect(await playgroundKey(false));
    } catch (error) {
      if (error && error.code === "invalid_api_key") {  // expired or revoked: a new one
        sessionStorage.removeItem(storeKey);
        socket = await connect(await playgroundKey(true));
      } else {
        throw error;
      }
    }
    socket.onclose = () => { socket = null; };
    return socket;
  }

  function showError(error) {
    const box = $("[data-error]");
    box.textContent = (error && error.message) || String(error);
    box.hidden = false;
  }

  function finish() {
    form.querySelector("button[type=submit]").disabled = false;
    $("[data-stop]").hidden = true;
    current = null;
  }

  function receive(event) {
    const message = JSON.parse(event.data);
    if (!current || message.id !== current.id) return;
    if (message.type === "chunk") {
      const choice = (message.data.choices || [])[0];
      const text = choice && choice.delta && choice.delta.content;
      if (text) {
        if (!current.first) {
          current.first = performance.now();
          $("[data-ttft]").textContent = `${Math.round(current.first - current.sent)} ms`;
        }
        $("[data-answer]").textContent += text;
      }
    } else if (message.type === "done") {
      const tokens = message.usage.completion_tokens;
      const seconds = (performance.now() - (current.first || current.sent)) / 1000;
      $("[data-tokens]").textContent = `${message.usage.prompt_tokens} in / ${tokens} out`;
      $("[data-tps]").textContent = seconds > 0 ? (tokens / seconds).toFixed(1) : "—";
      finish();
    } else if (message.type === "error") {
      showError(message.error);
      finish();
    }
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (current) return;
    const data = new FormData(form);
    const messages = [];
    if (data.get("system")) messages.push({ role: "system", content: data.get("system") });
    messages.push({ role: "user", content: data.get("message") });
    $("[data-answer]").textContent = "";
    $("[data-error]").hidden = true;
    for (const field of ["[data-ttft]", "[data-tps]", "[data-tokens]"]) $(field).textContent = "—";
    form.querySelector("button[type=submit]").disabled = true;
    try {
      const ws = await ensureSocket();
      current = { id: crypto.randomUUID(), sent: performance.now(), first: null };
      $("[data-stop]").hidden = false;
      ws.send(JSON.stringify({
        type: "request", id: current.id, endpoint: "chat.completions",
        body: {
          model: data.get("model"), messages, stream: true,
          max_tokens: Number(data.get("max_tokens")), temperature: Number(data.get("temperature")),
          stream_options: { include_usage: true },
        },
      }));
    } catch (error) {
      showError(error);
      finish();
    }
  });

  $("[data-stop]").addEventListener("click", () => {
    if (current && socket) socket.send(JSON.stringify({ type: "cancel", id: current.id }));
    finish();
  });
}
