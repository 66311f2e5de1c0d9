"""Stats: what each reply cost in time and tokens, what it would have cost on a cloud API, grades.

`store.py` records and queries the numbers, `costs.py` keeps the price table, `charts.py` lays out
the Stats window's charts, `bench.py` runs the fixed bench set, `views.py` is the Stats window, the
slash commands and the `Stats` feature `create_app` wires in. See docs/stats.md.
"""
