"""Undoing a write of the agent's file tools, for the page's Undo and `flashcode changes undo`.

What it knows: that a write's earlier text is kept (`AgentStore.record_file_change`), and how to put it back
through the file tools (`ProjectFiles.undo`: only while the file still holds what the write left). What it does
not know: the page, the command line, how a project is looked up.
"""

from __future__ import annotations

from pathlib import Path

from ..db import Database
from .events import FileUndone
from .files import FileToolError, ProjectFiles
from .store import AgentStore, FileChangeRecord


def undo_write(change: FileChangeRecord, project_dir: Path, hidden: tuple[Path, ...]) -> str:
    """Put back what `change` replaced (remove the file it made); what was done, in words. Raises
    `FileToolError` (nothing written) when the file changed since, is gone, or is out of bounds. Blocking file
    work with no database: the caller records it (`record_undo`) on the thread that owns that."""
    done = ProjectFiles(project_dir, hidden).undo(
        change.path, change.before, change.after_sha256, change.made_dirs
    )
    if done == "gone":
        return f"Undid the write of {change.path}: that write had made it, and it was removed since."
    if done == "removed":
        return f"Undid the write of {change.path}: removed it (that write had made it)."
    return f"Undid the write of {change.path}: it holds its earlier text again."


def record_undo(store: AgentStore, db: Database, change: FileChangeRecord, text: str) -> FileUndone:
    """After `undo_write` (`text`: what it said): the write is marked undone and, where its conversation is kept
    (the Trash's too), the undo is logged there, for the transcript and the model's next request."""
    store.mark_undone(change.action_id)
    said = FileUndone(change.action_id, change.path, text)
    conv = db.get_conversation(change.conversation_id, trashed=True) if change.conversation_id else None
    if conv is not None:
        db.add_event(conv.id, said.type, said.to_dict())
    return said


def state(change: FileChangeRecord, refusal: str | None = None) -> str:
    """A change as the lists say it: undone, what an undo would do, or (`refusal`: why an undo would be refused
    now, from `ProjectFiles.undo_refusal`) that it can no longer be undone."""
    if change.undone_at:
        return "undone"
    did = "made the file" if change.before is None else "changed it"
    if refusal is not None:
        kept = (
            f"; its earlier text: flashcode changes show {change.action_id}"
            if change.before is not None
            else ""
        )
        return f"{did}; {refusal}, so it cannot be undone{kept}"
    return f"{did} (undo removes it)" if change.before is None else f"{did} (undo puts it back)"


def undo_refusal(change: FileChangeRecord, project_dir: Path | None, hidden: tuple[Path, ...]) -> str | None:
    """Why undoing `change` would be refused now (None: it would go ahead, or was undone already)."""
    if change.undone_at:
        return None
    if project_dir is None:
        return "its project was removed from flashcode"
    try:
        files = ProjectFiles(project_dir, hidden)
    except FileToolError as exc:
        return str(exc)
    return files.undo_refusal(change.path, change.before, change.after_sha256)
