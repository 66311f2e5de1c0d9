"""The projects in the web app: the New/Open/Open Recent/Remove dialogs with their folder browser,
the Files window, and attachments for the next message.

What it knows: URLs, what a dialog answers (HX-Redirect to `/` once a project is open: the page is
redrawn for it), the folder browser's bounds (directories under the user's home), and the pending
attachments of each project. What it does not know: SQL (`store.ProjectStore`), the socket (the
chat asks `take_attachments` when a message is sent), HTML layout (`templates/projects/`). Every
POST passed `webapp.security.CsrfMiddleware` before it arrives.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from jinja2 import Environment
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, guess_lexer_for_filename
from pygments.util import ClassNotFound
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import Route

from .files import ATTACH_LIMIT, ATTACH_TOTAL, Entry, FilesError, ProjectTree
from .store import DEFAULT_ID, ProjectError, ProjectRef, ProjectStore, make_folder

MAX_BROWSE = 400
Quote = Callable[[str, str], str]  # (source, text) -> the text quoted as untrusted data for the model


def _human(n: float) -> str:
    """A size in binary units, as the docs give the limits: 65,536 bytes is "64 KB", 1,500 is "1.5 KB"."""
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            if unit == "bytes":
                return f"{n:,.0f} bytes"
            return f"{n:,.1f}".removesuffix(".0") + f" {unit}"
        n /= 1024
    return f"{n} GB"


def _entries(tree: ProjectTree, rel: str, error: str) -> tuple[list[Entry], str, str]:
    """(the entries of folder `rel`, the error to show, the folder shown): the project's top when `rel`
    cannot be listed, nothing when the project's folder itself is gone (the first error says so)."""
    try:
        return tree.list(rel), error, rel
    except FilesError as exc:
        try:
            return tree.list(""), str(exc), ""
        except FilesError:
            return [], str(exc), ""


def _not_attached(tree: ProjectTree, rel: str, exc: FilesError) -> str:
    """Why a file was not attached: a size refusal says the limit; any other (binary, not UTF-8, ignored,
    unreadable) says only why."""
    try:
        path = tree.resolve(rel)
        size = path.stat().st_size if path.is_file() else 0
    except (FilesError, OSError):
        size = 0
    if size > ATTACH_LIMIT:
        return f"{rel} is {size:,} bytes: not attached (attachments: at most {_human(ATTACH_LIMIT)} each)"
    said = str(exc)
    if said.endswith(": not shown"):
        return said.removesuffix(": not shown") + ": not attached"
    return said if said.endswith(": refused") else f"{said} (not attached)"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


class ProjectsWeb:
    def __init__(
        self,
        store: ProjectStore,
        env: Environment,
        quote: Quote,
        on_switch: Callable[[], Awaitable[None]] | None = None,
        home: Path | None = None,
        on_remove: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.store, self.quote, self.on_switch, self.on_remove = store, quote, on_switch, on_remove
        self.home = (home or Path.home()).resolve()
        self.ui: Any = env.get_template("projects/fragments.html").module
        self.pending: dict[str, list[tuple[str, int, str]]] = {}  # project id -> (path, size, text)

    @property
    def routes(self) -> list[Route]:
        return [
            Route("/projects/dialog", self.dialog),
            Route("/projects/browse", self.browse),
            Route("/projects/open", self.open_project, methods=["POST"]),
            Route("/projects/remove", self.remove_dialog),
            Route("/projects/rename", self.rename_project, methods=["POST"]),
            Route("/projects/remove", self.remove_project, methods=["POST"]),
            Route("/files/window", self.files_window),
            Route("/files/list", self.files_list),
            Route("/files/view", self.file_view),
            Route("/files/attach", self.attach, methods=["POST"]),
            Route("/files/attachments/clear", self.clear_attachments, methods=["POST"]),
        ]

    # ------------------------------------------------------------------ dialogs
    def _dialog(self, mode: str, path: str = "", name: str = "", error: str = "") -> HTMLResponse:
        mode = mode if mode in ("new", "open", "recent") else "open"
        start = path or str(self.home)
        recent = self.store.recent()
        html = self.ui.project_dialog(
            mode=mode,
            path=path,
            name=name,
            error=error,
            recent=recent,
            current=self.store.current(),
            browser=self._browser(start),
            missing={p.id for p in recent if not p.path.is_dir()},  # moved or deleted on disk since
        )
        return HTMLResponse(str(html))

    async def dialog(self, request: Request) -> HTMLResponse:
        """GET /projects/dialog?mode=new|open|recent: the dialog, appended to #alerts."""
        return self._dialog(request.query_params.get("mode", "open"))

    def _browse_dir(self, raw: str) -> Path:
        """The folder to list: `raw` when it is a readable directory under the home, else the home."""
        try:
            folder = Path(raw).expanduser().resolve() if raw else self.home
        except (OSError, RuntimeError, ValueError):
            return self.home
        if folder != self.home and not folder.is_relative_to(self.home):
            return self.home
        return folder if folder.is_dir() and os.access(folder, os.R_OK | os.X_OK) else self.home

    def _browser(self, raw: str, show_hidden: bool = False) -> str:
        folder = self._browse_dir(raw)
        try:
            names = [e.name for e in os.scandir(folder) if e.is_dir()]
        except OSError:
            names = []
        hidden = sum(n.startswith(".") for n in names)
        shown = names if show_hidden else [n for n in names if not n.startswith(".")]
        subdirs = sorted(shown, key=str.lower)[:MAX_BROWSE]
        parent = folder.parent if folder != self.home else None
        return str(
            self.ui.folder_browser(folder, parent, [(n, folder / n) for n in subdirs], hidden, show_hidden)
        )

    async def browse(self, request: Request) -> HTMLResponse:
        """GET /projects/browse?dir=PATH[&hidden=1]: the folders of PATH (under the home) for the dialog;
        folders whose name starts with a dot are counted, and listed only with hidden=1."""
        q = request.query_params
        return HTMLResponse(self._browser(q.get("dir", ""), q.get("hidden") == "1"))

    async def open_project(self, request: Request) -> Response:
        """POST /projects/open: `project_id` (recent), or `path` (+ `name` for a new one). The page
        is redrawn for the project (HX-Redirect); a refused directory redraws the dialog with why."""
        form = await request.form()
        mode = str(form.get("mode") or "open")
        path, name = str(form.get("path") or ""), str(form.get("name") or "")
        try:
            if form.get("project_id"):
                project = self.store.get(str(form.get("project_id")))
                if project is None:
                    raise ProjectError("that project is no longer on the list: open its directory")
            else:
                project = self._add(mode, path, name)
            if self.on_switch is not None and project.id != self.store.current().id:
                await self.on_switch()
            self.store.open(project.id)
        except ProjectError as exc:
            return self._dialog(mode, path, name, str(exc))
        return Response(status_code=200, headers={"HX-Redirect": "/"})

    def _add(self, mode: str, path: str, name: str) -> ProjectRef:
        """Add the directory as a project; New Project first makes a folder that does not exist yet (and
        removes it again, empty, when the directory is refused)."""
        made = make_folder(path) if mode == "new" else None
        try:
            return self.store.add(path, name or None)
        except BaseException:
            if made is not None:
                with contextlib.suppress(OSError):  # written into meanwhile: kept, and the refusal is said
                    made.rmdir()
            raise

    async def rename_project(self, request: Request) -> Response:
        """POST /projects/rename: `project_id`, `name`. The page is drawn again (HX-Refresh: every place that
        names the project); a refused name says why (400, plain text: the page's alert)."""
        form = await request.form()
        pid = str(form.get("project_id") or "")
        if self.store.get(pid) is None:
            return PlainTextResponse("that project is no longer on the list", status_code=400)
        try:
            self.store.rename(pid, str(form.get("name") or ""))
        except ProjectError as exc:
            return PlainTextResponse(str(exc), status_code=400)
        return Response(status_code=200, headers={"HX-Refresh": "true"})

    async def remove_dialog(self, request: Request) -> HTMLResponse:
        """GET /projects/remove: asks whether to keep or delete flashcode's data for the project."""
        project = self.store.current()
        counts = self.store.conversation_counts()
        html = self.ui.remove_dialog(project, counts.get(project.id, 0), project.id == DEFAULT_ID)
        return HTMLResponse(str(html))

    async def remove_project(self, request: Request) -> Response:
        """POST /projects/remove: `project_id`, `delete_data=on` to delete flashcode's data too, which is for
        good: the first such post answers with a second dialog, whose Delete posts `confirmed=yes` (a
        walkthrough's Return, on the default button, deleted a project's conversations unasked)."""
        form = await request.form()
        pid = str(form.get("project_id") or "")
        found = self.store.get(pid)
        if form.get("delete_data") == "on" and form.get("confirmed") != "yes" and found is not None:
            listed = self.store.conversation_counts().get(pid, 0)
            return HTMLResponse(str(self.ui.remove_confirm(found, listed, self.store.trashed_count(pid))))
        if self.on_remove is not None and found is not None:
            # the saves being written behind a reply land first: one landing after the removal would put a
            # removed (or moved) project's folder back, holding a deleted conversation's cache
            await self.on_remove()
        try:
            self.store.remove(pid, delete_data=form.get("delete_data") == "on")
        except ProjectError as exc:
            return HTMLResponse(str(self.ui.dialog_error(str(exc))))
        self.pending.pop(pid, None)
        return Response(status_code=200, headers={"HX-Redirect": "/"})

    # ------------------------------------------------------------------ the Files window
    def _tree(self) -> tuple[ProjectTree, str]:
        project = self.store.current()
        return ProjectTree(project.path), project.id

    async def _listing(self, rel: str, error: str = "") -> str:
        tree, pid = self._tree()
        entries, error, rel = await run_in_threadpool(_entries, tree, rel, error)  # the disk, off the loop
        crumbs = [p for p in rel.strip("/").split("/") if p]
        trail = [(p, "/".join(crumbs[: i + 1])) for i, p in enumerate(crumbs)]
        return str(
            self.ui.files_list(
                self.store.current(), rel, trail, entries, error, _human, _when, self._attached(pid)
            )
        )

    # a project's files (a folder of thousands, a long .gitignore) are read off the event loop: a listing once
    # held every other request, Stop and the approval dialogs for seconds
    async def files_window(self, request: Request) -> HTMLResponse:
        return HTMLResponse(str(self.ui.files_window(await self._listing(""))))

    async def files_list(self, request: Request) -> HTMLResponse:
        return HTMLResponse(await self._listing(request.query_params.get("dir", "")))

    async def file_view(self, request: Request) -> HTMLResponse:
        rel = request.query_params.get("path", "")
        tree, _ = self._tree()
        try:
            text, size = await run_in_threadpool(tree.read_text, rel)
        except FilesError as exc:
            return HTMLResponse(str(self.ui.file_view(rel, 0, "", str(exc))))
        try:
            lexer = guess_lexer_for_filename(rel, text[:4096])
        except ClassNotFound:
            lexer = TextLexer()
        # off the event loop: highlighting a large file takes seconds, which would hold every other request
        code = await run_in_threadpool(
            highlight, text, lexer, HtmlFormatter(cssclass="highlight", linenos=False)
        )
        return HTMLResponse(str(self.ui.file_view(rel, size, code, "")))  # pygments escapes the text

    # ------------------------------------------------------------------ attachments
    def _attached(self, project_id: str) -> list[tuple[str, int]]:
        return [(p, size) for p, size, _ in self.pending.get(project_id, [])]

    async def attach(self, request: Request) -> HTMLResponse:
        """POST /files/attach: `path` (repeated): files for the next message of this project."""
        form = await request.form()
        tree, pid = self._tree()
        chosen = [str(v) for v in form.getlist("path")]
        have = self.pending.setdefault(pid, [])
        errors = []
        if not chosen:
            errors.append("tick one or more files first")
        for rel in chosen:
            if any(p == rel for p, _, _ in have):
                continue
            try:
                text, size = await run_in_threadpool(tree.read_text, rel, ATTACH_LIMIT)
            except FilesError as exc:
                errors.append(await run_in_threadpool(_not_attached, tree, rel, exc))
                continue
            if sum(s for _, s, _ in have) + size > ATTACH_TOTAL:
                errors.append(
                    f"{rel} was not attached: the attachments would pass {_human(ATTACH_TOTAL)} in all"
                )
                continue
            have.append((rel, size, text))
        return HTMLResponse(str(self.ui.attachments(self._attached(pid), errors, _human, oob=False)))

    async def clear_attachments(self, request: Request) -> HTMLResponse:
        self.pending.pop(self.store.current().id, None)
        return HTMLResponse(str(self.ui.attachments([], [], _human, oob=False)))

    def take_attachments(self, project_id: str) -> tuple[str, str, list[tuple[str, int]]]:
        """For the chat, when a message of `project_id` is sent: (the files quoted as untrusted data,
        to put before the message; the fragment that empties the attachment bar; each file's path and size
        in bytes, for the message's bubble)."""
        files = self.pending.pop(project_id, [])
        cleared = str(self.ui.attachments([], [], _human, oob=True))
        if not files:
            return "", cleared, []
        # the source names the path alone, as read_file's does: a model took "main.py (294 bytes)" for a path
        blocks = [self.quote(f"file {rel}", text) for rel, _size, text in files]
        return "\n\n".join(blocks) + "\n\n", cleared, [(rel, size) for rel, size, _ in files]
