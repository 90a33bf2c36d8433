"""docs/benchmarks.md, newest first: every benchmark script records its section through these functions."""
from __future__ import annotations

import json
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEAD = "# Benchmarks\n\nNewest first. Every figure was measured by the script named in its section.\n"
_FIRST = re.compile(r"^(## |<!-- BEGIN )", re.M)  # a section, or a generated block (which holds sections)


def prepend(section: str, doc: Path = DOC) -> None:
    """Put ``section`` first: after the page's title and intro, before every earlier section or generated block."""
    text = doc.read_text() if doc.is_file() else HEAD
    m = _FIRST.search(text)
    head, body = (text, "") if m is None else (text[: m.start()], text[m.start():])
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(head.rstrip("\n") + "\n\n\n" + section.strip() + "\n\n\n" + body.lstrip("\n"))


def replace_block(marker: str, body: str, doc: Path = DOC) -> None:
    """Rewrite the generated block ``marker`` in place; a new block goes first (as :func:`prepend`)."""
    begin, end = f"<!-- BEGIN {marker} (generated; do not edit) -->", f"<!-- END {marker} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    text = doc.read_text() if doc.is_file() else HEAD
    if begin in text and end in text:
        doc.write_text(text[: text.index(begin)] + block + text[text.index(end) + len(end):])
    else:
        prepend(block, doc)


def publish(lines: list[str], out: Path, result: dict, no_doc: bool, repo: Path = DOC.parents[1],
            indent: int | None = 1) -> str:
    """End a section with its raw-data line, then (unless ``no_doc``) write ``result`` to ``out`` (``indent``: as
    ``json.dumps`` takes it; None for one line) and put the section first in the page. Returns the section's text,
    for printing."""
    where = f"`{out.relative_to(repo).as_posix()}`" if not no_doc else "not written (--no-doc)"
    text = "\n".join([*lines, "", f"Raw data: {where}."]) + "\n"
    if not no_doc:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=indent) + "\n")
        prepend(text)
    return text
