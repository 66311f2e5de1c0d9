"""Flash streaming I benchmark: a dense model under a cgroup memory cap, against its ceilings.

    .venv/bin/python bench/flash_dense.py --model DIR --memory-cap 1.5GB --tokens 4 \
        --out bench/results/flash-dense.json

Make the model first (kept out of the repo):
    flashcode synth llama-8b --gguf --split --out $FLASHCODE_HOME/synth/llama-8b

Runs as root (cgroups). See engine/flash/bench.py for what is measured and docs/flash.md for results.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.flash.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
