"""``model.source`` forms: ``hf://org/name@revision``, ``gguf://package/file.gguf`` or ``gguf:///abs/file.gguf``, a
local Hugging Face checkpoint directory, or ``synthetic``."""
from __future__ import annotations

from pipeline.errors import UserError


def parse_source(source: str) -> tuple[str, str, str | None]:
    """-> (kind, location, revision). kind is hf | gguf | local | synthetic."""
    if source == "synthetic":
        return "synthetic", "", None
    if source.startswith("hf://"):
        body = source[len("hf://"):]
        repo, _, rev = body.partition("@")
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise UserError(f"model.source={source!r}: expected hf://org/name@revision")
        return "hf", repo, rev or None
    if source.startswith("gguf://"):
        return "gguf", source[len("gguf://"):], None
    return "local", source, None
