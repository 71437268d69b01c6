// The console's only script. Pages work without it; it adds live refresh, copy buttons and
// confirmation prompts. No inline script exists anywhere (the Content-Security-Policy forbids it).
"use strict";

// Live parts: an element with data-live="URL" is replaced by the HTML fragment at URL every
// data-every ms (default 2000, at least 1000). One request in flight per element, none while the
// page is hidden, and a failing fragment backs off up to a minute.
function startLive(element) {
  const url = element.getAttribute("data-live");
  const baseMs = Math.max(1000, Number(element.getAttribute("data-every")) || 2000);
  let delayMs = baseMs;
  let inFlight = false;
  async function refresh() {
    if (inFlight || document.hidden) {
      schedule();
      return;
    }
    inFlight = true;
    try {
      const response = await fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } });
      if (response.redirected || response.status === 401) {
        window.location.assign("/console/sign-in");
        return;
      }
      if (!response.ok) {
        throw new Error("status " + response.status);
      }
      element.innerHTML = await response.text();
      element.removeAttribute("data-stale");
      delayMs = baseMs;
    } catch (error) {
      element.setAttribute("data-stale", "true");
      delayMs = Math.min(delayMs * 2, 60000);
    } finally {
      inFlight = false;
    }
    schedule();
  }
  function schedule() {
    window.setTimeout(refresh, delayMs);
  }
  schedule();
}

// Copy buttons: data-copy="ID" copies the text of the element with that id.
function startCopy(button) {
  button.addEventListener("click", async () => {
    const source = document.getElementById(button.getAttribute("data-copy"));
    if (!source) {
      return;
    }
    try {
      await navigator.clipboard.writeText(source.textContent.trim());
      button.textContent = "Copied";
    } catch (error) {
      const range = document.createRange();
      range.selectNodeContents(source);
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      button.textContent = "Selected: press Ctrl+C";
    }
  });
}

// Forms with data-confirm="QUESTION" ask before they submit.
function startConfirm(form) {
  form.addEventListener("submit", (event) => {
    if (!window.confirm(form.getAttribute("data-confirm"))) {
      event.preventDefault();
    }
  });
}

// File inputs with data-load-into="ID" put the chosen file's text into that textarea (the form
// then posts it like a paste), refusing files larger than the server would take.
const MAX_LOADED_BYTES = 60 * 1024;
function startLoadInto(input) {
  input.addEventListener("change", async () => {
    const target = document.getElementById(input.getAttribute("data-load-into"));
    const file = input.files && input.files[0];
    if (!target || !file) {
      return;
    }
    if (file.size > MAX_LOADED_BYTES) {
      input.setCustomValidity("this file is larger than 60 KiB; publish it with allotctl");
      input.reportValidity();
      return;
    }
    input.setCustomValidity("");
    target.value = await file.text();
  });
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-live]").forEach(startLive);
  document.querySelectorAll("[data-copy]").forEach(startCopy);
  document.querySelectorAll("form[data-confirm]").forEach(startConfirm);
  document.querySelectorAll("input[data-load-into]").forEach(startLoadInto);
});
