"""File tools confined to one project directory: read, and propose/apply writes and edits.

What it knows: that every path is resolved (symlinks included) and must stay inside the project's
resolved root, or `PathOutsideProjectError` is raised; that a write or edit is first a
`FileChange` with a unified diff, applied only after approval, and refused if the file changed in
between. What it does not know: approval itself (the agent loop asks), the model, the UI.

How a write stays inside: at apply time every folder from the root down is opened again without
following symlinks (O_NOFOLLOW, one `openat` per name), the target is opened the same way and must
be a regular file with one link (a hard link would share its contents with a file elsewhere) whose
text is still the diff's, and the new text goes to a temp file in that folder that is renamed
over the name: a symlink swapped in after the check is replaced, never followed. An undo (`undo`)
puts back what a write replaced, or removes the file it made, the same way, only while the file
still holds what the write left. Bad paths (NUL
bytes, names past the system's limits, symlink loops, deep nesting) raise `FileToolError` with a
message, never anything else.

Not covered: the project root itself is trusted; a read may follow a hard link out of the project
(package managers such as pnpm hard-link whole trees).
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .sandbox import (
    ProjectMovedError,
    inner_data_dirs,
    looks_like_data_dir,
    own_paths,
    pinned_project,
    secret_paths,
)

MAX_READ_BYTES = 200_000
MAX_SEARCH_BYTES = 8 << 20  # search_text reads this much of a file at most
MAX_EDIT_BYTES = 5 << 20  # the file tools diff and rewrite text files up to this size
MAX_PATH_BYTES = 4096  # PATH_MAX on Linux (1024 on macOS is checked by the system itself)
MAX_NAME_BYTES = 255
MAX_DEPTH = 64  # names in a path, counted from /
SHOWN_LINES = 40  # an edit whose text does not occur: at most this many of the file's lines in the error
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO never blocks


class FileToolError(Exception):
    """A file tool refused or failed; the message says why (it goes back to the model and UI)."""


class StaleChange(FileToolError):
    """The file changed between the diff shown and the write approved: nothing was written, and the
    same call may be made again (it proposes a fresh diff)."""


class PathOutsideProjectError(FileToolError):
    pass


@dataclass(frozen=True)
class FileChange:
    path: str  # relative to the project root, as shown
    old: str | None  # None: a new file
    new: str
    diff: str
    type: str = "file_change"


def _near(text: str, find: str) -> str:
    """The lines of `text` to copy an edit's `old_text` from: all of them when there are at most SHOWN_LINES,
    else SHOWN_LINES around the line most like `find`'s first line; numbered as read_file numbers them."""
    lines = text.splitlines()
    start = 0
    if len(lines) > SHOWN_LINES:
        first = next((ln.strip() for ln in find.splitlines() if ln.strip()), find.strip())
        best = max(
            range(len(lines)), key=lambda i: difflib.SequenceMatcher(None, lines[i].strip(), first).ratio()
        )
        start = max(0, min(best - SHOWN_LINES // 2, len(lines) - SHOWN_LINES))
    part = lines[start : start + SHOWN_LINES]
    what = (
        "The file's text"
        if len(part) == len(lines)
        else f"Lines {start + 1}-{start + len(part)} of {len(lines)}"
    )
    body = "\n".join(f"{start + i + 1:>5}  {ln}" for i, ln in enumerate(part))
    return f"{what} (old_text must be copied from it exactly, without the line numbers):\n{body}"


def shown(path: str, limit: int = 120) -> str:
    """A path for a message: invisible characters escaped (repr), at most `limit` characters."""
    text = repr(str(path))[1:-1]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _os_message(path: str, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return f"{shown(path)}: a symlink loop (a link that leads back to itself): remove the link or use another path"
    if exc.errno == errno.ENAMETOOLONG:
        return f"{shown(path)}: the path is too long for this system (at most {MAX_NAME_BYTES} bytes a name)"
    if exc.errno == errno.ENOTDIR:
        return f"{shown(path)}: a part of the path is a file, not a folder"
    return f"{shown(path)}: {exc.strerror or exc}"


def _check_path(path: str, given: str | None = None) -> None:
    """Refuse a path no tool here can show or reopen: not UTF-8, too long, too deep."""
    given = path if given is None else given
    try:
        data = path.encode("utf-8")
    except UnicodeError as exc:  # a lone surrogate: no UTF-8 name, nothing the page or database can hold
        raise FileToolError(
            f"not a file path: {shown(given)} holds characters that are not UTF-8 text"
        ) from exc
    parts = Path(path).parts
    if len(data) >= MAX_PATH_BYTES or any(len(p.encode()) > MAX_NAME_BYTES for p in parts):
        raise FileToolError(
            f"{shown(given)}: the path is too long (at most {MAX_PATH_BYTES - 1} bytes in all, "
            f"{MAX_NAME_BYTES} bytes a name)"
        )
    if len(parts) > MAX_DEPTH:
        raise FileToolError(
            f"{shown(given)} is nested {len(parts)} folders deep; the file tools go at most {MAX_DEPTH} deep"
        )


@contextmanager
def _os_errors(path: str) -> Iterator[None]:
    """OSError (and the RuntimeError older Pythons raise for symlink loops) -> FileToolError."""
    try:
        yield
    except FileToolError:
        raise
    except OSError as exc:
        raise FileToolError(_os_message(path, exc)) from exc
    except RuntimeError as exc:  # Path.resolve on Python < 3.13: "Symlink loop from ..."
        raise FileToolError(_os_message(path, OSError(errno.ELOOP, str(exc)))) from exc


class ProjectFiles:
    def __init__(self, root: Path, hidden: tuple[Path, ...] = ()) -> None:
        try:
            self.root = pinned_project(root)  # never a folder a symbolic link swapped in since it was added
        except ProjectMovedError as exc:
            raise FileToolError(str(exc)) from None
        if not self.root.is_dir():
            raise FileToolError(f"the project directory {root} is not a directory")
        # inside the project but out of bounds: flashcode's data directory (every conversation, saved
        # context and allow rule) when the project holds it; one that holds the project (the scratch
        # project's) is no bound here: the root already is
        self.hidden = tuple(
            h for h in (Path(p).resolve() for p in hidden) if h != self.root and h.is_relative_to(self.root)
        )
        # the user's secrets the sandbox hides from commands, when the project holds them (one opened at a
        # folder such as ~/.config): hidden from the file tools too
        self.secrets = tuple(
            h for h in (p.resolve() for p in secret_paths()) if h != self.root and h.is_relative_to(self.root)
        )
        # flashcode's own Python environment and source, when they lie in the project: they run outside the
        # sandbox (a `.pth` file there would run at flashcode's next start), so the agent never writes there
        self.own = tuple(p for p in own_paths() if p != self.root and p.is_relative_to(self.root))
        self.hidden += self.secrets  # left out of listings and searches too
        # another flashcode data directory inside the project (its allow rules, its conversations): the sandbox
        # hides it from commands, and the file tools keep out of it too (`resolve` checks ones made since)
        self.hidden += tuple(inner_data_dirs(self.root))
        # an edit whose text does not occur: the error shows the file's lines (all of a short file; else those
        # around the closest line) to copy `old_text` from. A small model otherwise invents it (`return add(a, b)`
        # for `return a - b`) and repeats the call; bench/agent.py --mode constrained-noshow turns it off
        self.show_on_miss = True

    def resolve(self, path: str | Path) -> Path:
        """The real path of `path` (relative to the root, or absolute); refused if outside."""
        raw = str(path).strip()
        if not raw:
            raise FileToolError("not a file path: it is empty")
        if "\x00" in raw:
            raise FileToolError(f"not a file path: {shown(raw)} has a NUL byte, which no file name can hold")
        _check_path(raw)
        with _os_errors(raw):
            p = Path(os.path.expanduser(raw)) if raw.startswith("~") else Path(raw)
            full = (p if p.is_absolute() else self.root / p).resolve(strict=False)
        if full != self.root and not full.is_relative_to(self.root):
            raise PathOutsideProjectError(
                f"{shown(raw)} resolves to {shown(str(full))}, outside the project {self.root}: refused"
            )
        if any(full == h or full.is_relative_to(h) for h in self.secrets):
            raise PathOutsideProjectError(
                f"{shown(raw)} holds credentials (one of the paths the sandbox hides), which are out of bounds "
                "for the agent"
            )
        if any(full == h or full.is_relative_to(h) for h in self.hidden) or any(
            looks_like_data_dir(d)
            for d in (full, *full.parents)
            if d != self.root and d.is_relative_to(self.root)
        ):
            raise PathOutsideProjectError(
                f"{shown(raw)} is in a flashcode data directory, which is out of bounds for the agent"
            )
        _check_path(str(full), raw)  # a link may lead somewhere deeper or to a name that is not UTF-8
        return full

    def relative(self, full: Path) -> str:
        return str(full.relative_to(self.root)) if full != self.root else "."

    # ------------------------------------------------------------------ opening without following links
    def _open_dir(
        self, parts: tuple[str, ...], create: bool = False, made: list[str] | None = None
    ) -> int | None:
        """A descriptor of root/parts, each folder opened without following a symlink; None if one
        is missing (created when `create`; each one made is added to `made`). Refuses a symlink or a file on
        the way."""
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for i, part in enumerate(parts):
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        os.close(fd)
                        return None
                    os.mkdir(part, 0o777, dir_fd=fd)
                    if made is not None:
                        made.append(part)
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    where = shown("/".join(parts[: i + 1]))
                    raise PathOutsideProjectError(
                        f"{where} is a symlink or a file, not a folder (it changed after the path was "
                        "checked): refused; propose the change again"
                    ) from exc
                os.close(fd)
                fd = nxt
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _open_file(self, dfd: int, name: str, rel: str) -> int | None:
        """`name` in the folder `dfd`, opened for reading without following a symlink; None if absent."""
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PathOutsideProjectError(
                    f"{shown(rel)} is now a symlink (it changed after the path was checked): refused"
                ) from exc
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise FileToolError(f"{shown(rel)} is not a regular file")
        return fd

    def _open_target(self, full: Path) -> int | None:
        """The regular file at `full`, opened for reading with no link followed on the way; None if absent."""
        parts = full.relative_to(self.root).parts
        dfd = self._open_dir(parts[:-1])
        if dfd is None:
            return None
        try:
            return self._open_file(dfd, parts[-1], self.relative(full))
        finally:
            os.close(dfd)

    @staticmethod
    def _text(fd: int, rel: str) -> tuple[str, int]:
        """The text and mode of an open regular file (closed after). Refused when it has more than
        one hard link (writing it would change its other names, maybe outside the project, too) or
        is too big to diff."""
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_nlink > 1:
                raise FileToolError(
                    f"{shown(rel)} has {st.st_nlink} hard links: another name, maybe outside the project, "
                    "shares its contents and would change too: refused (copy it to a new file to edit it)"
                )
            if st.st_size > MAX_EDIT_BYTES:
                raise FileToolError(
                    f"{shown(rel)} is {st.st_size:,} bytes; the file tools edit text files "
                    f"up to {MAX_EDIT_BYTES:,} bytes"
                )
            data = f.read(MAX_EDIT_BYTES + 1)
        try:
            return data.decode("utf-8"), st.st_mode
        except UnicodeDecodeError as exc:  # a lossy text would write bytes the diff does not show
            raise FileToolError(
                f"{shown(rel)} is not UTF-8 text (byte {exc.start:,}): the file tools change only UTF-8 text "
                "files, so a diff shows every byte written; run a command to change it"
            ) from None

    # ------------------------------------------------------------------ the tools
    def read(self, path: str, max_bytes: int = MAX_READ_BYTES) -> str:
        full = self.resolve(path)
        parts = full.relative_to(self.root).parts
        if not parts:
            raise FileToolError(f"{shown(path)} is the project directory, not a file")
        with _os_errors(path):
            fd = self._open_target(full)
            if fd is None:
                raise FileToolError(f"{shown(path)}: no such file in the project")
            with os.fdopen(fd, "rb") as f:
                data = f.read(max_bytes + 1)
        text = data[:max_bytes].decode("utf-8", errors="replace")
        return text + (f"\n[... truncated at {max_bytes} bytes]" if len(data) > max_bytes else "")

    def searchable(self, path: str, max_bytes: int = MAX_SEARCH_BYTES) -> str | None:
        """The first `max_bytes` of a project file as text for `search_text`, opened as `read` opens it (a
        symlink out of the project raises); None for a binary or non-UTF-8 file or a folder."""
        full = self.resolve(path)
        if not full.relative_to(self.root).parts:
            return None
        with _os_errors(path):
            fd = self._open_target(full)
            if fd is None:
                return None
            with os.fdopen(fd, "rb") as f:
                data = f.read(max_bytes)
        if b"\0" in data:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.start < len(data) - 3:  # not just a character cut at max_bytes
                return None
            return data[: exc.start].decode("utf-8")

    def _current(self, full: Path) -> str | None:
        """The file's text now; None when there is no such file."""
        rel = self.relative(full)
        with _os_errors(rel):
            fd = self._open_target(full)
            return None if fd is None else self._text(fd, rel)[0]

    def _writable(self, full: Path, path: str) -> None:
        if any(full == p or full.is_relative_to(p) for p in self.own):
            raise FileToolError(
                f"{shown(path)} is in flashcode's own Python environment or source, which runs outside the "
                "sandbox: the agent does not write there"
            )

    def propose_write(self, path: str, content: str) -> FileChange:
        full = self.resolve(path)
        self._writable(full, path)
        if full == self.root:
            raise FileToolError("cannot write the project directory itself")
        old = self._current(full)
        return FileChange(self.relative(full), old, content, unified_diff(self.relative(full), old, content))

    def propose_edit(self, path: str, find: str, replace: str) -> FileChange:
        full = self.resolve(path)
        self._writable(full, path)
        if full == self.root:
            raise FileToolError(f"{shown(path)} is the project directory, not a file")
        old = self._current(full)
        if old is None:
            raise FileToolError(f"{shown(path)}: no such file in the project")
        count = old.count(find) if find else 0
        if count != 1:
            hint = f"\n{_near(old, find)}" if count == 0 and find and self.show_on_miss else ""
            if (
                count > 1
            ):  # where, and what to do: the 0.5B model made the same call three times (walkthrough)
                at, lines = [], 0
                for part in old.split(find)[:-1]:
                    lines += part.count("\n")
                    at.append(lines + 1)
                    lines += find.count("\n")
                where = ", ".join(map(str, at[:10])) + (", …" if len(at) > 10 else "")
                hint = f" (at lines {where}): put more of the lines around the one to change in old_text"
            raise FileToolError(
                f"{shown(path)}: the text to replace occurs {count} times; it must occur exactly once{hint}"
            )
        new = old.replace(find, replace, 1)
        return FileChange(self.relative(full), old, new, unified_diff(self.relative(full), old, new))

    def apply(self, change: FileChange) -> int:
        """Write an approved change. Everything is checked again, on descriptors: no folder on the
        way is a symlink, the file is not a symlink nor hard-linked, and its text is still `old`.
        Returns how many of the path's folders (the deepest) it made, for an undo to remove."""
        full = self.resolve(change.path)
        self._writable(full, change.path)
        parts = full.relative_to(self.root).parts
        if not parts:
            raise FileToolError("cannot write the project directory itself")
        made: list[str] = []
        with _os_errors(change.path):
            dfd = self._open_dir(parts[:-1], create=True, made=made)
            assert dfd is not None
            try:
                self._replace(dfd, parts[-1], change)
            finally:
                os.close(dfd)
        return len(made)

    def undo(self, path: str, before: str | None, after_sha256: str, made_dirs: int = 0) -> str:
        """Put back what a write replaced: `before` (None: the write made the file, which is removed, with the
        `made_dirs` folders the write made for it while they are empty), only while the file still holds the
        text the write left (its hash, `after_sha256`); checked on descriptors, as `apply` checks. Else
        `StaleChange` says why and nothing is written. What it did: "restored", "removed", or "gone" (the file
        the write made was removed since: nothing left to undo but its empty folders)."""
        full = self.resolve(path)
        self._writable(full, path)
        parts = full.relative_to(self.root).parts
        if not parts:
            raise FileToolError("cannot write the project directory itself")
        with _os_errors(path):
            dfd = self._open_dir(parts[:-1])
            try:
                fd = None if dfd is None else self._open_file(dfd, parts[-1], path)
                if fd is None:
                    if before is None:
                        self._remove_made_dirs(path, made_dirs)
                        return "gone"
                    raise StaleChange(
                        f"{shown(path)} is gone (removed since the write): nothing was put back"
                    )
                checked = os.fstat(fd)
                current = self._text(fd, path)[0]
                if text_sha256(current) != after_sha256:
                    raise StaleChange(
                        f"{shown(path)} changed since that write (by you, a command, or a later write): nothing "
                        "was put back. Where a later write made the change, undo that one first"
                    )
                assert dfd is not None
                if before is None:
                    self._remove_checked(dfd, parts[-1], path, checked)
                    self._remove_made_dirs(path, made_dirs)
                    return "removed"
                self._replace(dfd, parts[-1], FileChange(path, current, before, ""))
                return "restored"
            finally:
                if dfd is not None:
                    os.close(dfd)

    def undo_refusal(self, path: str, before: str | None, after_sha256: str) -> str | None:
        """Why `undo` would refuse now, in words (the file changed since, is gone, is out of bounds), or None
        when it would go ahead: for the lists that say which writes can still be undone. Reads only."""
        try:
            full = self.resolve(path)
            with _os_errors(path):
                fd = self._open_target(full)
                if fd is None:
                    return None if before is None else "the file is gone since"
                current = self._text(fd, path)[0]
        except FileToolError as exc:
            return str(exc)
        return None if text_sha256(current) == after_sha256 else "the file changed since"

    def _remove_made_dirs(self, path: str, made_dirs: int) -> None:
        """Remove the deepest `made_dirs` folders of `path` (a made file's, as the write named it: a folder
        swapped for a link since is not followed to another) while each is empty, deepest first, each through
        its parent's descriptor: rmdir never removes a folder that holds anything (a file put there since keeps
        it, and the folders above it). The file is gone already: nothing here fails the undo."""
        folders = PurePosixPath(path).parts[:-1]
        if not made_dirs or any(part in ("", ".", "..", "/") for part in folders):
            return
        for depth in range(len(folders), max(len(folders) - made_dirs, 0), -1):
            try:
                parent = self._open_dir(folders[: depth - 1])
            except (OSError, FileToolError):
                return
            if parent is None:
                return
            try:
                os.rmdir(folders[depth - 1], dir_fd=parent)
            except OSError:
                return
            finally:
                os.close(parent)

    @staticmethod
    def _remove_checked(dfd: int, name: str, path: str, checked: os.stat_result) -> None:
        """Remove `name` only if it is still the file checked: it is renamed aside first, and put back if
        something else (an editor's save, a formatter) replaced it in between, so that file is never deleted."""
        aside = f".flashcode-{secrets.token_hex(6)}.undo"
        os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
        moved = os.stat(aside, dir_fd=dfd, follow_symlinks=False)
        if (moved.st_dev, moved.st_ino) == (checked.st_dev, checked.st_ino):
            os.unlink(aside, dir_fd=dfd)
            return
        try:
            os.link(
                aside, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False
            )  # never over a new one
            os.unlink(aside, dir_fd=dfd)
        except FileExistsError:  # a newer file took the name again: the one moved aside keeps the name it got
            raise StaleChange(
                f"{shown(path)} was replaced while it was being undone: nothing was removed (the file that had "
                f"replaced it is beside it as {aside})"
            ) from None
        raise StaleChange(f"{shown(path)} was replaced while it was being undone: nothing was removed")

    def _replace(self, dfd: int, name: str, change: FileChange) -> None:
        fd = self._open_file(dfd, name, change.path)
        current, mode = (None, None) if fd is None else self._text(fd, change.path)
        if current != change.old:
            raise StaleChange(f"{shown(change.path)} changed since the diff was shown: propose it again")
        tmp = f".flashcode-{secrets.token_hex(6)}.tmp"
        tfd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dfd
        )
        try:
            with os.fdopen(tfd, "wb") as out:
                out.write(change.new.encode("utf-8"))
                if mode is not None:
                    os.fchmod(out.fileno(), stat.S_IMODE(mode))  # keep the old file's permissions
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # replaces a name; never follows one
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise


def text_sha256(text: str) -> str:
    """What an undo compares a file's text with (the text a write left is kept as this hash)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def unified_diff(path: str, old: str | None, new: str) -> str:
    a = (old or "").splitlines(keepends=True)
    b = new.splitlines(keepends=True)
    lines = difflib.unified_diff(
        a, b, fromfile="/dev/null" if old is None else f"a/{path}", tofile=f"b/{path}"
    )
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    )
