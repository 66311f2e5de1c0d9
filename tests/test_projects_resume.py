"""Auto-resume with the real default model, on both backends: a conversation's KV cache saved
automatically (as the engine holds it: float32 on MLX's CPU, llama-server's slot as is) and resumed when the conversation comes back
gives the same next greedy tokens as re-reading (prefilling) the conversation, with most of the
prompt served from the cache; a conversation changed since its save is ignored with a note."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from engine.base import Done, GenerationRequest, SamplingParams
from engine.worker import Worker
from webapp.db import Database
from webapp.projects.resume import AutoResume

pytestmark = [pytest.mark.slow]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
SYSTEM = "You are a terse assistant. " + "Answer in one short sentence. " * 25


def _generate(backend, messages) -> Done:
    done = None
    request = GenerationRequest(messages=tuple(messages), sampling=GREEDY)
    for ev in backend.stream(request, threading.Event()):
        if isinstance(ev, Done):
            done = ev
    assert done is not None and done.error is None, done
    return done


def _restart(backend) -> None:
    """The engine as at a fresh start: no live cache (llama-server: a new process, whose slot and
    prompt cache are empty; MLX: its one prompt cache dropped)."""
    if hasattr(backend, "close_process"):
        backend.close_process()
        backend.ensure_running()
    else:
        backend.prompt_cache.reset()


async def _turn(resume: AutoResume, db: Database, worker: Worker, cid: str, text: str) -> Done:
    """One chat turn as the web app runs it: before_reply, generate, store, the reply hook."""
    note = await resume.before_reply(cid)
    assert note is None, note
    db.add_message(cid, "user", text)
    history = resume._history(cid)
    done = await worker.acall(lambda b: _generate(b, history))
    reply = db.add_message(cid, "assistant", done.text)
    resume.note_reply({}, conversation_id=cid, message_id=reply.id)
    return done


def _saves_of(resume: AutoResume, cid: str) -> list[Path]:
    return [p for p in resume.store.root.glob("*/autosave/*/conversation.json") if cid in p.read_text()]


def _scenario(tmp_path: Path, worker: Worker) -> list[str]:
    """The scenario; the saves' meta.json as they were before the deletes at its end."""
    db = Database(tmp_path / "f.db")
    resume = AutoResume(tmp_path, worker, db, idle_s=3600)
    events: list[tuple[str, str]] = []
    metas: list[str] = []
    resume.on_event = lambda kind, cid: events.append((kind, cid))

    async def run() -> None:
        a = db.create_conversation("a").id
        other = db.create_conversation("other").id
        db.add_message(a, "system", SYSTEM)
        await _turn(resume, db, worker, a, "What is 2+2?")
        # switching to another conversation saves a's cache first (a is still live)
        await _turn(resume, db, worker, other, "Name a colour.")
        await resume.flush()  # MLX: a's save is written behind other's reply
        assert ("saved", a) in events
        # cold: a fresh engine (flashcode restarted) re-reads a from the start
        await worker.acall(_restart)
        resume.live = None
        cold_db_len = len(db.messages(a))
        db.add_message(a, "user", "And 3+3?")
        history = resume._history(a)
        cold = await worker.acall(lambda b: _generate(b, history))
        for m in db.messages(a)[cold_db_len:]:
            db.delete_message(m.id)  # back to where a was saved
        await worker.acall(_restart)
        resume.live = None
        # resumed: after a restart, reopening a loads its saved cache, then the same next turn
        resumed = await _turn(resume, db, worker, a, "And 3+3?")
        assert ("resumed", a) in events
        assert resumed.text == cold.text and resumed.text
        assert resumed.stats.cached_tokens > cold.stats.cached_tokens + 100
        # a conversation changed since its save: the save is ignored with a note
        await _turn(resume, db, worker, other, "One more colour.")
        last = db.messages(a)[-1]
        db.delete_message(last.id)
        db.delete_message(db.messages(a)[-1].id)
        db.add_message(a, "user", "Edited question?")
        db.add_message(a, "assistant", "Edited answer.")
        note = await resume.before_reply(a)
        await resume.flush()
        assert note is not None and "no longer matches" in note and ("mismatch", a) in events
        # a conversation deleted for good takes its saved cache (its tokens) along; one in the Trash keeps it
        assert ("saved", other) in events  # saved when a came back
        metas.extend(p.read_text() for p in resume.store.root.glob("*/autosave/*/meta.json"))
        db.trash_conversation(other)
        assert await resume.forget_deleted() == 0 and _saves_of(resume, other)
        db.delete_conversation(other)
        assert await resume.forget_deleted() == 1 and not _saves_of(resume, other)

    asyncio.run(run())
    db.close()
    return metas


def _mlx_worker(model) -> Worker:
    """A worker owning the default model on MLX, as the app's."""
    from engine.mlx_backend import MLXBackend

    def make() -> MLXBackend:
        b = MLXBackend()
        b.load(model)
        return b

    return Worker(make)


def _wired(tmp_path: Path, worker: Worker) -> tuple[Database, AutoResume]:
    """A database and the AutoResume the app makes, told of every generation queued, as the app wires it."""
    db = Database(tmp_path / "f.db")
    resume = AutoResume(tmp_path, worker, db, idle_s=3600)
    worker.on_submit.append(lambda _request: resume.generating())
    return db, resume


def test_projects_autoresume_mlx_same_greedy_tokens_as_reprefill(tmp_path: Path, default_model) -> None:
    worker = _mlx_worker(default_model)
    try:
        metas = _scenario(tmp_path, worker)
    finally:
        worker.close()
    import mlx.core as mx

    held = 32 if mx.default_device() == mx.cpu else 16  # as held: float32 on a CPU, float16 on a GPU
    assert metas and all(f'"kv_bits": {held}' in m for m in metas)


def test_projects_a_switch_writes_the_previous_save_behind_the_next_reply(
    tmp_path: Path, default_model
) -> None:
    """Switching conversation saved the previous one's cache before the new reply could start (20-35 ms of
    every switch's first token, bench/websocket.py). MLX: the reply waits only for a copy of the cache; the
    file is written behind the reply, and holds the previous conversation's tokens, not the new reply's."""
    worker = _mlx_worker(default_model)
    db, resume = _wired(tmp_path, worker)
    order: list[tuple[str, str]] = []
    resume.on_event = lambda kind, cid: order.append((kind, cid))

    async def run() -> None:
        a, b = db.create_conversation("a").id, db.create_conversation("b").id
        await _turn(resume, db, worker, a, "What is 2+2?")
        held = await worker.acall(lambda be: list(be.prompt_cache.tokens))
        assert await resume.before_reply(b) is None
        assert a in resume._writing and not _saves_of(resume, a)  # not written yet: b's reply goes first
        db.add_message(b, "user", "Name a colour.")
        request = GenerationRequest(messages=tuple(resume._history(b)), sampling=GREEDY)
        async for event in worker.submit(request, loop=asyncio.get_running_loop()):
            if isinstance(event, Done):
                order.append(("replied", b))
        await resume.flush()
        assert order.index(("replied", b)) < order.index(("saved", a)) and not resume._writing
        (meta,) = [json.loads(p.with_name("tokens.json").read_text()) for p in _saves_of(resume, a)]
        assert meta["tokens"] == held  # a's cache as it was, though b's reply reused and overwrote it since

    try:
        asyncio.run(run())
    finally:
        worker.close()
        db.close()


def test_projects_a_conversation_just_opened_is_made_live_from_its_save_to_be_saved_by_name(
    tmp_path: Path, default_model
) -> None:
    """(walkthrough) Saved Contexts' Save for a conversation just opened said "the engine's live context is not
    this conversation's: send a message first", though it had an automatic save. `make_live` loads that save (as
    its next reply would), and the named save holds the conversation's tokens, not the other one's."""
    from engine.sessions import ContextStore

    worker = _mlx_worker(default_model)
    db, resume = _wired(tmp_path, worker)

    async def run() -> None:
        a, b = db.create_conversation("a").id, db.create_conversation("b").id
        db.add_message(a, "system", SYSTEM)
        await _turn(resume, db, worker, a, "What is 2+2?")
        held = await worker.acall(lambda be: list(be.prompt_cache.tokens))
        await _turn(resume, db, worker, b, "Name a colour.")  # a is saved behind b's reply
        await resume.flush()
        assert resume.live == b
        assert await resume.make_live(a) is None and resume.live == a
        assert await worker.acall(lambda be: list(be.prompt_cache.tokens)) == held
        await resume.flush()  # b's own save, written behind
        ctx = await worker.acall(
            lambda be: ContextStore(tmp_path).save(be, "default", "a by name", conversation_id=a)
        )
        assert ctx.token_count == len(held) and ctx.conversation_id == a

    try:
        asyncio.run(run())
    finally:
        worker.close()
        db.close()


@pytest.mark.llama
def test_projects_autoresume_llama_same_greedy_tokens_as_reprefill(
    tmp_path: Path, model_home: Path, default_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    llama_server = pytest.importorskip("engine.llama_server")
    try:
        llama_server.find_llama_server()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no llama-server: {exc}")
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(model_home / "models", target_is_directory=True)
    monkeypatch.setenv("FLASHCODE_HOME", str(home))

    def make():
        b = llama_server.LlamaServerBackend(context_length=2048, threads=1)
        b.load(default_model)
        return b

    worker = Worker(make)
    try:
        _scenario(home, worker)
        _slot_folder_removed(home, worker)
    finally:
        worker.close()


def _slot_folder_removed(home: Path, worker: Worker) -> None:
    """The llama-slots folder removed while the server runs (the data directory's README says flashcode
    rebuilds it): a conversation coming back is resumed all the same, and a save that cannot be written
    costs a note, never the reply (it was "the reply failed: FileNotFoundError")."""
    import shutil

    db = Database(home / "g.db")
    resume = AutoResume(home, worker, db, idle_s=3600)

    async def run() -> None:
        a, b = db.create_conversation("a").id, db.create_conversation("b").id
        await _turn(resume, db, worker, a, "What is 2+2?")
        await _turn(resume, db, worker, b, "Name a colour.")  # a saved
        slots = await worker.acall(lambda be: be.slot_save_path)
        shutil.rmtree(slots)
        done = await _turn(resume, db, worker, a, "And 3+3?")
        assert done.text and Path(slots).is_dir()

        async def broken() -> None:
            raise OSError(28, "No space left on device")

        resume._save_live = broken  # type: ignore[method-assign]
        note = await resume.before_reply(b)  # a's save fails; b's own cache still resumes
        assert note == "The cache of the conversation before could not be saved (No space left on device)."

    asyncio.run(run())
    db.close()


def test_projects_a_cache_the_copy_would_share_is_saved_before_the_reply(tmp_path: Path) -> None:
    """A copy of the cache is written behind the next reply only when every layer was copied: a sliding-window
    layer (`RotatingKVCache`) is kept as the live object, which the next reply trims and overwrites, so the save
    written after it would hold that reply's KV under the conversation before. Such a cache is saved first."""
    from types import SimpleNamespace

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from engine.mlx_backend import MLXBackend

    kv, rot = KVCache(), RotatingKVCache(max_size=16)
    for layer in (kv, rot):
        layer.update_and_fetch(mx.zeros((1, 2, 3, 8)), mx.zeros((1, 2, 3, 8)))
    backend = MLXBackend()
    backend.model_obj, backend._model_info = object(), SimpleNamespace(name="m")
    resume = AutoResume(tmp_path, Worker(lambda: backend), Database(tmp_path / "f.db"))
    try:
        for cache, detached in (([kv, kv], True), ([kv, rot], False)):
            backend.prompt_cache.cache, backend.prompt_cache.tokens = cache, [1, 2, 3]
            snapshot = backend.snapshot_prompt_cache()
            assert snapshot.detached is detached and snapshot.tokens == [1, 2, 3]
            assert (resume._snapshot(backend) is not None) is detached  # not detached: saved before the reply
    finally:
        resume.worker.close()
        resume.db.close()
