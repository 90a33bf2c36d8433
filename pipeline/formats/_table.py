"""The formats tables of the README and docs/formats.md, generated from the registry so that they cannot drift.

``python -m pipeline.formats._table`` prints the tables; ``--write`` replaces the text between the markers
``<!-- formats-table:start -->`` and ``<!-- formats-table:end -->`` in README.md and docs/formats.md; ``--check``
exits 1 naming each file whose table differs from the registry (tests/unit/test_formats_table.py runs it).

Every cell is a fact of a format module (``pipeline/formats/<name>.py``): to change a row, change the module and
rerun ``--write``. A helper module (leading ``_``): the package stage copies it with the registry, where it is unused.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import FORMATS, KV_FORMATS
from ._base import KVFormat, QuantFormat

START, END = "<!-- formats-table:start -->", "<!-- formats-table:end -->"
ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("README.md", "docs/formats.md")
ENGINE_LINE = "1.2.1"  # the engine backend exists on the 1.2.x line only (removed on main)
LABEL = {"1.2.1": "1.2.x", "main": "main"}  # a recorded line as the table names it


def _trtllm(runtimes: frozenset[str], lines: tuple[str, ...]) -> str:
    parts = []
    if "trtllm_llmapi" in runtimes:
        parts.append(f"LLM API ({', '.join(LABEL.get(v, v) for v in lines)})")
    if "trtllm_engine" in runtimes and ENGINE_LINE in lines:
        parts.append(f"engine ({LABEL[ENGINE_LINE]})")
    return "; ".join(parts) or "none (reference runtime only)"


def _weight_row(f: QuantFormat) -> str:
    preset = f"`{f.preset}`" if f.preset else "—"
    algo = f"`{f.quant_algo}`" if f.quant_algo else "—"
    return (f"| `{f.name}` | {f.precision or '—'} | {preset} | {algo} | {f.sm_needs} | "
            f"{_trtllm(f.runtimes, f.trtllm_lines)} |")


def _kv_row(k: KVFormat) -> str:
    preset = f"`{k.preset}`" if k.preset else "—"
    algo = f"`{k.quant_algo}`" if k.quant_algo else "—"
    return f"| `{k.name}` | {preset} | {algo} | {k.sm_needs} | {_trtllm(k.runtimes, ('1.2.1', 'main'))} |"


def render(formats: dict[str, QuantFormat] = FORMATS, kv_formats: dict[str, KVFormat] = KV_FORMATS) -> str:
    """The tables (markdown), markers excluded."""
    lines = ["| `quant=` | weights / activations | ModelOpt preset | exported `quant_algo` | serves on | "
             "TensorRT-LLM path (line) |", "|---|---|---|---|---|---|"]
    lines += [_weight_row(f) for f in formats.values()]
    lines += ["", "| `quant.kv_cache=` | ModelOpt preset | `kv_cache_quant_algo` | serves on | TensorRT-LLM path |",
              "|---|---|---|---|---|"]
    lines += [_kv_row(k) for k in kv_formats.values()]
    return "\n".join(lines)


def splice(text: str, table: str, where: str) -> str:
    """``text`` with the part between the markers replaced by ``table``."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"{where}: needs one '{START}' line followed by one '{END}' line around the formats table")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table}\n{END}{tail}"


def stale(root: Path = ROOT, table: str | None = None) -> list[str]:
    """The files under ``root`` whose table differs from the registry's (one line each, naming the fix)."""
    table = render() if table is None else table
    out = []
    for rel in TARGETS:
        text = (root / rel).read_text()
        try:
            if splice(text, table, rel) != text:
                out.append(f"{rel}: the formats table differs from the registry (pipeline/formats/); run "
                           f"python -m pipeline.formats._table --write")
        except ValueError as exc:
            out.append(str(exc))
    return out


def write(root: Path = ROOT) -> list[str]:
    """Rewrite the tables under ``root`` -> the files changed."""
    table, changed = render(), []
    for rel in TARGETS:
        path = root / rel
        text = path.read_text()
        new = splice(text, table, rel)
        if new != text:
            path.write_text(new)
            changed.append(rel)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.formats._table", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite the tables in README.md and docs/formats.md")
    g.add_argument("--check", action="store_true", help="exit 1 when a committed table differs from the registry")
    args = p.parse_args(argv)
    try:
        if args.write:
            print("\n".join(f"wrote {f}" for f in write()) or "tables up to date")
            return 0
        if args.check:
            problems = stale()
            print("\n".join(problems) or "tables up to date", file=sys.stderr if problems else sys.stdout)
            return 1 if problems else 0
    except (OSError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
