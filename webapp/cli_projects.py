"""`flashcode projects [add DIR [--name NAME] | move NAME DIR | rename NAME NEW_NAME | remove NAME [--delete-data]]`, and the `--project
DIR` option of serve, ask, chat (and any command that registers it with `add_project_arg`).

Output of `flashcode projects`: one line per project, tab-separated: name, path, conversations.
What it knows: the command line's forms and messages. The registry is `webapp.projects.store`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import preflight
from .db import Database
from .projects.store import ProjectError, ProjectStore, check_apart_from_data, check_directory
from .render import visible_text
from .turns import ProjectRef
from .units import HELP


def _store() -> tuple[Database, ProjectStore]:
    root = preflight.check_data_dir(preflight.data_dir())
    preflight.check_database(root)
    db = Database(root / "flashcode.db", recover=False)  # `flashcode serve` may be writing a reply
    return db, ProjectStore(db.conn, root)


def _named(store: ProjectStore, name: str) -> ProjectRef:
    found = store.resolve(name)
    if found is None:
        names = ", ".join(p.name for p in store.all())
        raise ProjectError(f"there is no project named {name!r} (projects: {names})")
    return found


def cmd_projects(args: argparse.Namespace) -> int:
    db, store = _store()
    try:
        action = getattr(args, "action", None)
        if action == "add":
            folder = _absolute(args.dir)
            try:
                before = store.by_path(Path(folder).resolve())
            except OSError:
                before = None
            project = store.add(folder, args.name)
            if before is not None and before.id == project.id:  # said, so a rename is never silent
                renamed = f", renamed from {before.name}" if before.name != project.name else ""
                print(
                    visible_text(
                        f"flashcode: {project.path} was already a project ({project.name}{renamed})"
                    ),
                    file=sys.stderr,
                )
            print(visible_text(f"{project.name}\t{project.path}"))
        elif action == "move":
            found = _named(store, args.name)
            moved = store.move(found.id, _absolute(args.dir))
            print(
                visible_text(
                    f"moved {moved.name}: {found.path} -> {moved.path} (its conversations, rules and saved contexts "
                    "stay)"
                )
            )
        elif action == "rename":
            found = _named(store, args.name)
            renamed = store.rename(found.id, args.new_name)
            print(visible_text(f"renamed {found.name} to {renamed.name} ({renamed.path})"))
        elif action == "remove":
            found = _named(store, args.name)
            store.remove(found.id, delete_data=args.delete_data)
            kept = "deleted flashcode's data for it" if args.delete_data else "kept flashcode's data for it"
            print(visible_text(f"removed {found.name} ({found.path} was not touched; {kept})"))
        else:
            counts = store.conversation_counts()
            for p in store.all():
                # a folder's name may hold escape sequences (a title change, a clipboard write): marked, not sent
                print(visible_text(f"{p.name}\t{p.path}\t{counts.get(p.id, 0)}"))
    except ProjectError as exc:
        raise preflight.StartupError(str(exc)) from None
    finally:
        db.close()
    return 0


def _absolute(raw: str) -> str:
    """On the command line a relative path means from here (`flashcode projects add .`)."""
    text = str(raw).strip()
    return os.path.abspath(os.path.expanduser(text)) if text and "\x00" not in text else text


CONVERSATION_PROJECT = (
    "the project this conversation belongs to, and the directory it runs in (added to `flashcode projects` if "
    "new); the model is not shown its files: `flashcode agent` works on a project"
)


def add_project_arg(p: argparse.ArgumentParser, help: str = CONVERSATION_PROJECT) -> None:
    p.add_argument("--project", default=None, metavar="DIR", help=help)


def project_dir(args: argparse.Namespace) -> Path | None:
    """The checked `--project` directory (None when not given), or a StartupError saying why not."""
    raw = getattr(args, "project", None)
    if raw is None:
        return None
    try:
        path = check_directory(_absolute(raw))
        try:
            check_apart_from_data(path, preflight.data_dir())
            return path
        except ProjectError:
            db, store = _store()  # listed before the data directory rule: it stays usable
            try:
                if store.by_path(path) is not None or path == store.scratch_dir():
                    return path
            finally:
                db.close()
            raise
    except ProjectError as exc:
        raise preflight.StartupError(f"--project: {exc}") from None


def enter_project(args: argparse.Namespace) -> Path | None:
    """For commands that work in a project (ask, chat, agent): check `--project`, add it to the
    registry and make it the working directory."""
    folder = project_dir(args)
    if folder is None:
        return None
    db, store = _store()
    try:
        store.open(store.add(folder).id)
    finally:
        db.close()
    os.chdir(folder)
    return folder


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "projects", help="list projects (name, path, conversations); add, move, rename or remove one"
    )
    p.add_argument("--data-dir", default=None, help=HELP["data_dir"])
    p.set_defaults(func=cmd_projects, action=None)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    a = actions.add_parser("add", help="add a directory as a project")
    a.add_argument("dir", metavar="DIR", help="the project's directory")
    a.add_argument("--name", default=None, help="its name in flashcode (default: the directory's name)")
    a.set_defaults(func=cmd_projects)
    m = actions.add_parser(
        "move",
        help="point a project at its folder's new place (moved or renamed): conversations and all stay",
    )
    m.add_argument("name", metavar="NAME", help="the project, as listed")
    m.add_argument("dir", metavar="DIR", help="where its folder is now")
    m.set_defaults(func=cmd_projects)
    n = actions.add_parser("rename", help="give a project another name (its folder is not touched)")
    n.add_argument("name", metavar="NAME", help="the project, as listed")
    n.add_argument("new_name", metavar="NEW_NAME", help="its new name")
    n.set_defaults(func=cmd_projects)
    r = actions.add_parser("remove", help="take a project off the list (its directory is never deleted)")
    r.add_argument("name", metavar="NAME", help="the project, as listed")
    r.add_argument(
        "--delete-data",
        action="store_true",
        help="also delete flashcode's data for it, for good (conversations, the Trash's too, rules, stats, saved contexts, the earlier text of files the agent changed)",
    )
    r.set_defaults(func=cmd_projects)
