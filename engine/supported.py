"""The architectures this engine runs (GGUF `general.architecture`): open_model refuses every other one.

A module of its own with no imports, so that setup reads the same lists before the packages (NumPy, gguf) are
installed: the catalog offers exactly what the backend it would use accepts.
"""
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gpt-oss", "qwen3next", "qwen35moe",
                   "qwen4exp")

# What the CUDA backend runs. The others run on the CPU backend (the NumPy reference) only, so far: right, but far
# too slow for the sizes these models come in, so setup never offers them for a GPU (qwen4exp: issue 35).
CUDA_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gpt-oss", "qwen3next", "qwen35moe")


def runs_on(arch: str, backend: str) -> bool:
    """Whether `backend` ("cuda" or "cpu") runs architecture `arch`."""
    return arch in (CUDA_ARCHS if backend == "cuda" else SUPPORTED_ARCHS)


def archs_for(backend: str) -> tuple[str, ...]:
    return CUDA_ARCHS if backend == "cuda" else SUPPORTED_ARCHS
