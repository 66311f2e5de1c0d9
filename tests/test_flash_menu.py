"""Flash from the UI (issue 17): the model menu shows each model's size in RAM and whether it fits, offers
"in RAM (MLX)" / "from SSD (flash)" / "llama-server" per model (the engine the fit rule picks marked), Settings
shows flash's memory budget and how auto was derived, and picking "from SSD (flash)" switches the running
server's engine, no restart: the next reply streams from SSD with the live meter.

Real parts: the default model and a synthetic model imported from a GGUF, MLX and the flash engine, the
real app and websocket in process; once in Chromium against the real `flashcode serve` (screenshot
tests/artifacts/flash_menu.png).
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from engine.models import DEFAULT_MODEL
from tests.test_openai_on_demand import SYNTH
from tests.test_ws import BASE, connect, send, until

pytest_plugins = ["tests.test_browser_trust", "tests.test_openai_on_demand"]  # home, browser, two_models
pytestmark = pytest.mark.slow


def test_the_menu_shows_size_and_fit_and_flash_switches_without_restart(
    two_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.worker import Worker
    from webapp.app import create_app
    from webapp.chat import socket as ws_module
    from webapp.engine_host import make_loaded_backend
    from webapp.settings import Settings

    monkeypatch.setenv("FLASHCODE_HOME", str(two_models))
    # a model with no GGUF (as `flashcode synth` makes): llama-server cannot load it, so it is not offered
    bare = two_models / "models" / "bare-synth"
    if not bare.exists():
        bare.mkdir()
        for f in (two_models / "models" / SYNTH).iterdir():
            if f.is_file() and f.name != "flashcode.json":
                (bare / f.name).symlink_to(f)
    monkeypatch.setattr(
        ws_module, "METER_SECONDS", 0.01
    )  # a meter frame even for a fast reply (flash prefills as MLX)
    worker = Worker(lambda: make_loaded_backend("mlx", DEFAULT_MODEL))
    app = create_app(Settings(data_dir=two_models, load_model=False), worker=worker)
    try:
        with TestClient(app, base_url=BASE) as c:
            page = html.unescape(c.get("/").text)
            group = re.search(
                rf'<optgroup label="{SYNTH} — (\d+\.\d) MB in RAM, fits in RAM"[^>]*data-fits="yes"', page
            )
            assert group and 10 < float(group[1]) < 20, page[page.find('<select id="model-picker"') :][:1500]
            for label in ("in RAM (MLX)", "from SSD (flash)"):
                assert f"{SYNTH} · {label}" in page and f"bare-synth · {label}" in page
            assert f'value="llama:{SYNTH}"' in page and 'value="llama:bare-synth"' not in page
            assert re.search(r'<option value="mlx:bare-synth"[^>]*data-suggested="yes"', page)
            assert re.search(r'<option value="(mlx|llama):' + SYNTH + r'"[^>]*data-suggested="yes"', page)
            assert re.search(r'id="model-fit"[^>]*>\d+\.\d MB · fits in RAM<', page)  # the loaded model's
            budget = re.search(r"<dt>Memory budget \(flash\)</dt><dd>(auto: [^<]+)</dd>", page)
            assert budget and ("margin" in budget[1] or "cgroup" in budget[1]), budget

            with connect(c) as ws:
                send(ws, type="model", choice=f"flash:{SYNTH}", conversation_id="")
                frames = until(ws, r'data-state="idle"', limit=50)
                joined = html.unescape("".join(frames))
                assert re.search(rf'<option value="flash:{SYNTH}"[^>]* selected', joined)
                assert re.search(rf'id="menubar-model"[^>]*>{SYNTH}<', joined)
                shown = re.search(
                    r"<dt>Memory budget \(flash\)</dt><dd>auto: (\d+\.\d\d) GB = ([^<]+)</dd>", joined
                )
                assert shown and ("margin" in shown[2] or "cgroup" in shown[2])  # the loaded engine's own
                engine = app.state.flashcode.engine
                assert (engine.backend, engine.model) == ("flash", SYNTH)
                # the next start loads it again (unless told otherwise)
                assert app.state.flashcode.db.get_setting("last_model") == {
                    "backend": "flash",
                    "model": SYNTH,
                }

                send(ws, type="send", text="Hello", conversation_id="", max_tokens=16, temperature=0)
                frames = until(ws, r'data-state="idle"', limit=500)
                joined = html.unescape("".join(frames))
                assert re.search(rf'class="stat model-name">{SYNTH} · flash<', joined)
                assert re.search(r'data-stat="memory"[^>]*>Peak \d+\.\d\d / \d+\.\d\d GB', joined)
                meter = [f for f in frames if 'id="engine-meter"' in f and "Mem " in f]
                assert meter and "(auto: " in html.unescape(meter[-1])  # how auto was derived

                # the budget from Settings: flash loads again under it, no restart; every window follows
                form = c.get("/engine/budget").text
                assert 'name="memory_budget" value="auto"' in form
                # the Settings rows say the budget; the form below them is not a second "Memory budget (flash)"
                assert ">New memory budget (flash)</label>" in form and ">Memory budget (flash)<" not in form
                assert c.post("/engine/budget", data={"memory_budget": "400MB"}).status_code == 403  # no CSRF
                token = app.state.flashcode.csrf_token
                # the budget is the whole process's, and this one is a test run's (it grows to ~2 GB over
                # a full run): what it holds now plus 1 GB, in whole 100 MB
                from engine.flash.backend import current_rss_bytes

                budget = (current_rss_bytes() // 100_000_000 + 10) * 100_000_000
                r = c.post(
                    "/engine/budget", data={"memory_budget": f"{budget // 1_000_000}MB", "csrf_token": token}
                )
                assert "Set; flash loaded again under it." in r.text, r.text
                assert f'name="memory_budget" value="{budget // 1_000_000}' in r.text, r.text
                assert worker.backend.memory_budget == budget and engine.backend == "flash"
                until(ws, rf"<dd>{budget / 1e9:.2f} GB \(set, not auto\)</dd>")
                # a budget given is what the menu's fit is judged against, and said so (it said "in RAM")
                menu = html.unescape(c.get("/").text)
                assert re.search(
                    rf'<optgroup label="{SYNTH} — [\d.]+ MB in RAM, fits in the memory budget"', menu
                )
                r = c.post("/engine/budget", data={"memory_budget": "lots", "csrf_token": token})
                assert "Not set: not a size" in html.unescape(r.text)
                r = c.post("/engine/budget", data={"memory_budget": "auto", "csrf_token": token})
                assert 'value="auto"' in r.text and worker.backend.budget_setting == "auto"
    finally:
        worker.close()


@pytest.mark.browser
def test_flash_from_the_model_menu_in_chromium(two_models: Path, browser, artifacts: Path) -> None:
    from tests.servers import serve_cli
    from tests.test_browser_trust import connected, menu, new_page, replies_done
    from tests.test_browser_trust import send as type_and_send

    with serve_cli(two_models, backend="mlx", timeout=300) as srv:
        page = new_page(browser)
        page.goto(srv.url)
        connected(page)
        assert "fits in RAM" in page.locator("#model-fit").inner_text()
        page.select_option("#model-picker", f"flash:{SYNTH}")
        page.locator("#menubar-model", has_text=SYNTH).wait_for(timeout=300_000)
        page.locator("#status[data-state=idle]").wait_for(timeout=300_000)
        assert page.input_value("#model-picker") == f"flash:{SYNTH}"
        type_and_send(page, "Hello")
        replies_done(page, 1)
        footer = page.locator(".msg-assistant .msg-stats").last
        assert footer.locator(".model-name").inner_text() == f"{SYNTH} · flash"
        assert footer.locator('[data-stat="memory"]').count() == 1
        page.screenshot(path=str(artifacts / "flash_menu.png"))

        menu(page, "View", "button[data-open=settings-window]")  # the budget, and how auto was derived
        rows = page.locator("#settings-rows")
        assert re.search(r"Memory budget \(flash\)\s*auto: \d+\.\d\d GB = ", rows.inner_text())
        page.fill("#memory-budget", "600MB")
        page.click("#budget-form button[type=submit]")
        page.locator("#budget-form .budget-note", has_text="flash loaded again").wait_for(timeout=300_000)
        page.locator("#settings-rows", has_text="0.60 GB (set, not auto)").wait_for(timeout=60_000)
        page.screenshot(path=str(artifacts / "flash_menu_budget.png"))
        assert not page.errors, page.errors
