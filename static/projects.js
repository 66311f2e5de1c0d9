// flashcode projects: the File menu's project dialogs, the folder browser's clicks, the Files
// window's file viewer (in the list's place). Everything that talks to the server goes through htmx
// (the CSRF header is on <body>); this only opens, fills and closes things.
(function () {
  "use strict";
  const $ = (sel, root) => (root || document).querySelector(sel);
  function openDialog(mode) {
    document.querySelectorAll("#alerts .project-dialog").forEach((d) => d.remove());
    const url = mode === "remove" ? "/projects/remove" : `/projects/dialog?mode=${encodeURIComponent(mode)}`;
    htmx.ajax("GET", url, { target: "#alerts", swap: "beforeend" }).then(() => {
      const field = $("#project-path") || $(".project-dialog .dialog-ok") || $(".project-dialog .recent-project");
      if (field) field.focus();
    });
  }
  document.addEventListener("click", (e) => {
    const t = e.target.closest("[data-project-dialog],[data-dismiss],[data-pick-folder],[data-choose-folder],[data-close-view]");
    if (!t) return;
    if (t.dataset.projectDialog) {
      e.preventDefault();
      document.activeElement?.blur?.();  // closes the CSS menus
      openDialog(t.dataset.projectDialog);
    } else if (t.dataset.dismiss !== undefined) {
      t.closest(".alert-box").remove();
    } else if (t.dataset.pickFolder || t.dataset.chooseFolder) {
      const field = $("#project-path");
      if (field) field.value = t.dataset.pickFolder || t.dataset.chooseFolder;
      document.querySelectorAll(".folder-list li.selected").forEach((li) => li.classList.remove("selected"));
      t.closest("li")?.classList.add("selected");
    } else if (t.dataset.closeView !== undefined) {
      const view = $("#file-view");
      if (view) { view.hidden = true; view.innerHTML = ""; }
      const list = $("#files-pane");
      if (list) list.hidden = false;
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Escape") return;
    const dialog = $("#alerts .project-dialog");
    if (dialog) { e.stopPropagation(); dialog.remove(); }
  }, true);
  function syncPicks() {
    // the Files window's ticks follow the attachment bar: files sent with a message (or cleared) untick
    const bar = $("#attachments");
    if (!bar) return;
    const attached = new Set([...bar.querySelectorAll(".attachment")].map((a) => a.dataset.path));
    document.querySelectorAll('#files-list input[name="path"]').forEach((box) => { box.checked = attached.has(box.value); });
  }
  document.body.addEventListener("htmx:oobAfterSwap", (e) => {
    if (e.detail.target && e.detail.target.id === "attachments") syncPicks();
  });
  document.body.addEventListener("htmx:afterSwap", (e) => {
    if (e.detail.target && e.detail.target.id === "attachments") syncPicks();
    // a file viewed takes the list's place (the window's whole height); "◂ Files" brings the list back
    if (e.detail.target && e.detail.target.id === "file-view") {
      $("#file-view").hidden = false;
      const list = $("#files-pane");
      if (list) list.hidden = true;
    }
    const err = $(".project-dialog [data-error]");
    if (err) ($("#project-path") || err).focus();
  });
})();
