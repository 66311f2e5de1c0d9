"""The Files window's view of a project directory: listing (respecting `.gitignore`), reading a
file for display, and attaching files to the next message.

What is covered: paths are relative to the project and resolved (symlinks included) before use; one
that leads outside the project, into `.git`, or to something ignored is refused with a message.
Listings skip `.git` and whatever the project's `.gitignore` files (root and nested, with
`.git/info/exclude`) ignore, using `pathspec`'s git semantics (at most `IGNORE_BYTES` and `IGNORE_LINES` of
each; the callers run all of it off the event loop). Files are shown only when they are
text (UTF-8, no NUL) and at most `VIEW_LIMIT` bytes; attachments at most `ATTACH_LIMIT` bytes each
and `ATTACH_TOTAL` together. What is not covered: file contents are the user's project, but are
treated as untrusted data all the same: escaped when shown (pygments escapes), quoted as untrusted
when given to the model (the caller's `quote`).

What it does not know: HTTP, templates, the database.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import pathspec

VIEW_LIMIT = 1 << 20
ATTACH_LIMIT = 64 << 10
ATTACH_TOTAL = 192 << 10
MAX_ENTRIES = 2000


class FilesError(ValueError):
    """A path that cannot be listed, shown or attached; the message says why."""


@dataclass(frozen=True)
class Entry:
    name: str
    rel: str  # relative to the project, with "/"
    is_dir: bool
    size: int
    modified: float

    @property
    def kind(self) -> str:
        if self.is_dir:
            return "folder"
        suffix = Path(self.name).suffix.lower().lstrip(".")
        return f"{suffix.upper()} file" if suffix else "file"


# what one ignore file may hold for the Files window (git has no limit; a cloned repository's .gitignore of
# 100,000 patterns held the server 14 s per listing): past these, the rest of that file is not read
IGNORE_BYTES = 256 << 10
IGNORE_LINES = 10_000


def _spec_lines(path: Path) -> list[str]:
    try:
        with path.open("rb") as f:
            data = f.read(IGNORE_BYTES)
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[:IGNORE_LINES]


@functools.lru_cache(maxsize=32)
def _compiled(lines: tuple[str, ...]) -> pathspec.GitIgnoreSpec:
    """The spec of these patterns, compiled once (each listing, view and attachment asks for it again)."""
    return pathspec.GitIgnoreSpec.from_lines(lines)


class ProjectTree:
    """One project directory, as the Files window sees it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()

    def _ignore_spec(self, rel_dir: str) -> pathspec.GitIgnoreSpec:
        """The patterns that apply inside `rel_dir`: the root's, .git/info/exclude, and each nested
        .gitignore on the way down (its patterns anchored to its own folder)."""
        lines = _spec_lines(self.root / ".git" / "info" / "exclude") + _spec_lines(self.root / ".gitignore")
        parts = [p for p in rel_dir.split("/") if p]
        for i in range(1, len(parts) + 1):
            prefix = "/".join(parts[:i])
            for line in _spec_lines(self.root / prefix / ".gitignore"):
                text = line.strip()
                if not text or text.startswith("#"):
                    continue
                neg = text.startswith("!")
                body = text[1:] if neg else text
                anchored = body.lstrip("/") if "/" in body.rstrip("/") else f"**/{body}"
                lines.append(("!" if neg else "") + f"{prefix}/{anchored}")
        return _compiled(tuple(lines))

    def ignored(self, rel: str, is_dir: bool = False) -> bool:
        parts = [p for p in rel.split("/") if p]
        if ".git" in parts:
            return True
        parent = "/".join(parts[:-1])
        spec = self._ignore_spec(parent)
        for i in range(1, len(parts) + 1):  # a file inside an ignored folder is ignored too
            sub = "/".join(parts[:i])
            if spec.match_file(sub + ("/" if i < len(parts) or is_dir else "")):
                return True
        return False

    def resolve(self, rel: str) -> Path:
        """The real path of `rel` inside the project, or FilesError."""
        text = (rel or "").strip().strip("/")
        if "\x00" in text or len(text) > 4096:
            raise FilesError("that is not a usable path")
        target = (self.root / text).resolve() if text else self.root
        if target != self.root and not target.is_relative_to(self.root):
            raise FilesError(f"{text} is outside the project: refused")
        rel_real = target.relative_to(self.root).as_posix() if target != self.root else ""
        if rel_real and self.ignored(rel_real, target.is_dir()):
            raise FilesError(f"{text} is ignored (.git or .gitignore): not shown")
        return target

    def _whole(self) -> None:
        """FilesError when the project's folder itself is gone (moved, deleted, replaced by a file)."""
        if not self.root.is_dir():
            raise FilesError(
                f"the project's folder {self.root} is gone (moved or deleted): put it back, or point the "
                "project at its new place (`flashcode projects move`)"
            )

    def list(self, rel_dir: str = "") -> list[Entry]:
        self._whole()
        folder = self.resolve(rel_dir)
        if not folder.is_dir():
            raise FilesError(f"{rel_dir or '.'} is not a folder")
        base = folder.relative_to(self.root).as_posix() if folder != self.root else ""
        spec = self._ignore_spec(base)
        out = []
        try:
            children = sorted(os.scandir(folder), key=lambda e: e.name.lower())
        except OSError as exc:
            raise FilesError(f"{rel_dir or 'the project'} cannot be read: {exc.strerror or exc}") from exc
        for child in children[: MAX_ENTRIES * 2]:
            if child.name == ".git":
                continue
            rel = f"{base}/{child.name}" if base else child.name
            try:
                st = child.stat(follow_symlinks=True)
            except OSError:
                continue
            is_dir = stat.S_ISDIR(st.st_mode)
            if spec.match_file(rel + ("/" if is_dir else "")):
                continue
            name = child.name
            if not _utf8(name):  # a name that is not UTF-8 (bytes from another system): shown with � for them
                name = _shown(name)
                rel = _shown(rel)
            out.append(Entry(name, rel, is_dir, 0 if is_dir else st.st_size, st.st_mtime))
            if len(out) >= MAX_ENTRIES:
                break
        return sorted(out, key=lambda e: (not e.is_dir, e.name.lower()))

    def read_text(self, rel: str, limit: int = VIEW_LIMIT) -> tuple[str, int]:
        """(text, size in bytes) of a project file, or FilesError saying why it cannot be shown."""
        self._whole()
        path = self.resolve(rel)
        if not path.is_file():
            raise FilesError(f"{rel} is not a file")
        try:
            size = path.stat().st_size
            if size > limit:
                raise FilesError(f"{rel} is {size:,} bytes; the limit is {limit:,} bytes")
            with path.open("rb") as f:
                data = f.read(limit + 1)
        except OSError as exc:  # unreadable (permissions), or gone meanwhile
            raise FilesError(f"{rel} cannot be read: {exc.strerror or exc}") from exc
        if b"\x00" in data:
            raise FilesError(f"{rel} is a binary file: not shown")
        try:
            return data.decode("utf-8"), size
        except UnicodeDecodeError as exc:
            raise FilesError(f"{rel} is not UTF-8 text: not shown") from exc


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # os.scandir gives undecodable bytes as lone surrogates
        return False
    return True


def _shown(name: str) -> str:
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
