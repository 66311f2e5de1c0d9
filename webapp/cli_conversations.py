"""`flashcode conversations [--project NAME | --all | --trash] [--find TEXT]`, `... export ID [--format md|json] [-o FILE]`,
`... import FILE [--project NAME]`: the web app's conversations from a terminal (a backup, a script, another
machine's export), on the same database — `flashcode serve` may be running.

Output of the list: one line per conversation, tab-separated: id, updated (local time), messages, project,
title. Import makes a NEW conversation and never replaces one (`webapp.db.import_json`: the file is
untrusted). What it knows: the command line's forms and messages. The store is `webapp.db`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from engine import paths

from . import preflight
from .agent.views import importable
from .db import (
    FIND_WORDS,
    MAX_IMPORT_BYTES,
    Conversation,
    ConversationImportError,
    Database,
    export_json,
    export_markdown,
    find_words,
    import_json,
    parse_import,
)
from .projects.store import ProjectStore
from .render import visible_line
from .units import HELP


def _open() -> tuple[Database, ProjectStore]:
    root = preflight.check_data_dir(preflight.data_dir())
    preflight.check_database(root)
    db = Database(root / "flashcode.db", recover=False)  # `flashcode serve` may be writing a reply
    return db, ProjectStore(db.conn, root)


def _project_id(store: ProjectStore, name: str | None) -> str:
    """The project `name` names (its name, folder or id), or the open one (None)."""
    if name is None:
        return store.current().id
    found = store.resolve(name)
    if found is None:
        names = ", ".join(p.name for p in store.all())
        raise preflight.StartupError(f"there is no project named {name!r} (projects: {names})")
    return found.id


def _conversation(db: Database, wanted: str) -> Conversation:
    """A conversation by its id (or a unique start of it, as `flashcode conversations` lists them)."""
    wanted = wanted.strip().removeprefix("/c/")
    every = db.list_conversations() + db.trashed_conversations()
    found = [c for c in every if c.id == wanted] or [c for c in every if wanted and c.id.startswith(wanted)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise preflight.StartupError(
            f"there is no conversation {wanted!r}: `flashcode conversations --all` lists them with their ids"
        )
    raise preflight.StartupError(f"{wanted!r} starts {len(found)} conversation ids: give more of it")


def cmd_conversations(args: argparse.Namespace) -> int:
    db, store = _open()
    try:
        action = getattr(args, "action", None)
        if action == "export":
            return _export(db, args)
        if action == "import":
            return _import(db, store, args)
        chosen = [
            o for o, on in (("--project", args.project), ("--all", args.all), ("--trash", args.trash)) if on
        ]
        if len(chosen) > 1:  # one before `list` and one after it: argparse sees two groups
            raise preflight.StartupError(
                f"{' and '.join(chosen)} cannot go together: give one of --project, --all, --trash"
            )
        find = " ".join((getattr(args, "find", None) or "").split())[:MAX_FIND_CHARS]
        if find and args.trash:
            raise preflight.StartupError(
                "--find looks in the listed conversations, not the Trash: drop --trash"
            )
        if find and find_words(find)[1]:  # said, not dropped silently
            print(f"--find looks for the first {FIND_WORDS} words only", file=sys.stderr)
        pid = None if args.all or args.trash else _project_id(store, args.project)  # None: every project's
        if args.trash:
            shown = db.trashed_conversations()
        elif find:
            shown = [f.conversation for f in db.find_conversations(find, pid, excerpts=False)]
        else:
            shown = db.list_conversations(pid)
        names = {p.id: p.name for p in store.all()}
        counts = dict(
            db.conn.execute(
                "SELECT conversation_id, COUNT(*) FROM messages GROUP BY conversation_id"
            ).fetchall()
        )
        for c in shown:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated_at))
            # a title (an imported one is untrusted text) could hold a terminal's escape sequences: shown as markers
            title = visible_line(" ".join(c.title.split()))
            project = visible_line(names.get(c.project_id, c.project_id))
            print(f"{c.id}\t{when}\t{counts.get(c.id, 0)}\t{project}\t{title}")
        # said on stderr, for the person reading: stdout stays empty for a script that parses it
        if not shown:
            here = "in any project" if pid is None else f"in project {visible_line(names.get(pid, pid))}"
            if args.trash:
                print("the Trash is empty", file=sys.stderr)
            elif find:
                print(
                    f"no conversation {here} holds {'every word of ' if ' ' in find else ''}{find!r}"
                    + ("" if args.all else " (--all looks in every project's)"),
                    file=sys.stderr,
                )
            else:
                print(
                    f"no conversations {here}"
                    + ("" if args.all else " (--all lists every project's, --project NAME another's)")
                    + "; the Trash: --trash",
                    file=sys.stderr,
                )
    finally:
        db.close()
    return 0


def _same_folder(a: Path, b: Path) -> bool:
    """Whether two paths are one folder (by inode: a case-insensitive disk spells it more than one way)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _export(db: Database, args: argparse.Namespace) -> int:
    conv = _conversation(db, args.id)
    messages, events = db.messages(conv.id), db.events(conv.id)
    if args.format == "md":
        text = export_markdown(conv, messages, events)
    else:
        text = json.dumps(export_json(conv, messages, events), indent=2, ensure_ascii=False)
    if args.output in (None, "-"):
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return 0
    out = Path(args.output).expanduser()
    if out.is_dir():
        raise preflight.StartupError(f"-o {args.output}: that is a directory; give a file name")
    root = db.path.parent.resolve()
    if any(_same_folder(d, root) for d in out.resolve().parents):  # --force over flashcode.db replaced it all
        raise preflight.StartupError(
            f"-o {args.output}: that is inside flashcode's data directory ({root}), where its database, models "
            "and saved contexts live; write the export somewhere else"
        )
    if out.exists() and not args.force:
        raise preflight.StartupError(f"-o {args.output}: the file exists; --force replaces it")
    try:  # whole or not at all: a full disk leaves the file --force would replace as it was
        paths.write_text_atomic(out, text)
    except OSError as exc:
        raise preflight.StartupError(
            f"-o {args.output}: could not write it ({exc.strerror or exc})"
        ) from None
    print(f"wrote {conv.title!r} ({len(messages)} messages) to {out}", file=sys.stderr)
    return 0


def _import(db: Database, store: ProjectStore, args: argparse.Namespace) -> int:
    path = Path(args.file).expanduser()
    try:
        if path.is_dir():
            raise preflight.StartupError(f"{args.file} is a directory: give a conversation's JSON file")
        with path.open("rb") as f:  # a pipe or a device says size 0: read no more than the limit
            body = f.read(MAX_IMPORT_BYTES + 1)
        if len(body) > MAX_IMPORT_BYTES:
            raise preflight.StartupError(
                f"could not import {args.file}: it is over {MAX_IMPORT_BYTES >> 20} MB (a conversation export is smaller)"
            )
    except OSError as exc:
        raise preflight.StartupError(f"could not read {args.file}: {exc.strerror or exc}") from None
    project = _project_id(store, args.project)
    try:
        done = import_json(db, parse_import(body), project, importable)
    except ConversationImportError as exc:
        raise preflight.StartupError(f"could not import {args.file}: {exc}") from None
    left_out = f"; left out: {'; '.join(done.skipped)}" if done.skipped else ""
    print(done.conversation.id)
    print(
        f"imported {done.conversation.title!r} as a new conversation ({done.messages} "
        f"message{'' if done.messages == 1 else 's'}, {done.events} transcript event{'' if done.events == 1 else 's'}"
        f"{left_out}); the web app shows it at /c/{done.conversation.id}",
        file=sys.stderr,
    )
    return 0


MAX_FIND_CHARS = 200  # as the web app's Find (a much longer LIKE pattern is "too complex" for SQLite)
FIND_HELP = "only those holding every word of TEXT, each in the title or any message (case-insensitive for ASCII letters)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "conversations",
        help="list the web app's conversations; export one (Markdown or JSON) or import a JSON export",
        description="Lines: id, updated, messages, project, title (tab-separated). Without an option: the "
        "open project's (the one the web app shows).",
    )
    p.add_argument("--data-dir", default=None, help=HELP["data_dir"])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--project", default=None, metavar="NAME", help="that project's (name, folder or id)")
    which.add_argument("--all", action="store_true", help="every project's")
    which.add_argument("--trash", action="store_true", help="those in the Trash")
    p.add_argument("--find", default=None, metavar="TEXT", help=FIND_HELP)
    p.set_defaults(func=cmd_conversations, action=None)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    listing = actions.add_parser("list", help="list them (as with no ACTION)")
    shown = listing.add_mutually_exclusive_group()  # SUPPRESS: `conversations --all list` keeps --all
    shown.add_argument("--project", default=argparse.SUPPRESS, metavar="NAME", help="that project's")
    shown.add_argument("--all", action="store_true", default=argparse.SUPPRESS, help="every project's")
    shown.add_argument("--trash", action="store_true", default=argparse.SUPPRESS, help="those in the Trash")
    listing.add_argument("--find", default=argparse.SUPPRESS, metavar="TEXT", help=FIND_HELP)
    listing.set_defaults(func=cmd_conversations)
    e = actions.add_parser("export", help="write one conversation as JSON (import reads it back) or Markdown")
    e.add_argument("id", metavar="ID", help="its id (or a unique start of it), as listed")
    e.add_argument(
        "--format", choices=("json", "md"), default="json", help="json (default; import reads it) or md"
    )
    e.add_argument("-o", "--output", default=None, metavar="FILE", help="a file (default: standard output)")
    e.add_argument("--force", action="store_true", help="replace FILE if it exists")
    e.set_defaults(func=cmd_conversations)
    i = actions.add_parser(
        "import", help="add a conversation from a JSON export as a new one (nothing stored is replaced)"
    )
    i.add_argument("file", metavar="FILE", help="a JSON export")
    i.add_argument(
        # SUPPRESS: `conversations --project X import FILE` keeps X (a default here would overwrite it)
        "--project",
        default=argparse.SUPPRESS,
        metavar="NAME",
        help="into that project (default: the open one)",
    )
    i.set_defaults(func=cmd_conversations)
    for action in (listing, e, i):  # `conversations import --data-dir D FILE` as well as before the action
        action.add_argument("--data-dir", default=argparse.SUPPRESS, help=HELP["data_dir"])
