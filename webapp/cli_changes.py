"""`flashcode changes [--project NAME|DIR]`, `flashcode changes undo ID` and `flashcode changes show ID`: the
writes of the agent's file tools, newest first; undoing one (its earlier text put back, or the file it made
removed), as the page's Undo does; and the text one replaced.

Output of `flashcode changes`: one line per write, tab-separated: id, when, project (a removed one's as
"(removed) ID", which `--project` takes), path, and what it did and what an undo would do, why it would be
refused now (the file changed since, its project removed), or "undone". What it knows: the command line's forms and messages. Undo itself is `webapp.agent.undo`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys

from .agent.files import FileToolError
from .agent.store import AgentStore
from .agent.undo import record_undo, state, undo_refusal, undo_write
from .agent.web import hidden_paths
from .cli_projects import _absolute, _named, _store
from .projects.store import ProjectError
from .render import visible_text
from .units import HELP


def cmd_changes(args: argparse.Namespace) -> int:
    db, projects = _store()
    try:
        store = AgentStore(db.conn)
        if getattr(args, "action", None) in ("undo", "show"):
            change = store.file_change(args.id)
            if change is None:
                print(
                    f"flashcode changes: no file change {args.id} (`flashcode changes` lists them)",
                    file=sys.stderr,
                )
                return 2
            if args.action == "show":  # the earlier text, as it was (a file to redirect it to)
                if change.before is None:
                    print(visible_text(f"flashcode changes: write {args.id} made {change.path}: it had no earlier text"),
                          file=sys.stderr)  # fmt: skip
                    return 1
                sys.stdout.write(change.before)
                return 0
            if change.undone_at:
                print(visible_text(f"change {change.action_id} ({change.path}) was undone already"))
                return 0
            project = projects.get(change.project)
            if project is None:
                print(
                    "flashcode changes: its project was removed from flashcode: nothing was put back. Add its "
                    "folder again (flashcode projects add DIR: its writes come back with it), then undo",
                    file=sys.stderr,
                )
                return 1
            try:
                said = undo_write(change, project.path, hidden_paths(projects.data_dir))
            except FileToolError as exc:
                kept = (
                    f"; its earlier text: flashcode changes show {args.id} > FILE"
                    if change.before is not None
                    else ""
                )
                print(visible_text(f"flashcode changes: not undone: {exc}{kept}"), file=sys.stderr)
                return 1
            record_undo(
                store, db, change, said
            )  # as the card's Undo: logged for the transcript and the model
            print(visible_text(f"{said} (write {change.action_id}, project {project.name})"))
            return 0
        known = {p.id: p for p in projects.all()}
        if args.project is not None:
            # a name, or a folder (`.` too), or a removed project's id as listed; an unknown one is refused
            # with the names there are
            found = projects.resolve(_absolute(args.project)) or projects.resolve(args.project)
            if found is None and store.file_changes(args.project, limit=1):
                wanted = args.project  # a removed project's writes, listed under its id (names come first)
            else:
                wanted = (found or _named(projects, args.project)).id
            changes = store.file_changes(wanted, limit=args.limit)
        else:  # a removed project's too, while its data is kept: Add its folder again to undo them
            changes = store.file_changes(None, limit=args.limit)
        if not changes:
            print(
                "no file was written by the agent's file tools"
                + (" in that project" if args.project else ""),
                file=sys.stderr,
            )
        hidden = hidden_paths(projects.data_dir)
        if changes and sys.stdout.isatty():  # for a reader; a script reading the lines gets them alone
            print("ID\tWHEN\tPROJECT\tPATH\tWHAT IT DID, AND WHAT AN UNDO WOULD DO")
        for c in changes:
            when = dt.datetime.fromtimestamp(c.created_at).strftime("%Y-%m-%d %H:%M")
            project = known.get(c.project)
            said = state(c, undo_refusal(c, project.path if project else None, hidden))
            name = project.name if project else f"(removed) {c.project}"  # its id: `--project` takes it
            print(visible_text(f"{c.action_id}\t{when}\t{name}\t{c.path}\t{said}"))
    except ProjectError as exc:
        print(f"flashcode changes: {exc}", file=sys.stderr)
        return 2
    finally:
        db.close()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "changes",
        help="list the agent's file writes (id, when, project, path), newest first; undo one",
    )
    p.add_argument(
        "--project", default=None, metavar="NAME|DIR", help="only this project's (default: every project's)"
    )
    p.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    p.add_argument("--data-dir", default=None, help=HELP["data_dir"])
    p.set_defaults(func=cmd_changes, action=None)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    u = actions.add_parser(
        "undo",
        help="put back what write ID replaced (a file it made is removed), while the file still holds what it wrote",
    )
    u.add_argument("id", metavar="ID", type=int, help="the write, as listed")
    s = actions.add_parser("show", help="print the text write ID replaced (redirect it to a file to keep it)")
    s.add_argument("id", metavar="ID", type=int, help="the write, as listed")
    for a in (u, s):  # after the action too (`flashcode changes undo 3 --data-dir DIR`)
        a.add_argument("--data-dir", default=argparse.SUPPRESS, help=HELP["data_dir"])
        a.set_defaults(func=cmd_changes)
