"""The base models `plexrl serve` serves: served name -> local Hugging Face folder, fixed for the
server's life, and what the SDK is told about them (`get_server_capabilities`, `get_info`).

A name not served is `InvalidInput` naming the ones that are. Folders are read once: they do not
change while serving.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plexrl.api import errors
from plexrl.api.types import shown


class Catalog:
    def __init__(self, served: dict[str, str]):
        if not served:
            raise errors.ConfigError("no model to serve; give --model PATH (or NAME=PATH) at least once")
        self.served = dict(served)
        self._capabilities: dict | None = None

    def folder(self, base_model: Any) -> str:
        folder = self.served.get(base_model) if isinstance(base_model, str) else None
        if folder is None:
            raise errors.InvalidInput(f"base_model={shown(base_model)} is not served here; expected one of "
                                      f"{sorted(self.served)}")
        return folder

    def capabilities(self) -> dict:
        if self._capabilities is None:
            self._capabilities = {"supported_models": [
                {"model_name": name, "max_context_length": _context(folder), "trainable": True, "sampleable": True}
                for name, folder in sorted(self.served.items())]}
        return self._capabilities

    def model_data(self, base_model: str) -> dict:
        """get_info's `model_data` of a served model."""
        folder = self.served[base_model]
        return {"arch": _arch(folder), "model_name": base_model, "tokenizer_id": folder}


def _config(folder: str) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def _arch(folder: str) -> str:
    try:
        return (_config(folder).get("architectures") or ["unknown"])[0]
    except (OSError, ValueError):
        return "unknown"


def _context(folder: str) -> int | None:
    try:
        return _config(folder).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
