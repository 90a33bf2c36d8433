"""A generated block in a markdown page, rewritten in place: ``tools/mutation.py`` and ``tools/upstream_clients.py``
keep their tables in ``docs/mutation.md`` and ``docs/execution.md`` this way, importing it as their sibling (a script's
own directory is first on its path). (``docs/benchmarks.md`` is generated whole by ``python -m benchmarks render``.)"""
from __future__ import annotations

from pathlib import Path


def replace_block(marker: str, body: str, doc: Path) -> None:
    """Rewrite the generated block ``marker`` of ``doc`` in place; a page without it gets it after its first
    paragraph (its title and intro)."""
    begin, end = f"<!-- BEGIN {marker} (generated; do not edit) -->", f"<!-- END {marker} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    text = doc.read_text() if doc.is_file() else ""
    if begin in text and end in text:
        doc.write_text(text[: text.index(begin)] + block + text[text.index(end) + len(end):])
        return
    head, sep, rest = text.partition("\n\n")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text((head + sep if rest else text.rstrip("\n") + "\n\n") + block + "\n\n" + rest)
