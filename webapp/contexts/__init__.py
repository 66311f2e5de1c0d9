"""Saved project contexts in the web app: the Projects window and its HTTP routes (`http.py`).

The store itself (files, model check, quota, export/import) is `engine.sessions`.
"""
