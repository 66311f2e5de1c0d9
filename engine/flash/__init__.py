"""Flash streaming: run models larger than memory by streaming weights from SSD, exactly.

split.py (layout + manifest), reader.py (direct I/O), budget.py (byte accounting), dense.py
(streamed FFN layers), backend.py (FlashBackend), synth.py (synthetic models), bench.py (cgroup
benchmark harness), cli.py (`flashcode split` / `flashcode synth`). Nothing here is imported by
`import engine`; MLX is imported only inside the functions that need it.
"""
