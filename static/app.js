// flashcode: what htmx cannot do by itself: keyboard shortcuts, auto-scroll, window dragging,
// and a few menu actions. Everything that talks to the server goes through htmx or the websocket.
(function () {
  "use strict";
  const $ = (sel, root) => (root || document).querySelector(sel);
  const csrf = () => JSON.parse(document.body.getAttribute("hx-headers") || "{}")["X-CSRF-Token"];
  const conversationId = () => ($("#conversation-id") || {}).value || "";
  // the project this window shows (another window, or `flashcode ask --project`, may have opened another)
  const shownProject = () => ($('#composer input[name="project_id"]') || {}).value || "";
  const generating = () => ($("#status") || {}).dataset?.state === "generating";

  // ---------------------------------------------------------------- windows
  let z = 10;
  function focusWindow(win) {
    if (!win) return;
    document.querySelectorAll("[data-window].active").forEach((w) => w !== win && w.classList.remove("active"));
    win.classList.add("active");
    win.style.zIndex = ++z;
  }
  function openWindow(id) {
    const win = document.getElementById(id);
    if (!win) return;
    win.hidden = false;
    focusWindow(win);
    refreshParts(win);
  }
  // a window's [data-refresh] parts (hx-trigger "refresh") are drawn again from the server: what changed
  // elsewhere shows (Settings: a rule saved in an approval dialog); not a part being typed in
  function refreshParts(win) {
    win.querySelectorAll("[data-refresh]").forEach((part) => {
      const typed = [...part.querySelectorAll("input, textarea")].some((f) => f.value !== f.defaultValue);
      if (!typed && !part.contains(document.activeElement)) htmx.trigger(part, "refresh");
    });
  }
  document.addEventListener("pointerdown", (e) => {
    const win = e.target.closest("[data-window]");
    if (win) focusWindow(win);
    const bar = e.target.closest(".title-bar");
    if (!bar || e.target.closest("button") || !win || win.classList.contains("zoomed")) return;
    e.preventDefault();  // dragging a window selects no text
    const desk = win.parentElement.getBoundingClientRect();
    const start = win.getBoundingClientRect();
    const dx = e.clientX - start.left, dy = e.clientY - start.top;
    const move = (ev) => {
      // the title bar stays on the desktop: a window can never be dragged out of reach
      win.style.left = Math.min(Math.max(0, ev.clientX - dx - desk.left), desk.width - 80) + "px";
      win.style.top = Math.min(Math.max(0, ev.clientY - dy - desk.top), desk.height - 24) + "px";
      win.style.right = "auto"; win.style.bottom = "auto";
      win.style.width = start.width + "px"; win.style.height = start.height + "px";
    };
    const up = () => { document.removeEventListener("pointermove", move); document.removeEventListener("pointerup", up); };
    document.addEventListener("pointermove", move);
    document.addEventListener("pointerup", up);
  });

  // ---------------------------------------------------------------- actions
  function newConversation() {
    const shown = shownProject();  // the window's, not necessarily the one open now
    const url = shown ? `/?project=${encodeURIComponent(shown)}` : "/";
    htmx.ajax("GET", url, { target: "#chat-window", swap: "outerHTML" }).then(() => {
      history.pushState({}, "", "/");
      markSelected("");
      focusPrompt();
    });
  }
  // Rename…, Move to Trash and Export act on the conversation the chat window shows
  const NONE_OPEN = "No conversation is open: click one in the Conversations window (or send a message to start this one), then try again.";
  function download(ext) {
    const id = conversationId();
    if (!id) return alertBox(NONE_OPEN);
    const a = document.createElement("a");
    a.href = `/c/${id}/export.${ext}`; a.download = ""; document.body.appendChild(a); a.click(); a.remove();
  }
  function post(path, values) {
    return htmx.ajax("POST", path, { values, headers: { "X-CSRF-Token": csrf() }, target: "#conversation-list", swap: "outerHTML" });
  }
  async function rename() {
    const id = conversationId();
    if (!id) return alertBox(NONE_OPEN);
    const title = await ask("Rename this conversation to:", { value: chatTitle(), ok: "Rename" });
    if (title === null) return;  // Cancel
    if (!title.trim()) return alertBox("Not renamed: a title cannot be empty.");  // it did nothing (walkthrough)
    post(`/c/${id}/rename`, { title: title.trim() });
  }
  // File › Rename Project…: the project this window shows (its name everywhere: the page is drawn again)
  async function renameProject() {
    const label = $("#menubar-project");
    const pid = shownProject();
    if (!label || !pid || pid === "default") return alertBox("Default is the scratch project and keeps its name: open or create a project to name one.");
    const name = await ask(`Rename the project “${label.textContent}” to:`, { value: label.textContent, ok: "Rename" });
    if (name === null) return;  // Cancel
    if (!name.trim()) return alertBox("Not renamed: a project name cannot be empty.");
    htmx.ajax("POST", "/projects/rename", { values: { project_id: pid, name: name.trim() }, headers: { "X-CSRF-Token": csrf() }, swap: "none" });
  }
  async function remove() {
    const id = conversationId();
    if (!id) return alertBox(NONE_OPEN);
    const yes = await ask(`Move “${chatTitle()}” to the Trash? View › Trash puts it back.`, { ok: "Move to Trash" });
    if (yes !== null) post(`/c/${id}/delete`, { draft: ($("#prompt") || {}).value || "" });  // kept for Undo
  }
  // the Trash window: one conversation, or all of them, deleted for good (asked first: no undo)
  const trashPost = (path, values = {}) => htmx.ajax("POST", path, { values, headers: { "X-CSRF-Token": csrf() }, target: "#trash-pane", swap: "outerHTML" });
  async function deleteNow(button) {
    const yes = await ask(`Delete “${button.dataset.title}” for good? This cannot be undone.`, { ok: "Delete", safe: true });
    if (yes !== null) trashPost(`/c/${button.dataset.id}/delete-now`);
  }
  async function emptyTrash() {
    const ids = [...document.querySelectorAll("#trash-pane li[data-id]")].map((li) => li.dataset.id);
    const n = ids.length;
    if (!n) return alertBox("The Trash is empty.");
    const yes = await ask(`Delete ${n === 1 ? "the 1 conversation" : `all ${n} conversations`} in the Trash for good? This cannot be undone.`, { ok: "Empty Trash", safe: true });
    if (yes !== null) trashPost("/trash/empty", { ids: ids.join(",") });  // those shown: not one trashed since
  }
  // File › Import Conversation…: a conversation's JSON export (File › Export as JSON) comes back as a new one
  function importConversation() {
    const input = $("#import-file");
    if (!input) return;
    input.value = "";  // the same file chosen twice is a change too
    input.click();
  }
  // a passing word in the status line (Copy Last Reply), without a dialog to dismiss
  function note(text) {
    const s = $("#status .status-text");
    if (!s || generating()) return;
    const old = s.textContent;
    s.textContent = text;
    setTimeout(() => { if (s.textContent === text) s.textContent = old; }, 1800);
  }
  // the page's boxes are made from the templates page.html renders (templates/macros.html): no markup here
  const fromTemplate = (id) => $(`#${id}`).content.firstElementChild.cloneNode(true);
  // an alert with an OK button (Return on an empty message box presses it too); kind: "note" or "error"
  function alertBox(text, kind = "note") {
    const box = fromTemplate("alert-template");
    box.classList.replace("alert-error", `alert-${kind}`); box.dataset.kind = kind;
    box.querySelector(".alert-text").textContent = text;
    $("#alerts").appendChild(box);
  }
  window.flashcode = Object.assign(window.flashcode || {}, { alertBox });  // static/trust.js says things with it
  // While a dialog asks, the page behind it is inert (modal, as System 7's were): what is beside #alerts, and
  // beside each box it is in, up to the body. Counted: two dialogs at once release the page after the last.
  let held = [];
  let asking = 0;
  function holdPage() {
    if (asking++ > 0) return;
    held = [];
    for (let el = $("#alerts"); el && el !== document.body; el = el.parentElement) {
      held.push(...[...el.parentElement.children].filter((sib) => sib !== el && !sib.inert));
    }
    held.forEach((el) => { el.inert = true; });
  }
  function releasePage() {
    if (asking === 0 || --asking > 0) return;
    held.forEach((el) => { el.inert = false; });
    held = [];
  }
  // A modal System 7 dialog: resolves to the text typed (or "" without a field), or null on Cancel/Esc.
  // `safe`: Cancel is the default button (Return), for a choice that cannot be undone.
  function ask(text, { value = null, ok = "OK", safe = false } = {}) {
    return new Promise((resolve) => {
      const box = fromTemplate("dialog-template");
      if (value === null) box.querySelector(".dialog-input").remove();
      box.querySelector(".alert-text").textContent = text;
      box.querySelector(".dialog-ok").textContent = ok;
      if (safe) {
        box.querySelector(".dialog-ok").className = "btn dialog-ok";
        box.querySelector(".dialog-ok").type = "button";
        box.querySelector(".dialog-cancel").className = "btn btn-default dialog-cancel";
        box.querySelector(".dialog-cancel").type = "submit";
      }
      const input = box.querySelector(".dialog-input");
      if (input) input.value = value;
      // modal, as System 7's were: the page behind it takes no clicks or keys until it is answered (a form behind
      // a confirm could be filled and sent: walkthrough); #alerts stays live (an agent's approval may come)
      holdPage();
      const gone = new MutationObserver(() => { if (!box.isConnected) { gone.disconnect(); releasePage(); } });
      const close = (result) => { box.remove(); document.removeEventListener("keydown", onKey, true); resolve(result); };
      const onKey = (e) => { if (e.key === "Escape") { e.stopPropagation(); e.preventDefault(); close(null); } };
      box.querySelector("form").addEventListener("submit", (e) => { e.preventDefault(); close(safe ? null : (input ? input.value : "")); });
      if (safe) box.querySelector(".dialog-ok").addEventListener("click", () => close(""));
      // (no submit after it: Return on a safe dialog's Cancel submitted a form already removed, and the console said so)
      box.querySelector(".dialog-cancel").addEventListener("click", (e) => { e.preventDefault(); close(null); });
      document.addEventListener("keydown", onKey, true);
      $("#alerts").appendChild(box);
      gone.observe($("#alerts"), { childList: true, subtree: true });  // however it goes, the page comes back
      (input || box.querySelector(safe ? ".dialog-cancel" : ".dialog-ok")).focus();
      if (input) input.select();
    });
  }
  const click = (sel) => { const b = $(sel); if (b && !b.disabled) b.click(); };
  const actions = {
    new: newConversation, rename, delete: remove, import: importConversation, "rename-project": renameProject,
    "empty-trash": emptyTrash,
    "export-md": () => download("md"), "export-json": () => download("json"),
    stop: () => {  // with nothing being written the item is greyed; chosen all the same, it says so
      const b = $("#stop-button");
      if (b && !b.disabled) return b.click();
      if (!generating()) note("Nothing to stop: no reply is being written.");
    },
    regenerate: () => {  // the menu item is always there: when the button is off, say why (it did nothing)
      const b = $("#regenerate-button");
      if (b && !b.disabled) return b.click();
      // no reply at all: nothing to regenerate yet (the button's title explains a turn that is not a reply)
      const none = !document.querySelector("#messages .msg-assistant");
      if (!generating()) alertBox(none || !b?.title ? "There is no reply to regenerate yet." : b.title);
    },
    "copy-last": () => {
      const all = document.querySelectorAll(".msg-assistant .body");
      if (!all.length) return alertBox("There is no reply to copy yet.");
      const done = (ok) => note(ok ? "Copied the last reply." : "Could not copy: the browser refused the clipboard.");
      if (navigator.clipboard) navigator.clipboard.writeText(all[all.length - 1].innerText).then(() => done(true), () => done(false));
      else done(false);
    },
    "clear-input": () => { const p = $("#prompt"); if (p) { p.value = ""; keepDraft(""); } },
  };
  // as System 7 does, a menu greys what it cannot do now, set each time a menu opens (chosen all the same, an
  // item says why it did nothing)
  const available = {
    rename: () => !!conversationId(), delete: () => !!conversationId(),
    "rename-project": () => (shownProject() || "default") !== "default",
    "export-md": () => !!conversationId(), "export-json": () => !!conversationId(),
    stop: () => generating(),
    regenerate: () => { const b = $("#regenerate-button"); return !!b && !b.disabled; },
    "copy-last": () => !!document.querySelector(".msg-assistant .body"),
  };
  function greyMenus() {
    document.querySelectorAll("nav.menubar [role=menu] [data-action]").forEach((item) => {
      const can = available[item.dataset.action];
      if (can) item.setAttribute("aria-disabled", String(!can()));
    });
    // the export links name the conversation shown now (a middle-click took the one the page was drawn with)
    const id = conversationId();
    document.querySelectorAll('nav.menubar a[data-action^="export-"]').forEach((a) => {
      a.setAttribute("href", id ? `/c/${id}/export.${a.dataset.action.slice("export-".length)}` : "#");
    });
  }
  const menubar = $("nav.menubar");
  menubar?.addEventListener("focusin", greyMenus);
  menubar?.addEventListener("pointerover", greyMenus);
  document.addEventListener("click", (e) => {
    const t = e.target.closest("[data-action],[data-open],[data-close],[data-zoom],.alert-ok");
    if (!t) return;
    if (t.classList.contains("alert-ok")) { t.closest(".alert-box").remove(); return; }
    if (t.dataset.close !== undefined) { t.closest("[data-window]").hidden = true; return; }
    if (t.dataset.zoom !== undefined) { t.closest("[data-window]").classList.toggle("zoomed"); return; }
    e.preventDefault();
    // closes the CSS menus; never a dialog's button that hx-confirm has just focused (Return did nothing)
    if (!document.activeElement?.closest?.("#alerts")) document.activeElement?.blur?.();
    if (t.dataset.open) return openWindow(t.dataset.open);
    if (t.dataset.action === "delete-now") return deleteNow(t);
    if (t.dataset.action === "load-model") return loadModel(t.dataset.model);
    actions[t.dataset.action]?.();
  });
  // A notice's "Load <model>" button: the model menu picks that model, on the engine it suggests for it, as if
  // chosen there (the server says "Loading…", or that a reply is still being written)
  function loadModel(name) {
    const picker = $("#model-picker");
    const group = [...(picker?.querySelectorAll("optgroup") || [])].find((g) => g.dataset.model === name);
    if (!group) return alertBox(`${name} is not installed here: make setup (or flashcode setup) installs it.`);
    const choice = group.querySelector('option[data-suggested="yes"]') || group.querySelector("option");
    if (picker.value === choice.value) return note(`${name} is loaded already.`);
    picker.value = choice.value;
    picker.dispatchEvent(new Event("change", { bubbles: true }));
  }
  // an offer to load the model the server says is loaded is done: its button says so, disabled (it stayed
  // "Load …" in the transcript once the model was loaded: walkthrough). Not the menu's choice: that is what
  // was asked for, which may still be loading, or fail
  function markLoadedOffers() {
    const loaded = $("#menubar-model")?.dataset.loaded;
    document.querySelectorAll("button.load-model").forEach((b) => {
      const done = b.dataset.model === loaded;
      if (b.disabled === done) return;
      b.disabled = done;
      b.textContent = done ? `${b.dataset.model} is loaded` : `Load ${b.dataset.model}`;
    });
  }
  document.body.addEventListener("htmx:afterSettle", markLoadedOffers);
  document.body.addEventListener("htmx:oobAfterSwap", markLoadedOffers);
  markLoadedOffers();
  function markSelected(id) {
    document.querySelectorAll("#conversation-list li[data-id]").forEach((li) => {
      li.classList.toggle("selected", li.dataset.id === id);
      li.setAttribute("aria-selected", String(li.dataset.id === id));
    });
  }
  // Undo after Move to Trash of the conversation the chat window showed (the page went to "/"): the window
  // shows it again, with what was typed in it (kept by the server) and meanwhile, unless another conversation
  // was started since
  // (the button is gone with the list it was in: htmx tells its pane, naming the button in requestConfig)
  document.body.addEventListener("htmx:afterRequest", (e) => {
    const id = e.detail.requestConfig?.elt?.dataset?.reopen;
    if (!id || !e.detail.successful || conversationId()) return;
    const typed = ($("#prompt") || {}).value || "";
    // once the window is swapped in (htmx.ajax's promise can settle before the swap: it went unseen)
    const shown = () => {
      if (conversationId() !== id) return;
      document.body.removeEventListener("htmx:afterSettle", shown);
      history.pushState({}, "", `/c/${id}`);
      const p = $("#prompt");
      if (p && typed) p.value = p.value && p.value !== typed ? `${p.value}\n\n${typed}` : typed;  // its draft, then this
      markSelected(id);
    };
    document.body.addEventListener("htmx:afterSettle", shown);
    setTimeout(() => document.body.removeEventListener("htmx:afterSettle", shown), 30000);
    htmx.ajax("GET", `/c/${id}`, { target: "#chat-window", swap: "outerHTML" });
  });
  // a conversation deleted for good (Delete Now, Empty Trash, here or in another window's Trash shown here):
  // its "Moved to the Trash. Undo" note goes, the Undo having nothing left to put back
  function dropStaleUndo() {
    const pane = $("#trash-pane");
    if (!pane) return;
    document.querySelectorAll("#conversation-list .trash-note[data-trashed]").forEach((note) => {
      if (!pane.querySelector(`li[data-id="${CSS.escape(note.dataset.trashed)}"]`)) note.remove();
    });
  }
  document.body.addEventListener("htmx:afterSettle", dropStaleUndo);
  document.body.addEventListener("htmx:oobAfterSwap", dropStaleUndo);

  // ---------------------------------------------------------------- drafts
  // what is typed and not sent stays with its conversation when another is opened, the page reloads or the
  // server restarts (it was lost): this browser's localStorage, per conversation (per project for a new one),
  // until it is sent. A draft the server draws (an Edit… copy, one kept by Move to Trash) comes first.
  function draftKey() {
    return `flashcode:draft:${conversationId() || `new:${shownProject()}`}`;
  }
  function forget(key) { try { localStorage.removeItem(key); } catch (_) { /* storage off */ } }
  function keepDraft(text) {
    try {
      if (text.trim()) localStorage.setItem(draftKey(), text.slice(0, 65536)); else forget(draftKey());
    } catch (_) { /* storage full or off: not kept */ }
  }
  function restoreDraft() {
    const p = $("#prompt");
    if (!p || p.value.trim()) return;
    let kept = null;
    try { kept = localStorage.getItem(draftKey()); } catch (_) { /* storage off */ }
    if (kept) p.value = kept;
  }
  document.addEventListener("input", (e) => { if (e.target.id === "prompt") keepDraft(e.target.value); });
  restoreDraft();  // and each time the chat window is drawn (htmx:afterSwap, below)

  // ---------------------------------------------------------------- keyboard
  function focusPrompt() { const p = $("#prompt"); if (p) p.focus(); }
  const newestAlert = () => document.querySelector("#alerts .alert-box:not(.modal):last-child");
  document.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.target.id === "prompt") {
      e.preventDefault();
      if (!generating() && e.target.value.trim()) $("#composer").requestSubmit();
      else if (!e.target.value.trim()) newestAlert()?.remove();  // Return is the alert's OK, as on a Mac
    } else if (e.key === "Enter" && e.target === document.body && !e.shiftKey && newestAlert()) {  // nothing focused
      e.preventDefault();
      newestAlert().remove();
    } else if (e.key === "Escape") {
      if (document.activeElement?.closest?.("nav.menubar")) { document.activeElement.blur(); return; }  // closes the menu
      const alert = document.querySelector("#alerts .alert-box");
      if (generating()) click("#stop-button"); else if (alert) alert.remove();
    } else if ((e.metaKey || e.ctrlKey) && !e.shiftKey && (e.key === "n" || e.key === "N")) {
      e.preventDefault();
      if (!asking) newConversation();  // a dialog asks first (the new window would not be held behind it)
    }
  });

  // ---------------------------------------------------------------- auto-scroll
  // Follow the stream while the transcript is at its bottom; stop when the user scrolls up.
  let stick = true;
  document.addEventListener("scroll", (e) => {
    if (e.target.id === "transcript") stick = e.target.scrollTop + e.target.clientHeight >= e.target.scrollHeight - 24;
  }, true);
  function follow() { const t = $("#transcript"); if (t && stick) t.scrollTop = t.scrollHeight; }

  // The composer keeps a sent message until the server shows it (a refused one, e.g. too long, stays there to
  // be fixed); what was typed meanwhile is never cleared.
  let sent = null;
  let sentFrom = "";  // the draft key of the conversation it was sent from (a new one gets its id from the send)
  document.body.addEventListener("htmx:wsAfterSend", (e) => {
    let msg = {};
    try { msg = JSON.parse(e.detail.message); } catch (_) { /* not ours */ }
    if (msg.type === "send") {
      // no longer a draft: a New pressed before its frame comes must not draw it back (a refusal keeps it, below)
      sent = msg.text; sentFrom = draftKey(); forget(sentFrom); stick = true;
      // an alert answered an earlier send ("Type a message first"): this one moves on, so they do not pile up
      document.querySelectorAll("#alerts [role=alert]").forEach((a) => a.remove());
    }
  });
  // the tab's title follows the window's (a conversation opened from the list, one a first message made)
  // the title as typed (the window shows its invisible characters as <U+…> marks: data-title keeps it)
  function chatTitle() {
    const t = $("#chat-title");
    return t ? (t.dataset.title ?? t.textContent) : "";
  }
  function syncTitle() {
    const name = chatTitle().trim();
    const title = name && conversationId() ? `${name} — flashcode` : "flashcode";
    if (document.title !== title) document.title = title;
  }
  // a frame of one conversation's reply (the server starts it with <!--for:ID-->) that comes after this page went
  // to another conversation (drawn over HTTP; the server learns it from "showing", still on its way) is not
  // drawn here: its gauge, title or messages would land in the conversation shown. A page with none yet takes
  // the frame that gives it its conversation, of the one its own message made (marked "new:" with this window's
  // mark, new at each drawing: after New, the blank window drawn again does not take the one the last message made)
  document.body.addEventListener("htmx:wsBeforeMessage", (e) => {
    const frame = String((e.detail && e.detail.message) || "");
    const mark = /^<!--for:([\w-]*)(?: new:([\w-]*))?-->/.exec(frame);
    if (!mark) return;
    const id = conversationId();
    const made = mark[2] && mark[2] === ($("#draft-mark") || {}).value && frame.includes('id="conversation-id"');
    if (id ? mark[1] !== id : !made) e.preventDefault();
  });
  document.body.addEventListener("htmx:wsAfterMessage", (e) => {
    const frame = String((e.detail && e.detail.message) || "");
    // an approval dialog answered: the rule it saved or the network switch it set shows in an open Settings
    const settings = $("#settings-window");
    if (settings && !settings.hidden && /class="action-decision decision-(once|always_exact|always_prefix)"/.test(frame)) refreshParts(settings);
    const shown = frame.includes('class="msg msg-user');
    const refused = frame.includes('role="alert"');  // with an alert, a user message shown is another tab's
    if (sent !== null && (shown || refused)) {
      const p = $("#prompt");
      if (shown && !refused && p && p.value === sent) p.value = "";
      if (refused && p && p.value && draftKey() === sentFrom) keepDraft(p.value);  // refused: still a draft
      sent = null;
    }
    syncTitle();
    const id = conversationId();
    // the list comes drawn for the conversation its reply is in (page-wide): selected is the one this window shows
    if (frame.includes('id="conversation-list"')) markSelected(id);
    const win = $("#chat-window");
    if (id && win && win.dataset.conversation !== id) {
      win.dataset.conversation = id;
      if (location.pathname !== `/c/${id}`) history.replaceState({}, "", `/c/${id}`);
      markSelected(id);
    }
    const welcome = $("#welcome");
    if (welcome && $("#messages").children.length) welcome.hidden = true;
    follow();
  });
  document.body.addEventListener("htmx:afterSwap", (e) => {
    const toChat = e.detail.target && e.detail.target.id === "chat-window";
    if (toChat) { stick = true; follow(); restoreDraft(); }
    markSelected(conversationId());
    syncTitle();
    if (toChat) focusWindow($("#chat-window"));  // other windows keep the focus they had
    // a conversation the list does not have yet (a copy made by Edit…): the list is drawn again
    const id = conversationId();
    if (toChat && id && !findText() && !document.querySelector(`#conversation-list li[data-id="${CSS.escape(id)}"]`)) {
      fetchList();
    }
    if (e.detail.target && e.detail.target.id === "conversation-list") refind();
  });
  // the window drawn over HTTP cannot tell this page writes a reply: the socket sends its controls back, and the
  // reply as written so far. Said once the window has settled: its transcript is replayed then (trust.js, on
  // htmx:load), and a redraw that came before it found no message to draw into
  document.body.addEventListener("htmx:afterSettle", (e) => {
    if (e.detail.target && e.detail.target.id === "chat-window" && $("#showing")) htmx.trigger("#showing", "flashcode:showing");
  });
  // Find in the Conversations window: a list drawn again by the server (a reply, a rename, an Undo) lists
  // every conversation (data-query=""); while something is typed in Find, it is asked for the matching ones
  // again — and for all of them when a search's answer comes after Find was emptied. Only emptiness is
  // compared: the server may tidy a query (whitespace), which must not ask again and again
  const findText = () => ($("#conversation-find") || { value: "" }).value.split(/\s+/).filter(Boolean).join(" ").slice(0, 200);
  function fetchList() {
    const q = findText();
    htmx.ajax("GET", `/conversations?current=${encodeURIComponent(conversationId())}&q=${encodeURIComponent(q)}`, { target: "#conversation-list", swap: "outerHTML" });
  }
  function refind() {
    const list = $("#conversation-list");
    if (list && !(list.dataset.query || "") !== !findText()) fetchList();
  }
  document.body.addEventListener("htmx:oobAfterSwap", (e) => {
    if (e.detail.target && e.detail.target.id === "conversation-list") refind();
  });
  // a socket opened (the page loaded, or came back after the server restarted): it says which conversation the
  // page shows, so a reply begun there by a window since closed (a reload) is shown live, with Stop
  document.body.addEventListener("htmx:wsOpen", () => { if ($("#showing")) htmx.trigger("#showing", "flashcode:showing"); });
  window.addEventListener("popstate", () => location.reload());
  // a request the server refused (a title left empty, a project removed in another window) or could not
  // answer says why in an alert, rather than nothing happening; the server's errors are one plain sentence
  // hx-confirm asks with the System 7 dialog (Cancel the default button), not the browser's confirm()
  document.body.addEventListener("htmx:confirm", (e) => {
    if (!e.detail.question) return;
    e.preventDefault();
    const ok = e.detail.elt.dataset.confirmOk || (/^Delete\b/.test(e.detail.question) ? "Delete" : "OK");  // the verb that acts
    ask(e.detail.question, { ok, safe: true }).then((answer) => { if (answer !== null) e.detail.issueRequest(true); });
  });
  // a form the server refused draws the form again with why (400 with HTML: Settings' allow rules, Stats'
  // prices): swapped in like an answer, not an error
  document.body.addEventListener("htmx:beforeSwap", (e) => {
    const xhr = e.detail.xhr;
    if (xhr.status === 400 && (xhr.getResponseHeader("content-type") || "").startsWith("text/html")) {
      e.detail.shouldSwap = true;
      e.detail.isError = false;
    }
  });
  document.body.addEventListener("htmx:responseError", (e) => {
    const xhr = e.detail.xhr;
    const plain = (xhr.getResponseHeader("content-type") || "").startsWith("text/plain");
    const said = plain ? xhr.responseText.replace(/^\d{3}: /, "").trim().slice(0, 400) : "";
    alertBox(said ? `Not done: ${said}.`.replace(/\.\.$/, ".") : `Not done: the server answered ${xhr.status}. Its log (flashcode serve's output) says why.`, "error");
  });
  document.body.addEventListener("htmx:sendError", () => alertBox("Could not reach flashcode: is `flashcode serve` still running?", "error"));
  // after Move to Trash of the open conversation the page is /?trashed=ID (the list offers Undo): the
  // address bar says "/" again, so a reload or a bookmark does not offer it once more
  if (location.pathname === "/" && location.search.includes("trashed=")) history.replaceState({}, "", "/");
  // a request that sends the page elsewhere (Saved Contexts' Resume) may say what it did: the page it goes to
  // says it in its status bar until the next reply (the conversation alone looked as if nothing had happened)
  document.body.addEventListener("htmx:beforeOnLoad", (e) => {
    const xhr = e.detail.xhr;
    const said = xhr.getResponseHeader("X-Flashcode-Said");
    if (said && xhr.getResponseHeader("HX-Redirect")) sessionStorage.setItem("flashcode:said", decodeURIComponent(said));
  });
  const said = sessionStorage.getItem("flashcode:said");
  if (said !== null) {
    sessionStorage.removeItem("flashcode:said");
    const s = $("#status .status-text");
    if (s && !generating()) s.textContent = said;
  }

  // ---------------------------------------------------------------- menu bar clock
  function tick() {
    const c = $("#clock");
    if (c) c.textContent = new Date().toLocaleTimeString([], { hour: "numeric", minute: "2-digit" });
  }
  tick(); setInterval(tick, 15000);
  focusWindow($("#chat-window"));
  follow();
})();
