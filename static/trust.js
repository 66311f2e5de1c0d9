// flashcode: the state a newcomer can trust. The transcript is replayed from the fragments that drew
// it live (so a reload shows what happened, tool steps included); the connection is shown, a message
// is refused while it is down, and the page resyncs when it comes back; slash-command completion;
// copy buttons on code blocks. Everything that talks to the server goes through htmx or the websocket.
(function () {
  "use strict";
  const $ = (sel, root) => (root || document).querySelector(sel);
  const conversationId = () => ($("#conversation-id") || {}).value || "";

  // ---------------------------------------------------------------- the transcript
  // <script type="application/json" class="transcript-replay"> holds the conversation's fragments, in
  // order, exactly as the websocket sent them; each is swapped like a websocket frame (out-of-band).
  function replay(root) {
    const blocks = root && root.querySelectorAll ? root.querySelectorAll("script.transcript-replay") : [];
    blocks.forEach((block) => {
      let fragments = [];
      try { fragments = JSON.parse(block.textContent || "[]"); } catch (_) { fragments = []; }
      block.remove();
      fragments.forEach((html) => htmx.swap("#messages", html, { swapStyle: "none" }));
      const transcript = $("#transcript");
      if (transcript) transcript.scrollTop = transcript.scrollHeight;
      document.body.dataset.replayed = String(fragments.length);
    });
  }
  htmx.onLoad(replay);
  // a transcript sent again out of band (GET /c/ID/sync) is replayed at once, not after htmx's settle
  // delay: the window never shows it empty in between
  document.body.addEventListener("htmx:oobAfterSwap", (e) => {
    const t = e.detail && (e.detail.target || e.detail.elt);
    if (t && t.id === "transcript") replay(document.getElementById("transcript"));
  });

  // ---------------------------------------------------------------- the approval dialog
  // The page's CSP has no 'unsafe-eval', which htmx's hx-on attributes and trigger filters need: they
  // would fail, so htmx is told not to try, and the dialog's keys are handled here. The form must never
  // submit itself (a GET of the page would cut the turn off); Enter in its reason field and Esc are Deny,
  // the default button, which sends the reason with it.
  htmx.config.allowEval = false;
  document.addEventListener("submit", (e) => {
    if (e.target.closest && e.target.closest(".approval-form")) e.preventDefault();
  }, true);
  document.addEventListener("keydown", (e) => {
    const form = e.target.closest && e.target.closest(".approval-form");
    if (!form || e.isComposing) return;
    const reason = e.key === "Enter" && e.target.name === "note";
    if (e.key !== "Escape" && !reason) return;
    e.preventDefault(); e.stopImmediatePropagation();
    const deny = form.querySelector('button[data-choice="deny"]');
    if (deny) deny.click();
  }, true);

  // the dialog's Sandbox line follows its network checkbox: it says how the command will run if allowed now
  document.addEventListener("change", (e) => {
    const box = e.target.closest && e.target.closest(".approval-network input[type=checkbox]");
    const line = box && box.closest(".approval-form") && box.closest(".approval-form").querySelector('[data-field="sandbox"]');
    if (line) line.textContent = line.textContent.replace(/network (on|off)$/, box.checked ? "network on" : "network off");
  });

  // ---------------------------------------------------------------- the connection
  // reconnect within a few seconds (the extension's default backs off to a minute)
  htmx.config.wsReconnectDelay = (retry) => Math.min(3000, 250 * 2 ** retry) * (0.5 + Math.random() / 2);
  let everOpen = false, down = false;
  function showConnection() {
    const c = $("#connection");
    if (c) c.hidden = !down;
    document.body.classList.toggle("disconnected", down);
    document.body.dataset.connection = down ? "down" : (everOpen ? "up" : "connecting");
    const status = $("#status .status-text");
    if (status && down) status.textContent = "Disconnected — reconnecting…";
  }
  function resync() {
    // what happened while the page was away (a reply finished, another window switched the model):
    // the chat window and the conversation list are drawn again from the server; the typed text stays
    // (the old box is read once the new one is in: what was typed meanwhile is kept, the cursor too)
    const old = $("#prompt");
    const had = old && document.activeElement === old;
    const id = conversationId();
    const chat = htmx.ajax("GET", id ? `/c/${id}` : "/", { target: "#chat-window", swap: "outerHTML" }).then(() => {
      const p = $("#prompt");
      if (!p || !old || p === old) return;
      if (old.value) p.value = old.value;
      if (had) {
        p.focus();
        p.setSelectionRange(old.selectionStart, old.selectionEnd);
      }
    });
    const list = refreshList(id);
    htmx.ajax("GET", "/engine-state", { target: "#menubar-model", swap: "none" });  // picker, Settings, About
    return Promise.allSettled([chat, list]);
  }
  const refreshList = (id) =>
    htmx.ajax("GET", `/conversations?current=${encodeURIComponent(id)}`, { target: "#conversation-list", swap: "outerHTML" });
  // another window sent a message or ended a reply: this one, when it shows that conversation and is not
  // writing itself, is drawn again (what is typed stays); any other one refreshes its conversation list.
  // Words that come while a redraw is on its way make one more redraw after it (none is lost).
  const generating = () => ($("#status") || {}).dataset?.state === "generating";
  let syncing = null;
  const pending = new Set();
  // body[data-following]: "busy" while a word from another window is being acted on, "idle" after
  function follow() {
    if (syncing) return;
    if (!pending.size) { document.body.dataset.following = "idle"; return; }
    document.body.dataset.following = "busy";
    const id = conversationId();
    // the window showing it gets the transcript, controls, gauge and list (out of band): what is typed,
    // attachments, window positions and zoom stay as they are
    const work = pending.has(id) && id && !generating()
      ? htmx.ajax("GET", `/c/${encodeURIComponent(id)}/sync`, { target: "#conversation-changed", swap: "none" })
      : refreshList(id);
    pending.clear();
    syncing = Promise.resolve(work).finally(() => { syncing = null; follow(); });
  }
  document.body.addEventListener("htmx:wsAfterMessage", (e) => {
    const frame = String((e.detail && e.detail.message) || "");
    if (!frame.includes('id="conversation-changed"')) return;
    pending.add(($("#conversation-changed") || {}).dataset?.conversation || "");
    follow();
  });
  document.body.addEventListener("htmx:wsOpen", () => {
    const wasDown = down;
    everOpen = true; down = false;
    showConnection();
    if (wasDown) resync();
  });
  document.body.addEventListener("htmx:wsClose", () => { if (everOpen) { down = true; showConnection(); } });
  document.body.addEventListener("htmx:wsConfigSend", (e) => {
    if (!down) return;
    e.preventDefault();  // the ws extension would queue it and send it later, unseen
    say("Not sent: flashcode's server is not connected. Your message is still in the box; send it again when the status says Ready.");
  });
  const say = (text) => window.flashcode.alertBox(text, "error");  // static/app.js, from page.html's template

  // ---------------------------------------------------------------- small actions
  function flash(button, text) {
    const old = button.textContent;
    button.textContent = text;
    setTimeout(() => { button.textContent = old; }, 1200);
  }
  document.addEventListener("click", (e) => {
    const t = e.target.closest("[data-action]");
    if (!t) return;
    if (t.dataset.action === "switch-model") {
      const win = $("#chat-window");
      if (win) { win.hidden = false; win.dispatchEvent(new Event("pointerdown", { bubbles: true })); }
      const picker = $("#model-picker");
      if (picker) { picker.focus(); picker.classList.add("attention"); setTimeout(() => picker.classList.remove("attention"), 1500); }
    } else if (t.dataset.action === "copy-code") {
      const code = t.closest(".code-block")?.querySelector("pre");
      if (code && navigator.clipboard) navigator.clipboard.writeText(code.innerText).then(() => flash(t, "Copied"), () => flash(t, "Copy failed"));
      else flash(t, "Copy failed");
    }
  });

  // ---------------------------------------------------------------- slash commands
  // Typing "/" at the start of the message lists the commands the server knows (#slash-commands).
  function commands() {
    const src = $("#slash-commands");
    try { return JSON.parse((src && src.textContent) || "[]"); } catch (_) { return []; }
  }
  function menu() { return $("#slash-menu"); }
  function closeMenu() { const m = menu(); if (m) m.remove(); }
  function showMenu(prompt) {
    const text = prompt.value;
    const m0 = /^\/(\S*)$/.exec(text);
    if (!m0) return closeMenu();
    const found = commands().filter((c) => c.name.startsWith(m0[1]));
    if (!found.length) return closeMenu();
    let m = menu();
    if (!m) {
      m = document.createElement("ul");
      m.id = "slash-menu"; m.className = "slash-menu"; m.setAttribute("role", "listbox");
      prompt.parentElement.insertBefore(m, prompt);
    }
    m.replaceChildren(...found.map((c, i) => {
      const li = document.createElement("li");
      li.setAttribute("role", "option"); li.dataset.name = c.name;
      if (i === 0) li.classList.add("selected");
      const name = document.createElement("strong"); name.textContent = "/" + c.name + (c.usage ? " " + c.usage : "");
      const help = document.createElement("span"); help.textContent = " — " + c.help;
      li.append(name, help);
      li.addEventListener("mousedown", (ev) => { ev.preventDefault(); pick(prompt, c.name); });
      return li;
    }));
  }
  function pick(prompt, name) { prompt.value = "/" + name + " "; closeMenu(); prompt.focus(); }
  document.addEventListener("input", (e) => { if (e.target.id === "prompt") showMenu(e.target); });
  document.addEventListener("keydown", (e) => {
    const m = menu();
    if (!m || e.target.id !== "prompt") return;
    const items = [...m.querySelectorAll("li")];
    const at = items.findIndex((li) => li.classList.contains("selected"));
    if (e.key === "ArrowDown" || e.key === "ArrowUp") {
      e.preventDefault();
      const next = (at + (e.key === "ArrowDown" ? 1 : items.length - 1)) % items.length;
      items.forEach((li, i) => li.classList.toggle("selected", i === next));
    } else if (e.key === "Tab" || (e.key === "Enter" && !e.shiftKey && at >= 0 && items[at].dataset.name !== e.target.value.slice(1).trim())) {
      e.preventDefault(); e.stopImmediatePropagation();
      pick(e.target, items[Math.max(at, 0)].dataset.name);
    } else if (e.key === "Escape") {
      e.stopImmediatePropagation(); closeMenu();
    } else if (e.key === "Enter" && !e.shiftKey) {
      closeMenu();  // an exact command: it is sent as it is (the box then empties without an input event)
    }
  }, true);
  document.addEventListener("submit", closeMenu, true);  // Send clicked with a command in the box
})();
