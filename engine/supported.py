"""The architectures this engine runs (GGUF `general.architecture`): open_model refuses every other one.

A module of its own with no imports, so that setup reads the same list before the packages (NumPy, gguf) are
installed: the catalog offers exactly what open_model accepts.
"""
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gpt-oss")
