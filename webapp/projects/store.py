"""The project registry: which directories are projects, which one is open, and what a directory
must be to become one.

A project is a directory plus flashcode's own data about it, keyed by the project's id: its
conversations (`conversations.project_id`), allow rules and network switch (`agent_*.project`),
reply stats (`stats_replies.project_id`) and files under `$FLASHCODE_HOME/projects/<id>/` (saved
contexts, automatic saves). The id is derived from the directory (`name-<hash of the path>`), so a
project removed with its data kept comes back with it when the same directory is added again.
"Default" (id `default`) is the scratch project under `$FLASHCODE_HOME/projects/scratch`: the one
open at first start, never the server's working directory.

What it knows: the `projects` table, the checks on a directory, and which rows and folders a
project's data is made of (to delete them when asked). What it does not know: HTTP, the UI, engines.
Removing a project never touches its directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shlex
import shutil
import sqlite3
import sys
import time
from pathlib import Path

from engine import paths

from ..db import transaction
from ..turns import ProjectRef

log = logging.getLogger(__name__)
DEFAULT_ID = "default"
SCRATCH = "scratch"  # the Default project's directory under projects/: never a project id
MAX_NAME_CHARS = 80


class ProjectError(ValueError):
    """A directory or name that cannot be a project; the message says what to do."""


def check_directory(raw: str | os.PathLike[str], data_dir: Path | None = None) -> Path:
    """The resolved directory `raw` names, or ProjectError saying why it cannot be a project: not the root,
    not the home folder or one above it (commands may write anywhere in a project: the shell's start-up
    files and every tool's settings would be in reach), and not flashcode's own data directory (`data_dir`)."""
    text = str(raw).strip()
    if not text:
        raise ProjectError("type the path of a directory, e.g. ~/code/myapp")
    if "\x00" in text or len(text) > 4096:
        raise ProjectError("that path is not a usable directory path (a NUL byte, or too long)")
    path = Path(text).expanduser()
    if not path.is_absolute():
        raise ProjectError(f"{text} is not an absolute path: start it with / or ~/")
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as exc:
        raise ProjectError(f"{text} cannot be checked: {exc.strerror or exc}") from exc
    if not exists:
        raise ProjectError(
            f"{text} does not exist: check the spelling, or make the folder first (File › New Project… in the "
            "browser makes it, as does mkdir -p in a terminal)"
        )
    if not is_dir:
        raise ProjectError(f"{text} is a file, not a directory: pick the folder that holds it")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ProjectError(f"{text} is not readable by flashcode (permissions): pick a folder you own")
    resolved = path.resolve()
    try:
        str(resolved).encode("utf-8")
    except UnicodeEncodeError:
        raise ProjectError(
            f"{_shown(text)} has bytes in its name that are not UTF-8 text (from another system?): rename the "
            "folder, then add it"
        ) from None
    if any(c in str(resolved) for c in "\t\n\r"):
        raise ProjectError(
            f"{_shown(text)} has a tab or a line break in its name: rename the folder, then add it"
        )
    if resolved == Path(resolved.anchor):
        raise ProjectError("the root directory cannot be a project: pick a folder of your own")
    if resolved.parts[1:2] in (("proc",), ("sys",), ("dev",)) and sys.platform.startswith("linux"):
        raise ProjectError(
            f"{_shown(text)} is in /{resolved.parts[1]}, the kernel's view of the system (not files of your own; "
            "/proc/self is a running process): pick a folder of your own"
        )
    home = Path(os.environ.get("HOME") or Path.home()).resolve()
    if resolved == home or resolved in home.parents:
        what = "your home folder" if resolved == home else "a folder that holds your home folder"
        raise ProjectError(
            f"{text} is {what}: the agent's commands may write anywhere in a project, so pick the folder of "
            "one project inside it, e.g. ~/code/myapp"
        )
    _check_not_shared(resolved, home, text)
    if data_dir is not None:
        check_apart_from_data(resolved, data_dir, text)
    return resolved


def make_folder(raw: str | os.PathLike[str]) -> Path | None:
    """New Project: the folder `raw` names, made when it does not exist and its parent does; None when there is
    nothing to make (it exists, or the path is not one `check_directory` would take: it says why). The caller
    checks the new folder as any other and removes it (empty) if refused."""
    text = str(raw).strip()
    if not text or "\x00" in text or len(text) > 4096:
        return None
    path = Path(text).expanduser()
    try:
        if not path.is_absolute() or path.exists() or path.is_symlink():
            return None
        if not path.parent.is_dir():
            above = next((p for p in path.parents if p.exists() or p.is_symlink()), None)
            if above is not None and not above.is_dir():  # it said the file "does not exist" (walkthrough)
                raise ProjectError(
                    f"{above} is a file, not a directory, so no folder can be made in it: pick another folder"
                )
            raise ProjectError(
                f"{path.parent} does not exist: New Project makes only the last folder of a path; create "
                f"{path.parent} first, or pick another folder"
            )
        path.mkdir()
    except OSError as exc:
        raise ProjectError(f"{text} could not be created: {exc.strerror or exc}") from exc
    return path


# folders under $HOME that hold other programs' settings and credentials (git's global config, the gh CLI's
# token, the shell's), and folders of credentials: as a project, commands could write what runs later outside
# the sandbox, and the project itself is never hidden from them (webapp.agent.sandbox hides what is inside it)
SHARED_FOLDERS = (".config", ".local", ".local/share", ".local/bin", ".cache", ".var", "Library")
# no folder inside them either: what programs run for the user from there (at login, at each shell's start)
SETTINGS_FOLDERS = (".config", ".local", ".cache", ".var", ".oh-my-zsh", "Library/LaunchAgents")
# a project's own environment on PATH (activated where flashcode started): not refused (docs/security.md)
ENVIRONMENT_FOLDERS = frozenset({".venv", "venv", ".env", "env", "node_modules", ".devbox", ".direnv", ".pixi",
                                 ".tox", ".nox", ".conda", ".flox"})  # fmt: skip
CREDENTIAL_FOLDERS = (".ssh", ".gnupg", ".aws", ".azure", ".docker", ".kube", ".password-store", ".config/gh",
                      ".config/gcloud", ".local/share/keyrings", ".mozilla", ".claude", ".codex")  # fmt: skip


def _check_not_shared(resolved: Path, home: Path, text: str) -> None:
    if any(resolved == home / f for f in SHARED_FOLDERS):
        raise ProjectError(
            f"{text} holds the settings of many programs (git's, your shell's) and credentials: a command could "
            "change what runs outside the sandbox later. Pick a folder of your own, e.g. ~/code/myapp"
        )
    if any(resolved == home / f or resolved.is_relative_to(home / f) for f in CREDENTIAL_FOLDERS):
        raise ProjectError(
            f"{text} holds credentials: it cannot be a project, whose commands could read them"
        )
    # one folder down is the same reach (a review): ~/.config/git's config and hooks run in every repository,
    # ~/.config/systemd and ~/.config/autostart at each login, ~/.local/lib's .pth files at each Python start,
    # ~/.cache/pre-commit's hooks at each commit
    inside = next((f for f in SETTINGS_FOLDERS if resolved.is_relative_to(home / f)), None)
    # (an exact ~/.config is the message above; ~/.oh-my-zsh and ~/Library/LaunchAgents themselves are this one)
    if inside is not None:
        raise ProjectError(
            f"{text} is in ~/{inside}, where programs keep settings and code they run for you (git's config "
            "and hooks, what starts at login, Python's start-up files): a command could change what runs outside "
            "the sandbox later. Keep those files in a folder of your own (a dotfiles repository) and open that"
        )
    on_path = {Path(d).resolve() for d in os.environ.get("PATH", "").split(os.pathsep) if os.path.isabs(d)}
    if resolved in on_path:
        raise ProjectError(
            f"{text} is on your PATH: a program a command wrote there would run, outside the sandbox, the next "
            "time you or flashcode type its name. Pick a project folder that is not on PATH"
        )
    # a folder on PATH inside it (~/.cargo holds ~/.cargo/bin) is the same; the project's own environment's is
    # not refused (a .venv, node_modules/.bin, devbox's, activated where flashcode started: docs/security.md)
    held = sorted(d for d in on_path if d.is_relative_to(resolved) and not _environment_bin(d, resolved))
    if held:
        raise ProjectError(
            f"{text} holds {held[0]}, which is on your PATH: a program a command wrote there would run, outside "
            "the sandbox, the next time you or flashcode type its name. Pick a folder that holds no folder on "
            "PATH, or start flashcode from a shell whose PATH does not name it"
        )


def _environment_bin(folder: Path, project: Path) -> bool:
    """Whether `folder` (on PATH, inside `project`) is the programs folder of the project's own environment: a
    Python virtual environment's or a conda environment's, or one under an environment's folder
    (`node_modules/.bin`, devbox's, direnv's, pixi's)."""
    return (
        (folder.parent / "pyvenv.cfg").is_file()
        or (folder.parent / "conda-meta").is_dir()
        or any(part in ENVIRONMENT_FOLDERS for part in folder.relative_to(project).parts[:-1])
    )


def _shown(text: str) -> str:
    return (
        text.encode("utf-8", "surrogateescape")
        .decode("utf-8", "replace")
        .replace("\n", "\\n")
        .replace("\t", "\\t")
    )


def check_apart_from_data(resolved: Path, data_dir: Path, text: str | None = None) -> None:
    """A new project is neither flashcode's data directory, nor inside it, nor holding it: its commands
    and file tools could reach every conversation and saved context there."""
    data, text = Path(data_dir).resolve(), text or str(resolved)
    if resolved == data or data in resolved.parents:
        where = "is" if resolved == data else "is inside"
        raise ProjectError(
            f"{text} {where} flashcode's own data directory ({data}): pick a folder of your own"
        )
    if resolved in data.parents:
        raise ProjectError(
            f"{text} holds flashcode's own data directory ({data}), where your conversations and saved "
            "contexts are: pick the folder of one project inside it, or keep the data elsewhere "
            "(FLASHCODE_HOME)"
        )


def clean_name(name: str, given: bool = True) -> str:
    """A project name on one line; a name the user `given` is refused over MAX_NAME_CHARS (one taken
    from a folder's name is cut to it)."""
    text = " ".join("".join(c if c.isprintable() else " " for c in name).split())
    if not text:
        raise ProjectError("a project name cannot be empty")
    if len(text) > MAX_NAME_CHARS and given:
        raise ProjectError(
            f"a project name is at most {MAX_NAME_CHARS} characters (this one has {len(text)}): pick a shorter one"
        )
    return text[:MAX_NAME_CHARS].rstrip()


def project_id_for(path: Path, n: int = 1) -> str:
    """`name-hash`: a valid context project id (engine.sessions.check_id), stable for a directory (`n`:
    the next one, when a project moved away from the directory still has its first)."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", path.name).strip("-_")[:40] or "project"
    key = str(path) if n == 1 else f"{path}\0{n}"
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return f"{stem}-{digest}"


MAX_FOLDER_IDS = 20  # a folder's ids looked at for kept data when it is added (`project_id_for`'s n)
PROJECT_DATA = (  # (table, column) of what flashcode keeps about a project beside the projects table
    ("conversations", "project_id"),
    ("agent_allow_rules", "project"),
    ("agent_project_settings", "project"),
    ("mcp_servers", "project"),
    ("agent_actions", "project"),
    ("agent_file_changes", "project"),
    ("stats_replies", "project_id"),
)


class ProjectStore:
    """The projects of one data directory (a `webapp.turns.ProjectLookup`)."""

    def __init__(self, conn: sqlite3.Connection, data_dir: Path) -> None:
        self.conn, self.data_dir = conn, Path(data_dir)

    # ------------------------------------------------------------------ reading
    def scratch_dir(self) -> Path:
        d = paths.projects_dir(self.data_dir) / SCRATCH
        d.mkdir(parents=True, exist_ok=True)
        return d.resolve()

    def data_folder(self, project_id: str) -> Path:
        """Where flashcode keeps its files about a project (saved contexts, automatic saves)."""
        return paths.projects_dir(self.data_dir) / project_id

    def _ref(self, row: sqlite3.Row | tuple) -> ProjectRef:
        pid, name, path = row[0], row[1], row[2]
        return ProjectRef(pid, name, Path(path) if path else self.scratch_dir())

    def _one(self, where: str, *args: object) -> ProjectRef | None:
        row = self.conn.execute(f"SELECT id, name, path FROM projects WHERE {where}", args).fetchone()
        return self._ref(row) if row else None

    def all(self) -> list[ProjectRef]:
        rows = self.conn.execute("SELECT id, name, path FROM projects ORDER BY name COLLATE NOCASE")
        return [self._ref(r) for r in rows.fetchall()]

    def recent(self, limit: int = 8) -> list[ProjectRef]:
        """The projects opened or added last, newest first (one added with `flashcode projects add` and never
        opened counts from when it was added: it was missing from Open Recent), and Default always (where a
        first start works, opened or not: its conversations must stay in reach), last when it was never opened."""
        default = self._default()
        rows = self.conn.execute(
            "SELECT id, name, path FROM projects "
            "ORDER BY COALESCE(opened_at, CASE WHEN id = ? THEN -1 ELSE created_at END) DESC LIMIT ?",
            (DEFAULT_ID, limit),
        ).fetchall()
        found = [self._ref(r) for r in rows]
        return found if any(p.id == DEFAULT_ID for p in found) else [*found, default]

    def get(self, project_id: str) -> ProjectRef | None:
        return self._one("id = ?", project_id)

    def by_name(self, name: str) -> ProjectRef | None:
        return self._one("name = ?", name.strip())

    def by_path(self, path: Path) -> ProjectRef | None:
        if Path(path).resolve() == self.scratch_dir():
            return self.get(DEFAULT_ID)
        return self._one("path = ?", str(Path(path).resolve()))

    def current(self) -> ProjectRef:
        """The project opened last; Default (the scratch folder) until one is opened."""
        found = self._one("opened_at IS NOT NULL ORDER BY opened_at DESC LIMIT 1")
        return found or self._default()

    def of_conversation(self, conversation_id: str | None) -> ProjectRef:
        if conversation_id:
            row = self.conn.execute(
                "SELECT p.id, p.name, p.path FROM conversations c JOIN projects p ON p.id = c.project_id "
                "WHERE c.id = ?",
                (conversation_id,),
            ).fetchone()
            if row:
                return self._ref(row)
        return self.current()

    def conversation_counts(self) -> dict[str, int]:
        rows = self.conn.execute(  # the Trash's are not counted: the list does not show them
            "SELECT project_id, COUNT(*) FROM conversations WHERE trashed_at IS NULL GROUP BY project_id"
        )
        return {pid: int(n) for pid, n in rows.fetchall()}

    def trashed_count(self, project_id: str) -> int:
        row = self.conn.execute(
            "SELECT COUNT(*) FROM conversations WHERE project_id = ? AND trashed_at IS NOT NULL",
            (project_id,),
        ).fetchone()
        return int(row[0])

    def _default(self) -> ProjectRef:
        self.conn.execute(
            "INSERT OR IGNORE INTO projects (id, name, path, created_at) VALUES (?, 'Default', '', ?)",
            (DEFAULT_ID, time.time()),
        )
        found = self.get(DEFAULT_ID)
        assert found is not None
        return found

    # ------------------------------------------------------------------ changes
    def add(self, directory: str | os.PathLike[str], name: str | None = None) -> ProjectRef:
        """Add a directory (checked) as a project; an existing project of that directory is returned
        as it is (renamed when `name` is given)."""
        path = check_directory(directory)
        if path == self.scratch_dir():
            return self._default()
        existing = self.by_path(path)
        if existing is not None:  # also one listed before the data directory rule (its files are guarded)
            self._adopt_kept(path, existing.id)  # what a project removed from this folder kept comes back
            return self.rename(existing.id, name) if name else existing
        check_apart_from_data(path, self.data_dir, str(directory).strip())
        pid = project_id_for(path)
        n = 2
        while self.get(pid) is not None:  # a project moved away from this folder keeps the folder's id
            pid, n = project_id_for(path, n), n + 1
        wanted = clean_name(name) if name else clean_name(path.name or "project", given=False)
        final = wanted if name else self._free_name(wanted)
        self._check_name_free(final, pid)
        self.conn.execute(
            "INSERT INTO projects (id, name, path, created_at) VALUES (?, ?, ?, ?)",
            (pid, final, str(path), time.time()),
        )
        self._adopt_kept(path, pid)
        found = self.get(pid)
        assert found is not None
        return found

    def _adopt_kept(self, path: Path, pid: str) -> None:
        """Data kept for this folder under an id no listed project has — that of a second project once made
        in the same folder (its `n`th id), removed while another still held the folder's first — joins the
        new project: adding a folder again brings back everything kept for it."""
        for n in range(1, MAX_FOLDER_IDS + 1):
            other = project_id_for(path, n)
            if other == pid or self.get(other) is not None or not self._has_data(other):
                continue
            with transaction(self.conn):
                for table, column in PROJECT_DATA:  # beside what is there: the new project's settings win
                    self.conn.execute(
                        f"UPDATE OR IGNORE {table} SET {column} = ? WHERE {column} = ?", (pid, other)
                    )
            self._merge_folder(other, pid)

    def _has_data(self, project_id: str) -> bool:
        if self.data_folder(project_id).is_dir():
            return True
        return any(
            self.conn.execute(f"SELECT 1 FROM {table} WHERE {column} = ? LIMIT 1", (project_id,)).fetchone()
            for table, column in PROJECT_DATA
        )

    def _free_name(self, name: str) -> str:
        n, candidate = 2, name
        while self.by_name(candidate) is not None:
            candidate, n = f"{name} {n}", n + 1
        return candidate

    def _check_name_free(self, name: str, project_id: str) -> None:
        other = self.by_name(name)
        if other is not None and other.id != project_id:
            raise ProjectError(f"a project named {name!r} already exists ({other.path}): pick another name")

    def rename(self, project_id: str, name: str) -> ProjectRef:
        if project_id == DEFAULT_ID:  # the page's Rename Project… and `flashcode projects rename` alike
            raise ProjectError("Default is the scratch project and keeps its name")
        final = clean_name(name)
        self._check_name_free(final, project_id)
        self.conn.execute("UPDATE projects SET name = ? WHERE id = ?", (final, project_id))
        found = self.get(project_id)
        if found is None:
            raise ProjectError(f"there is no project {project_id}")
        return found

    def _merge_folder(self, source: str, target: str) -> None:
        """Move a project's files (saved contexts, automatic saves) to another id's folder, beside what is
        there; an entry whose name is taken stays where it was (nothing is overwritten or deleted)."""
        src, dst = self.data_folder(source), self.data_folder(target)
        try:
            if not src.is_dir() or src.is_symlink():
                return
            if not dst.exists():
                src.rename(dst)
                return
            for kind in [d for d in src.iterdir() if d.is_dir() and not d.is_symlink()]:
                (dst / kind.name).mkdir(exist_ok=True)
                for entry in list(kind.iterdir()):
                    if not (dst / kind.name / entry.name).exists():
                        entry.rename(dst / kind.name / entry.name)
        except OSError as exc:  # what did not move stays under the old id: kept, never lost
            log.warning("moving project files from %s to %s stopped: %s", src, dst, exc)

    def move(self, project_id: str, directory: str | os.PathLike[str]) -> ProjectRef:
        """Point a project at its folder's new place (moved or renamed on disk). The project keeps its id,
        so its conversations, rules, settings and saved contexts come along."""
        found = self.get(project_id)
        if found is None:
            raise ProjectError(f"there is no project {project_id!r}")
        if project_id == DEFAULT_ID:
            raise ProjectError(
                "Default is the scratch project: its folder is flashcode's own and does not move"
            )
        path = check_directory(directory, self.data_dir)
        other = self.by_path(path)
        if other is not None and other.id != project_id:
            raise ProjectError(
                f"{path} is already the project {other.name!r}: remove that one first "
                f"(flashcode projects remove {shlex.quote(other.name)}) or pick another folder"
            )
        self.conn.execute("UPDATE projects SET path = ? WHERE id = ?", (str(path), project_id))
        self._adopt_kept(
            path, project_id
        )  # a project removed from that folder kept its data: it joins this one
        moved = self.get(project_id)
        assert moved is not None
        return moved

    def open(self, project_id: str) -> ProjectRef:
        if project_id == DEFAULT_ID:
            self._default()
        found = self.get(project_id)
        if found is None:
            raise ProjectError(f"there is no project {project_id!r}: add its directory first")
        self.conn.execute("UPDATE projects SET opened_at = ? WHERE id = ?", (time.time(), project_id))
        return found

    def resolve(self, key: str) -> ProjectRef | None:
        """A project by name, id or directory (what the command line takes)."""
        if key.startswith(
            ("/", "~")
        ):  # a path names the project at that folder first (a name may look like one)
            try:
                at = self.by_path(Path(key).expanduser())
            except (OSError, ValueError, RuntimeError):  # RuntimeError: `~name` of no such user
                at = None
            if at is not None:
                return at
        return self.by_name(key) or self.get(key)

    def remove(self, project_id: str, delete_data: bool = False) -> ProjectRef:
        """Take a project off the list; its directory is never touched. With `delete_data`, also
        delete flashcode's own data about it: conversations, rules, stats, saved contexts."""
        found = self.get(project_id)
        if found is None:
            raise ProjectError(f"there is no project {project_id!r}")
        if project_id == DEFAULT_ID:
            raise ProjectError("Default is the scratch project and stays on the list")
        statements = ["DELETE FROM projects WHERE id = ?"]
        rekey = None  # moved: its kept data follows its folder, under the id adding that folder would give it
        if not delete_data and found.path is not None:
            for n in range(1, MAX_FOLDER_IDS + 1):
                # a listed project may hold the folder's first id (one that lived there before it moved away):
                # then the next free one, which `add` gives the folder and `_adopt_kept` looks under (a review
                # found the data kept under the old id, which no folder would ever adopt)
                target = project_id_for(Path(found.path), n)
                if target == project_id:
                    break
                if self.get(target) is None:
                    rekey = target
                    break
        if delete_data:  # a conversation's messages go with it (cascade)
            statements += [f"DELETE FROM {table} WHERE {column} = ?" for table, column in PROJECT_DATA]
        with transaction(self.conn):
            for sql in statements:
                self.conn.execute(sql, (project_id,))
            if rekey is not None:
                for table, column in PROJECT_DATA:
                    self.conn.execute(  # beside what an earlier project of that folder kept: its settings win
                        f"UPDATE OR IGNORE {table} SET {column} = ? WHERE {column} = ?", (rekey, project_id)
                    )
        if rekey is not None:
            self._merge_folder(project_id, rekey)
        if delete_data:
            folder = self.data_folder(project_id)
            root = paths.projects_dir(self.data_dir).resolve()
            if folder.is_dir() and not folder.is_symlink() and folder.resolve().parent == root:
                shutil.rmtree(folder, ignore_errors=True)
        return found
