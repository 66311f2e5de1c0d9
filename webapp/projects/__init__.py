"""Projects: a project is a directory; its conversations, rules, contexts and stats belong to it.

`store` (the registry and the checks on a directory), `files` (the Files window's view of the
directory), `resume` (automatic KV-cache saves and resume), `web` (dialogs, Files window, attachments).
"""
