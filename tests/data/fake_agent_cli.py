"""`flashcode` in a subprocess with a scripted model (FakeBackend, which cannot be reached across
processes otherwise): `python tests/data/fake_agent_cli.py SCRIPT.json REPORT.json ARGS...` queues
SCRIPT's replies (`{"call": NAME, "arguments": {...}}` or `{"text": ...}`), runs `flashcode ARGS`
(the real command line, its database and MCP servers), and writes REPORT: the tools offered to the
model and the tool messages of the last request."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.conftest import FakeBackend  # noqa: E402
from webapp import cli, engine_host, preflight  # noqa: E402


def main() -> int:
    script, report, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    fake = FakeBackend(tools=True, context_length=32768)
    for reply in json.loads(Path(script).read_text()):
        if "call" in reply:
            fake.enqueue_call(reply["call"], **reply.get("arguments", {}))
        else:
            fake.enqueue(reply["text"])
    engine_host.make_loaded_backend = lambda backend, model, options=None: fake  # type: ignore[assignment]
    preflight.check_model = lambda name, root: None  # type: ignore[assignment,return-value]  # the scripted one
    try:
        return cli.main(args)
    finally:
        last = fake.history[-1] if fake.history else None
        Path(report).write_text(
            json.dumps(
                {
                    "offered": [t["function"]["name"] for t in (fake.history[0].tools or ())] if last else [],
                    "tool_messages": [m["content"] for m in last.messages if m.get("role") == "tool"]
                    if last
                    else [],
                }
            )
        )


if __name__ == "__main__":
    sys.exit(main())
