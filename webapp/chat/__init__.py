"""The chat: the page, the websocket and the one reply pipeline every turn goes through.

`views.py` draws the page and its fragments, `pages.py` answers HTTP, `socket.py` runs one websocket
session per tab, `pipeline.py` streams and stores replies, `protocol.py` parses client messages.
Other features take part through `webapp.turns` (a `TurnHandler` for the messages they answer, a
`ReplyHook` for finished replies), passed in by `webapp.app.create_app`.
"""
