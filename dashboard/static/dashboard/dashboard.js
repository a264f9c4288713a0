// Inferplane dashboard: small enhancements over server-rendered pages (each works without).
"use strict";

// Tenant switcher: the chosen tenant's same page (or its overview; see dashboard.views.home).
document.querySelectorAll("select[data-switch]").forEach((select) => {
  select.addEventListener("change", () => { window.location.assign(select.value); });
});

// Copy buttons (the new API key).
document.querySelectorAll("button[data-copy]").forEach((button) => {
  button.addEventListener("click", async () => {
    const text = document.querySelector(button.dataset.copy).textContent.trim();
    try {
      await navigator.clipboard.writeText(text);
      button.textContent = "Copied";
    } catch (e) {
      const range = document.createRange();
      range.selectNodeContents(document.querySelector(button.dataset.copy));
      window.getSelection().removeAllRanges();
      window.getSelection().addRange(range);
      button.textContent = "Selected: press Ctrl+C";
    }
  });
});

// Destructive actions ask first: listened for on the document, so that rows a live table
// swapped in (htmx) ask too.
document.addEventListener("submit", (event) => {
  const form = event.target.closest("form[data-confirm]");
  if (form && !window.confirm(form.dataset.confirm)) event.preventDefault();
});

// Uploads (an adapter, a batch file) with a progress bar (XHR: the browser reports bytes sent).
document.querySelectorAll("form[data-upload]").forEach((form) => {
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const bar = form.querySelector("[data-progress]");
    const error = form.querySelector("[data-upload-error]");
    const button = form.querySelector("button[type=submit]");
    const data = new FormData(form);
    let size = 0;
    for (const value of data.values()) if (value instanceof File) size += value.size;
    if (size > Number(form.dataset.maxBytes)) {
      error.textContent = `Too large: the limit is ${Number(form.dataset.maxBytes).toLocaleString()} bytes.`;
      error.hidden = false;
      return;
    }
    const xhr = new XMLHttpRequest();
    xhr.open("POST", form.action);
    xhr.upload.addEventListener("progress", (e) => {
      if (e.lengthComputable) bar.value = Math.round((100 * e.loaded) / e.total);
    });
    xhr.addEventListener("load", () => {
      button.disabled = false;
      if (xhr.status < 400 && xhr.responseURL) {
        window.location.assign(xhr.responseURL);  // where the form's view sent it
      } else {
        // The server answered with its page and the form's errors: show those errors here and
        // keep this page (its scripts, its confirmations, the files chosen) as it is.
        const served = new DOMParser().parseFromString(xhr.responseText, "text/html")
          .querySelector("form[data-upload]");
        const messages = served
          ? [...served.querySelectorAll(".error:not([hidden])")].map((e) => e.textContent.trim()).filter(Boolean)
          : [];
        error.textContent = messages.length
          ? messages.join(" ")
          : `The server refused the upload (HTTP ${xhr.status}). Nothing was stored.`;
        error.hidden = false;
        bar.hidden = true;
      }
    });
    xhr.addEventListener("error", () => {
      button.disabled = false;
      error.textContent = "The upload failed (connection lost). Nothing was stored; try again.";
      error.hidden = false;
    });
    bar.hidden = false; bar.value = 0; error.hidden = true; button.disabled = true;
    xhr.send(data);
  });
});

// The usage chart: tokens per model (stacked bars) and spend (line), per day.
const usage = document.getElementById("usage-data");
if (usage && window.Chart) {
  const data = JSON.parse(usage.textContent);
  const palette = ["#3b6fd8", "#e0803a", "#3aa76d", "#9b59b6", "#c0392b", "#16a085"];
  const chart = new window.Chart(document.getElementById("usage-chart"), {
    data: {
      labels: data.labels,
      datasets: [
        ...data.tokens.map((series, i) => ({
          type: "bar", label: `${series.model} tokens`, data: series.data,
          backgroundColor: palette[i % palette.length], stack: "tokens", yAxisID: "tokens",
        })),
        { type: "line", label: "spend (USD)", data: data.spend, borderColor: "#222",
          backgroundColor: "#222", yAxisID: "spend", tension: 0 },
      ],
    },
    options: {
      animation: false, maintainAspectRatio: false,
      scales: {
        tokens: { type: "linear", position: "left", stacked: true, beginAtZero: true },
        spend: { type: "linear", position: "right", beginAtZero: true, grid: { drawOnChartArea: false } },
        x: { stacked: true },
      },
    },
  });
  document.getElementById("usage-chart").dataset.points = String(
    chart.data.datasets.reduce((n, d) => n + d.data.filter((v) => v > 0).length, 0));
}

// Live parts (the operator's pools, batches, adapters being validated) poll their fragment
// with htmx every 2 s, the one mechanism for every live page; a tab in the background skips
// its polls, and catches up as soon as it is shown again.
document.addEventListener("htmx:before:request", (event) => {
  if (document.hidden && event.target.matches("[hx-trigger^='every']")) event.preventDefault();
});
document.addEventListener("visibilitychange", () => {
  if (document.hidden) return;
  for (const live of document.querySelectorAll("[hx-trigger^='every']")) htmx.ajax("GET", live.getAttribute("hx-get"), { source: live, target: live, swap: live.getAttribute("hx-swap") || "outerHTML" });
});
