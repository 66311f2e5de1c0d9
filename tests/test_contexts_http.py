"""The saved-context HTTP handlers (webapp/contexts/http.py) in-process: a tiny app built inline with a
fake backend that writes a stand-in cache file, driven by TestClient. The real cache files and the
real model are covered by tests/test_sessions.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import unquote

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.testclient import TestClient

from engine.sessions import QuotaExceededError
from engine.worker import Worker
from webapp.contexts.http import SavedContexts
from webapp.db import Database
from webapp.render import make_environment
from webapp.security import CsrfMiddleware
from webapp.settings import Settings

BASE = "http://127.0.0.1:8000"
TOKEN = {"x-csrf-token": "t0ken"}


class FakeCacheBackend:
    """Enough of an MLX backend for the store: a live token list and a cache file it writes."""

    name = "mlx"

    def __init__(self, model) -> None:
        self.model = model
        self.context_length = 2048
        self.prompt_cache = SimpleNamespace(tokens=[], cache=None)
        self.loaded: list[int] | None = None
        self.owner: str | None = None  # the conversation whose reply the live cache holds

    def took_over(self, conversation_id: str | None) -> None:
        self.owner = conversation_id

    def close(self) -> None:
        pass

    def apply_chat_template(self, messages) -> list[int]:
        return [len(m["content"]) for m in messages]

    def run(self, messages) -> None:
        self.prompt_cache.tokens = [*self.apply_chat_template(messages), 7]
        self.owner = None

    def save_prompt_cache(
        self, path: Path, metadata: dict[str, str], kv_bits: int | None = None
    ) -> dict[str, Any]:
        if not self.prompt_cache.tokens:
            from engine.base import EngineError

            raise EngineError("there is no context to save yet: send a message first")
        Path(path).write_bytes(b"k" * getattr(self, "size", 2000))
        return {"tokens": list(self.prompt_cache.tokens), "metadata": {"kv_bits": str(kv_bits or 32)}}

    def load_prompt_cache(self, path: Path, tokens: list[int] | None = None) -> dict[str, Any]:
        self.loaded = list(tokens or [])
        return {"tokens": len(self.loaded)}


def context_app(data_dir: Path, worker: Worker, db: Database) -> Starlette:
    """The saved-context routes alone, behind the app's CSRF rule (token `TOKEN`)."""
    settings = Settings(data_dir=data_dir, load_model=False)
    csrf = Middleware(CsrfMiddleware, token=TOKEN["x-csrf-token"], allowed_origins=settings.allowed_origins)
    fake = worker.call(lambda b: b)
    contexts = SavedContexts(
        data_dir, worker, db, make_environment(), live=lambda: fake.owner, after_resume=fake.took_over
    )
    return Starlette(routes=contexts.routes, middleware=[csrf])


@pytest.fixture
def client(tmp_path: Path, default_model) -> Iterator[tuple[TestClient, FakeCacheBackend, Any]]:
    fake = FakeCacheBackend(default_model)
    worker = Worker(lambda: fake)
    db = Database(tmp_path / "flashcode.db")
    with TestClient(context_app(tmp_path, worker, db), base_url=BASE) as c:
        yield c, fake, db
    worker.close()
    db.close()


def conversation(db, fake, *texts: str) -> str:
    conv = db.create_conversation("t")
    for i, text in enumerate(texts):
        db.add_message(conv.id, "user" if i % 2 == 0 else "assistant", text)
    fake.run([{"role": "user", "content": texts[0]}])
    fake.owner = conv.id  # as the app's AutoResume notes a chat reply
    return conv.id


def test_contexts_http_save_list_rename_resume_delete(client):
    c, fake, db = client
    conv = conversation(db, fake, "hello there", "hi")
    r = c.post(
        "/projects/default/contexts",
        json={"name": "greeting", "conversation_id": conv, "kv_bits": "8"},
        headers=TOKEN,
    )
    assert r.status_code == 201, r.text
    ctx = r.json()
    assert (ctx["name"], ctx["kv_bits"], ctx["conversation_id"], ctx["token_count"]) == (
        "greeting",
        8,
        conv,
        2,
    )
    listed = c.get("/projects/default/contexts").json()
    assert [x["id"] for x in listed["contexts"]] == [ctx["id"]] and listed["usage_bytes"] > 0
    r = c.post(f"/projects/default/contexts/{ctx['id']}/rename", json={"name": "renamed"}, headers=TOKEN)
    assert r.json()["name"] == "renamed"
    r = c.post(f"/projects/default/contexts/{ctx['id']}/resume", headers=TOKEN)
    assert r.json()["resumed"] and r.json()["conversation_id"] == conv and fake.loaded == [11, 7]
    r = c.post(f"/projects/default/contexts/{ctx['id']}/delete", headers=TOKEN)
    assert r.status_code == 204 and c.get("/projects/default/contexts").json()["contexts"] == []


def test_contexts_http_export_import(client, tmp_path):
    c, fake, db = client
    conversation(db, fake, "hello there")
    ctx = c.post("/projects/default/contexts", json={"name": "to move"}, headers=TOKEN).json()
    r = c.get(f"/projects/default/contexts/{ctx['id']}/export")
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
    assert "to-move" in r.headers["content-disposition"]
    r = c.post(
        "/projects/other/contexts/import",
        files={"file": ("x.flashctx", r.content)},
        data={"name": "moved"},
        headers=TOKEN,
    )
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "moved" and r.json()["project_id"] == "other"
    # the same export imported again, and again, under its own name: rows told apart (walkthrough)
    export = c.get(f"/projects/default/contexts/{ctx['id']}/export").content
    names = [
        c.post(
            "/projects/default/contexts/import", files={"file": ("x.flashctx", export)}, headers=TOKEN
        ).json()["name"]
        for _ in range(2)
    ]
    assert names == ["to move (imported)", "to move (imported 2)"]
    r = c.post(
        "/projects/other/contexts/import", files={"file": ("my <session>.flashctx", b"junk")}, headers=TOKEN
    )
    assert r.status_code == 400 and "not a flashcode context" in r.json()["error"]
    assert r.json()["error"].startswith("my _session_.flashctx is not")  # the user's file, not ours


def test_contexts_http_errors_are_clear(client):
    c, fake, db = client
    assert c.post("/projects/default/contexts", json={"name": "x"}).status_code == 403  # no CSRF token
    r = c.post("/projects/default/contexts", json={"name": "empty"}, headers=TOKEN)
    assert r.status_code == 409 and "send a message first" in r.json()["error"]
    other = conversation(db, fake, "one conversation")
    fake.run([{"role": "user", "content": "another one entirely"}])
    r = c.post("/projects/default/contexts", json={"name": "x", "conversation_id": other}, headers=TOKEN)
    assert r.status_code == 409 and "not this conversation's" in r.json()["error"]
    db.set_mode(other, "agent")  # its advice (send a message, then save) would only run agent steps again
    r = c.post("/projects/default/contexts", json={"name": "x", "conversation_id": other}, headers=TOKEN)
    assert r.status_code == 409 and "switch the conversation to Chat mode" in r.json()["error"]
    # in the window: a sentence, and the name typed stays in its box (it was cleared: walkthrough)
    hx = {**TOKEN, "hx-request": "true"}
    r = c.post(
        "/projects/default/contexts", data={"name": "my <b>plan</b>", "conversation_id": other}, headers=hx
    )
    assert '<p class="contexts-error" role="alert">An agent conversation&#39;s context is not kept' in r.text
    assert "then save.</p>" in r.text and 'value="my &lt;b&gt;plan&lt;/b&gt;"' in r.text
    assert c.get("/projects/..%2Fx/contexts").status_code in (400, 404)
    r = c.post("/projects/default/contexts/20261122-113000-a1b2c3/resume", headers=TOKEN)
    assert r.json()["resumed"] is False and "re-reads it from the start" in r.json()["message"]
    assert (
        c.post("/projects/default/contexts/nope/rename", json={"name": "y"}, headers=TOKEN).status_code == 400
    )


def test_contexts_http_save_makes_a_conversation_just_opened_live_first(
    tmp_path: Path, default_model
) -> None:
    """Save for a conversation whose reply the engine's cache does not hold asks the app to load its automatic
    save first (`make_live`, as its next reply would); with none to load, it says so."""
    fake = FakeCacheBackend(default_model)
    worker = Worker(lambda: fake)
    db = Database(tmp_path / "flashcode.db")
    asked: list[str] = []
    saved_ones: set[str] = set()

    async def make_live(conversation_id: str) -> None:
        asked.append(conversation_id)
        if conversation_id in saved_ones:  # as AutoResume loads a conversation's automatic save
            fake.owner = conversation_id

    settings = Settings(data_dir=tmp_path, load_model=False)
    csrf = Middleware(CsrfMiddleware, token=TOKEN["x-csrf-token"], allowed_origins=settings.allowed_origins)
    contexts = SavedContexts(
        tmp_path, worker, db, make_environment(), live=lambda: fake.owner, make_live=make_live
    )
    app = Starlette(routes=contexts.routes, middleware=[csrf])
    with TestClient(app, base_url=BASE) as c:
        a = conversation(db, fake, "one conversation")
        saved_ones.add(a)
        conversation(db, fake, "another one entirely")  # its reply took the cache
        r = c.post("/projects/default/contexts", json={"name": "a", "conversation_id": a}, headers=TOKEN)
        assert r.status_code == 201 and asked == [a], r.text
        fresh = db.create_conversation("never saved").id
        db.add_message(fresh, "user", "hi")
        r = c.post("/projects/default/contexts", json={"name": "f", "conversation_id": fresh}, headers=TOKEN)
        assert (
            r.status_code == 409 and "no automatic save to load" in r.json()["error"] and asked == [a, fresh]
        )
    worker.close()
    db.close()


def test_contexts_http_resume_runs_on_the_worker_thread(client):
    c, fake, db = client
    conversation(db, fake, "hello")
    ctx = c.post("/projects/default/contexts", json={"name": "t"}, headers=TOKEN).json()
    seen = []
    original = fake.load_prompt_cache

    def spy(path, tokens=None):
        seen.append(threading.current_thread().name)
        return original(path, tokens)

    fake.load_prompt_cache = spy
    c.post(f"/projects/default/contexts/{ctx['id']}/resume", headers=TOKEN)
    assert seen == ["flashcode-engine"]


def test_contexts_http_pane_for_htmx(client):
    c, fake, db = client
    conv = conversation(db, fake, "<b>hello</b>")
    hx = {**TOKEN, "hx-request": "true"}
    r = c.get("/projects/default/window", headers={"hx-request": "true"})
    assert 'id="contexts-pane"' in r.text and "No saved contexts yet" in r.text
    r = c.post(
        "/projects/default/contexts",
        data={"name": "<script>x</script>", "conversation_id": conv, "kv_bits": "8"},
        headers=hx,
    )
    assert (
        r.status_code == 200
        and "Saved" in r.text
        and "<script>x" not in r.text
        and "&lt;script&gt;" in r.text
    )
    # each row says the conversation it came from (a walkthrough could not tell), its title escaped
    db.rename_conversation(conv, "<i>greeting</i>\u202e")
    pane = c.get("/projects/default/window", headers={"hx-request": "true"}).text
    assert f'from <a href="/c/{conv}">“&lt;i&gt;greeting&lt;/i&gt;<mark class="invisible-char"' in pane, pane
    cid = c.get("/projects/default/contexts").json()["contexts"][0]["id"]
    r = c.post(f"/projects/default/contexts/{cid}/resume", headers=hx)
    assert "Resumed " in r.text and f'href="/c/{conv}"' in r.text
    assert r.headers["hx-redirect"] == f"/c/{conv}"  # the page goes to the conversation now live
    assert "Your next message goes on from it" in unquote(r.headers["x-flashcode-said"])  # said on that page
    r = c.post(
        f"/projects/default/contexts/{cid}/resume", headers={**hx, "hx-current-url": f"{BASE}/c/{conv}"}
    )
    assert "Resumed " in r.text and "hx-redirect" not in r.headers  # already there
    db.trash_conversation(conv)  # resumed, the redirect went to a 404 page (red-team): not resumed now
    r = c.post(f"/projects/default/contexts/{cid}/resume", headers=hx)
    assert "hx-redirect" not in r.headers and "Its conversation is in the Trash: put it back" in r.text
    assert "Resumed " not in r.text and 'role="alert"' in r.text
    from webapp.db import export_json, import_json

    db.restore_conversation(conv)
    backup = json.loads(json.dumps(export_json(db.get_conversation(conv), db.messages(conv))))
    db.trash_conversation(conv)
    db.delete_conversation(conv)
    assert (
        "from a conversation not in this flashcode (deleted, or on another machine)"
        in c.get("/projects/default/window", headers={"hx-request": "true"}).text
    )
    r = c.post(f"/projects/default/contexts/{cid}/resume", headers=hx)
    assert "hx-redirect" not in r.headers and "Its conversation is not in this flashcode" in r.text
    said = "import the conversation&#39;s export (File › Import Conversation…) and resume this again"
    assert said in r.text
    assert f'href="/c/{conv}"' not in r.text and "Resumed " not in r.text
    r = c.post(f"/projects/default/contexts/{cid}/resume", headers=TOKEN)
    assert r.status_code == 409 and "its conversation is not in this flashcode" in r.json()["error"]
    # a backup restored (a review): the conversation's export imported (a new id), the context resumes on it
    restored = import_json(db, backup, "default").conversation.id
    assert restored != conv
    pane = c.get("/projects/default/window", headers={"hx-request": "true"}).text
    assert f'from <a href="/c/{restored}">' in pane, pane
    r = c.post(f"/projects/default/contexts/{cid}/resume", headers=hx)
    assert "Resumed " in r.text and r.headers["hx-redirect"] == f"/c/{restored}"
    assert c.get("/projects/default/contexts").json()["contexts"][0]["conversation_id"] == restored
    db.delete_conversation(restored)
    r = c.post("/projects/default/contexts", data={"name": ""}, headers=hx)  # an error lands in the pane
    assert r.status_code == 200 and 'role="alert"' in r.text
    # the pane's Save with no conversation open saved the engine's cache (another conversation's) as
    # belonging to none, and its Resume opened nothing (walkthrough): it says to open one
    listed = len(c.get("/projects/default/contexts").json()["contexts"])
    r = c.post("/projects/default/contexts", data={"name": "empty", "conversation_id": ""}, headers=hx)
    assert "No conversation is open: a saved context is one conversation&#39;s" in r.text, r.text
    assert len(c.get("/projects/default/contexts").json()["contexts"]) == listed
    r = c.post(f"/projects/default/contexts/{cid}/delete", headers=hx)
    assert "Deleted." in r.text and "No saved contexts yet" in r.text


def test_contexts_http_mounted_in_the_app(tmp_path, default_model):
    from webapp.app import create_app

    worker = Worker(lambda: FakeCacheBackend(default_model))
    with TestClient(
        create_app(Settings(data_dir=tmp_path, load_model=False), worker=worker), base_url=BASE
    ) as c:
        assert 'hx-get="/projects/default/window"' in c.get("/").text
        assert 'id="contexts-pane"' in c.get("/projects/default/window", headers={"hx-request": "true"}).text
    worker.close()


@pytest.mark.slow
def test_contexts_http_save_a_chat_conversation_on_mlx(data_dir: Path, tmp_path: Path) -> None:
    """The Projects window's Save Context for the conversation just answered, with the real default model
    on MLX in the real app: saved (its cache held the chat's system prompt, which a check that rebuilt the
    prompt without it refused: 409 every time). After an API request's or another conversation's reply its
    automatic save is loaded first and saved by name, with its own tokens (it was refused: "send a message
    first"); after its saved context is resumed, saving it works too."""
    from tests.test_ws import connect, conversation_id, send, until
    from webapp.app import create_app
    from webapp.engine_host import make_loaded_backend

    worker = Worker(lambda: make_loaded_backend("mlx", None))
    (tmp_path / "proj").mkdir(exist_ok=True)  # a project never holds the data directory
    app = create_app(
        Settings(data_dir=data_dir, load_model=False, project_dir=tmp_path / "proj"), worker=worker
    )
    try:
        with TestClient(app, base_url=BASE, client=("127.0.0.1", 50000)) as c:  # /v1 answers loopback
            headers = {"x-csrf-token": app.state.flashcode.csrf_token}
            pid = app.state.flashcode.projects.current().id
            url = f"/projects/{pid}/contexts"
            with connect(c) as ws:
                send(ws, type="send", text="Say hi.", max_tokens=3, temperature=0, conversation_id="")
                first = conversation_id(until(ws, r'data-state="idle"', limit=400))
                r = c.post(url, json={"name": "first", "conversation_id": first}, headers=headers)
                assert r.status_code == 201, r.text
                saved = r.json()
                assert saved["conversation_id"] == first and saved["token_count"] > 20
                api = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
                assert c.post("/v1/chat/completions", json=api).status_code == 200
                # the cache holds the API request's prompt now: the conversation's automatic save is loaded
                # first (as its next reply would), and saved by name (it was refused: "send a message first")
                r = c.post(url, json={"name": "after api", "conversation_id": first}, headers=headers)
                assert r.status_code == 201 and r.json()["token_count"] == saved["token_count"], r.text
                send(ws, type="send", text="Say bye.", max_tokens=3, temperature=0, conversation_id="")
                second = conversation_id(until(ws, r'data-state="idle"', limit=400))
            assert second != first
            r = c.post(url, json={"name": "again", "conversation_id": first}, headers=headers)
            assert r.status_code == 201 and r.json()["token_count"] == saved["token_count"], r.text
            r = c.post(f"{url}/{saved['id']}/resume", headers=headers)
            assert r.json()["resumed"], r.json()
            r = c.post(url, json={"name": "again", "conversation_id": first}, headers=headers)
            assert r.status_code == 201 and r.json()["token_count"] == saved["token_count"], r.text
            pane = c.get(f"/projects/{pid}/window", headers={"hx-request": "true"}).text
            assert (
                "(MLX or flash)</td>" in pane
            )  # the cache's format, which the flash engine resumes too ("(mlx)")
            r = c.post("/projects/no-such-project/contexts", json={"name": "x"}, headers=headers)
            assert r.status_code == 404 and not (data_dir / "projects" / "no-such-project").exists()
    finally:
        worker.close()


def test_an_automatic_save_larger_than_the_quota_evicts_nothing(tmp_path, default_model):
    """A conversation whose cache alone is over the autosave quota (a long one, saved as the engine holds it):
    it is not saved, and the project's other saves stay. Before, each was evicted in turn (the file written
    again each time) and the save failed anyway."""
    from webapp.projects.resume import AutoResume

    fake = FakeCacheBackend(default_model)  # writes a 2,000-byte cache (`size`)
    worker = Worker(lambda: fake)
    db = Database(tmp_path / "flashcode.db")
    try:
        fake.run([{"role": "user", "content": "first"}])
        roomy = AutoResume(tmp_path, worker, db, quota_bytes=1 << 20)
        roomy._save(fake, "p1", "conv-a", [{"role": "user", "content": "first"}])
        assert [s.context.conversation_id for s in roomy.saved("p1")] == ["conv-a"]
        tight = AutoResume(tmp_path, worker, db, quota_bytes=4_000)  # holds conv-a's save
        fake.run([{"role": "user", "content": "second"}])
        fake.size = 5_000  # conv-b's cache alone is over the quota
        with pytest.raises(QuotaExceededError):
            tight._save(fake, "p1", "conv-b", [{"role": "user", "content": "second"}])
        assert [s.context.conversation_id for s in tight.saved("p1")] == ["conv-a"]  # still there
    finally:
        worker.close()
        db.close()


class FakeSnapshotBackend(FakeCacheBackend):
    """FakeCacheBackend that can copy its cache out (as MLX does), and whose file takes `write_s` to write."""

    write_s = 0.0

    def snapshot_prompt_cache(self, kv_bits: int | None = None) -> Any:
        from engine.mlx_backend import KVSnapshot

        return KVSnapshot([], list(self.prompt_cache.tokens), kv_bits, self.model.name, 2000)

    def save_prompt_cache(
        self, path: Path, metadata: dict[str, str], kv_bits=None, snapshot=None
    ) -> dict[str, Any]:
        time.sleep(self.write_s)
        saved = super().save_prompt_cache(path, metadata, kv_bits)
        return saved | ({"tokens": list(snapshot.tokens)} if snapshot is not None else {})


def test_a_save_written_behind_a_reply_survives_its_waiter_and_never_stalls_one(
    tmp_path, default_model, monkeypatch
) -> None:
    """Conversation a's cache, copied when b's reply was about to start, is written behind that reply. Coming
    back to a waits for that write: before, it waited for b's reply to be queued (up to 5 s, though none
    would be), and a page closed meanwhile cancelled the write with the wait (a's save lost, no log)."""
    from webapp.projects import resume as resume_module
    from webapp.projects.resume import AutoResume

    monkeypatch.setattr(resume_module, "SUBMIT_WAIT_S", 60.0)
    fake = FakeSnapshotBackend(default_model)
    worker = Worker(lambda: fake)
    db = Database(tmp_path / "flashcode.db")
    resume = AutoResume(tmp_path, worker, db)
    events: list[tuple[str, str]] = []
    resume.on_event = lambda kind, cid: events.append((kind, cid))

    async def run() -> None:
        for closed in (False, True):
            a, b = db.create_conversation("a").id, db.create_conversation("b").id
            fake.run([{"role": "user", "content": "first"}])
            resume.live, resume.dirty = a, True  # a's reply is the live cache
            fake.write_s = 0.5 if closed else 0.0
            assert await resume.before_reply(b) is None and a in resume._writing  # copied, not written yet
            back = asyncio.create_task(resume.before_reply(a))  # no reply of b was queued: a comes back
            if closed:  # the page that sent it closes while a's save is being written
                await asyncio.sleep(0.2)
                back.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await back
            else:
                await asyncio.wait_for(back, 10)  # it waited for b's reply, which never came: 60 s
            await resume.flush()
            assert ("saved", a) in events, (closed, events)
            assert [s.context.conversation_id for s in resume.saved("default")].count(a) == 1
            events.clear()

    try:
        asyncio.run(run())
    finally:
        worker.close()
        db.close()


def test_an_agent_step_or_api_request_saves_the_live_conversation_before_taking_the_engine(
    tmp_path, default_model
) -> None:
    """A chat reply leaves its conversation in the engine's cache; an agent step or an API request then took
    the engine without saving it (only a switch of chat conversation saved), so after a restart that
    conversation was read again from the start. The save's job is queued ahead of the generation: a copy,
    written behind it, or — where no copy can be taken — the save itself."""
    from engine.base import Done, GenerationRequest, GenerationStats, SamplingParams
    from engine.mlx_backend import KVSnapshot
    from webapp.projects.resume import AutoResume

    order: list[str] = []

    class Engine(FakeSnapshotBackend):
        detached = True

        def snapshot_prompt_cache(self, kv_bits: int | None = None) -> Any:
            order.append("copy")
            tokens = list(self.prompt_cache.tokens)
            return KVSnapshot([], tokens, kv_bits, self.model.name, 2000, self.detached)

        def save_prompt_cache(self, path: Path, metadata, kv_bits=None, snapshot=None) -> dict[str, Any]:
            order.append("write")
            return super().save_prompt_cache(path, metadata, kv_bits, snapshot)

        def stream(self, request, cancel):
            order.append("generate")
            self.run([{"role": "user", "content": "an agent step's own prompt"}])
            yield Done(GenerationStats(), "stop", "ok")

    fake = Engine(default_model)
    worker = Worker(lambda: fake)
    db = Database(tmp_path / "flashcode.db")
    resume = AutoResume(tmp_path, worker, db)
    worker.on_submit.append(resume.generating)  # as the app wires it

    async def run() -> None:
        for detached in (True, False):
            a = db.create_conversation("a").id
            db.add_message(a, "user", "first")
            fake.run([{"role": "user", "content": "first"}])
            held = list(fake.prompt_cache.tokens)
            resume.live, resume.dirty, fake.detached = (
                a,
                True,
                detached,
            )  # a chat reply of a is the live cache
            order.clear()
            request = GenerationRequest(prompt="x", sampling=SamplingParams(max_tokens=4))
            async for _ in worker.submit(request, loop=asyncio.get_running_loop()):
                pass
            await resume.flush()
            # a copy is written behind the step; a cache that cannot be copied is saved before it
            assert order == (["copy", "generate", "write"] if detached else ["copy", "write", "generate"])
            (save,) = [s for s in resume.saved("default") if s.context.conversation_id == a]
            folder = resume.store.contexts_dir("default") / save.context.id
            assert json.loads((folder / "tokens.json").read_text())["tokens"] == held  # a's, not the step's

    try:
        asyncio.run(run())
    finally:
        worker.close()
        db.close()


def test_a_save_written_behind_a_reply_does_not_bring_back_a_deleted_conversation(
    tmp_path, default_model
) -> None:
    """Conversation w's cache was copied to be written behind the next reply; meanwhile w was deleted for good
    (its project removed with its data): the write must not put its cache (and token ids) back on disk."""
    from webapp.projects.resume import AutoResume

    fake = FakeSnapshotBackend(default_model)
    worker = Worker(lambda: fake)
    db = Database(tmp_path / "flashcode.db")
    resume = AutoResume(tmp_path, worker, db)

    async def run() -> None:
        w, q = db.create_conversation("w").id, db.create_conversation("q").id
        db.add_message(w, "user", "secret text")
        fake.run([{"role": "user", "content": "secret text"}])
        resume.live, resume.dirty = w, True  # w's reply is the live cache
        assert await resume.before_reply(q) is None and w in resume._writing  # copied, not written yet
        db.delete_conversation(w)  # deleted for good
        resume.generating()  # q's reply is submitted: the write behind it goes
        await resume.flush()
        assert not list((tmp_path / "projects").glob("*/autosave/*/tokens.json"))

    try:
        asyncio.run(run())
    finally:
        worker.close()
        db.close()
