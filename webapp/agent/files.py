"""File tools confined to one project directory: read, and propose/apply writes and edits.

What it knows: that every path is resolved (symlinks included) and must stay inside the project's
resolved root, or `PathOutsideProjectError` is raised; that a write or edit is first a
`FileChange` with a unified diff, applied only after approval, and refused if the file changed in
between. What it does not know: approval itself (the agent loop asks), the model, the UI.

Not covered: a symlink swapped in between the check and the write by another process on the same
machine (time-of-check/time-of-use); the project root is trusted.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

MAX_READ_BYTES = 200_000


class FileToolError(Exception):
    """A file tool refused or failed; the message says why (it goes back to the model and UI)."""


class PathOutsideProjectError(FileToolError):
    pass


@dataclass(frozen=True)
class FileChange:
    path: str  # relative to the project root, as shown
    old: str | None  # None: a new file
    new: str
    diff: str
    type: str = "file_change"


class ProjectFiles:
    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve(strict=True)
        if not self.root.is_dir():
            raise FileToolError(f"the project directory {root} is not a directory")

    def resolve(self, path: str | Path) -> Path:
        """The real path of `path` (relative to the root, or absolute); refused if outside."""
        raw = str(path).strip()
        if not raw or "\x00" in raw:
            raise FileToolError(f"not a file path: {raw!r}")
        p = Path(os.path.expanduser(raw)) if raw.startswith("~") else Path(raw)
        full = (p if p.is_absolute() else self.root / p).resolve(strict=False)
        if full != self.root and not full.is_relative_to(self.root):
            raise PathOutsideProjectError(
                f"{raw} resolves to {full}, outside the project {self.root}: refused"
            )
        return full

    def relative(self, full: Path) -> str:
        return str(full.relative_to(self.root)) if full != self.root else "."

    def read(self, path: str, max_bytes: int = MAX_READ_BYTES) -> str:
        full = self.resolve(path)
        if not full.is_file():
            raise FileToolError(f"{path}: no such file in the project")
        with full.open("rb") as f:
            data = f.read(max_bytes + 1)
        text = data[:max_bytes].decode("utf-8", errors="replace")
        return text + (f"\n[... truncated at {max_bytes} bytes]" if len(data) > max_bytes else "")

    def _current(self, full: Path) -> str | None:
        if not full.exists():
            return None
        if not full.is_file():
            raise FileToolError(f"{self.relative(full)} is not a regular file")
        return full.read_text(encoding="utf-8", errors="replace")

    def propose_write(self, path: str, content: str) -> FileChange:
        full = self.resolve(path)
        if full == self.root:
            raise FileToolError("cannot write the project directory itself")
        old = self._current(full)
        return FileChange(self.relative(full), old, content, unified_diff(self.relative(full), old, content))

    def propose_edit(self, path: str, find: str, replace: str) -> FileChange:
        full = self.resolve(path)
        old = self._current(full)
        if old is None:
            raise FileToolError(f"{path}: no such file in the project")
        count = old.count(find) if find else 0
        if count != 1:
            raise FileToolError(
                f"{path}: the text to replace occurs {count} times; it must occur exactly once"
            )
        new = old.replace(find, replace, 1)
        return FileChange(self.relative(full), old, new, unified_diff(self.relative(full), old, new))

    def apply(self, change: FileChange) -> None:
        """Write an approved change; re-checks the path and that the file did not change meanwhile."""
        full = self.resolve(change.path)
        if self._current(full) != change.old:
            raise FileToolError(f"{change.path} changed since the diff was shown: propose it again")
        full.parent.mkdir(parents=True, exist_ok=True)
        self.resolve(change.path)  # the new parents may not have moved it outside
        full.write_text(change.new, encoding="utf-8")


def unified_diff(path: str, old: str | None, new: str) -> str:
    a = (old or "").splitlines(keepends=True)
    b = new.splitlines(keepends=True)
    lines = difflib.unified_diff(
        a, b, fromfile="/dev/null" if old is None else f"a/{path}", tofile=f"b/{path}"
    )
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    )
