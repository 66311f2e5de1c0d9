"""flashcode's inference engines behind one Backend protocol (see `engine.base`).

Importing this package is cheap: MLX, HTTP clients and the like are imported by the backend that
needs them, when it is first made (`engine.registry.backend_factory`). One exception, on Linux: MLX's
float matmuls are routed to an optimized BLAS here, before anything imports MLX (`engine.cpu_fast`).
"""

from .cpu_fast import load_fast_blas

load_fast_blas()


from .base import (  # noqa: E402
    Backend,
    Done,
    EngineError,
    GenerationRequest,
    GenerationStats,
    ModelInfo,
    SamplingParams,
    TextDelta,
)

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "Done",
    "EngineError",
    "GenerationRequest",
    "GenerationStats",
    "ModelInfo",
    "SamplingParams",
    "TextDelta",
    "__version__",
]
