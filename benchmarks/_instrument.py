"""The instrument every benchmark runs through: shared options, provenance, the raw record, and the generated
``docs/benchmarks.md`` (the module docstring of :mod:`benchmarks` states a benchmark's interface).

    python -m benchmarks                          # the benchmarks, one line each
    python -m benchmarks NAME [run] [options]     # measure; write the raw record; regenerate docs/benchmarks.md
    python -m benchmarks NAME render [FILE ...]   # print NAME's current block(s) (or those of FILEs)
    python -m benchmarks render [--check]         # regenerate docs/benchmarks.md from benchmarks/results/

The raw records under ``benchmarks/results/`` are the history; ``docs/benchmarks.md`` shows, per benchmark, the
current figure (its newest record), one line for the newest record of each other variant, and links the older ones.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib
import inspect
import json
import os
import pkgutil
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from benchmarks import _provenance

try:  # 4x faster on the 25 MB of records the page reads (orjson comes with aiperf, a dependency); json otherwise
    from orjson import JSONDecodeError as _FastError, loads as _fast_loads
except ImportError:  # pragma: no cover
    _FastError, _fast_loads = ValueError, json.loads

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOC = REPO / "docs" / "benchmarks.md"
PROVENANCE = ("benchmark", "date", "commit", "dirty", "machine", "source_sha256")
SUBCOMMANDS = ("run", "render")
# what render/variant raise on a record of an older form (a field missing or shaped otherwise)
OLDER_FORM = (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError)


class UsageError(Exception):
    """Bad input on the command line: one line, exit 2."""


def machine() -> str:
    """The machine a record was measured on, as one line."""
    return (f"{platform.node()} · {os.cpu_count()} CPUs · {platform.processor() or platform.machine()} · "
            f"Python {platform.python_version()}")


def provenance() -> dict:
    """What code ran and where: ``commit`` (None without git metadata; then ``commit_claimed``/``commit_note`` say
    what is known), ``dirty`` (source files differ from the commit), ``machine``, ``source_sha256``."""
    state = _provenance.source_state()
    out = {"commit": state["commit"], "dirty": state["dirty"], "machine": machine(),
           "source_sha256": state["source_sha256"]}
    for key in ("commit_claimed", "commit_note"):
        if state.get(key):
            out[key] = state[key]
    return out


def names() -> list[str]:
    """Every benchmark: the modules of this package whose names do not start with ``_``."""
    return sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                  if not m.name.startswith("_") and not m.ispkg)


def load(name: str) -> ModuleType:
    if name not in names():
        raise UsageError(f"no benchmark named {name!r}: `python -m benchmarks` lists them ({', '.join(names())})")
    module = importlib.import_module(f"benchmarks.{name}")
    missing = [f for f in ("add_arguments", "run", "render") if not callable(getattr(module, f, None))]
    if missing or not module.__doc__:
        raise UsageError(f"benchmarks/{name}.py lacks {', '.join(missing) or 'a module docstring'}: see "
                         f"`benchmarks/__init__.py` for what a benchmark defines")
    return module


def title(name: str, module: ModuleType) -> str:
    if getattr(module, "TITLE", None):
        return module.TITLE
    first = " ".join(module.__doc__.strip().split("\n\n")[0].split())
    return re.split(r"(?<=[.:;])\s", first)[0].rstrip(".:;")


# ---- raw records ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    path: Path
    data: dict

    @property
    def when(self) -> str:
        """A sortable time: the record's ``date`` (ISO), else the date in its file name."""
        date = str(self.data.get("date") or "")
        finished = str(self.data.get("finished") or "")
        if len(date) == 10 and finished.startswith(date):  # a day alone: the finishing time where recorded
            return finished[:19]
        if re.match(r"\d{4}-\d{2}-\d{2}", date):
            return date[:19]
        m = re.search(r"-(\d{4})-?(\d{2})-?(\d{2})(?:-(\d{2})(\d{2})(?=-))?", self.path.stem)
        if m:
            y, mo, d, h, mi = m.groups()
            return f"{y}-{mo}-{d}" + (f"T{h}:{mi}" if h else "")
        return ""


def _loads(raw: bytes):
    try:
        return _fast_loads(raw)
    except _FastError:  # NaN or Infinity, which json writes and orjson refuses
        return json.loads(raw)


def result_names(name: str, module: ModuleType) -> tuple[str, ...]:
    return tuple(getattr(module, "RESULT_NAMES", None) or (name,))


def records(name: str, module: ModuleType, results: Path | None = None) -> list[Record]:
    """The benchmark's raw records under ``results`` (default :data:`RESULTS`), newest first (equal times: by file
    name, last first)."""
    results = results or RESULTS
    stems = result_names(name, module)
    found = []
    for path in sorted(results.glob("*.json")) if results.is_dir() else []:
        if any(path.stem == s or path.stem.startswith(s + "-") for s in stems):
            try:
                data = _loads(path.read_bytes())
            except (OSError, ValueError) as exc:
                raise UsageError(f"{path}: not a JSON record ({exc}); fix or remove the file") from None
            if isinstance(data, dict):
                found.append(Record(path, data))
    return sorted(found, key=lambda r: (r.when, r.path.name), reverse=True)


def result_path(name: str, record: dict, module: ModuleType, out_dir: Path, suffix: str | None = None) -> Path:
    """``NAME-<YYYY-MM-DD>-<commit>[-suffix].json`` under ``out_dir``; ``-dirty`` follows the commit where the source
    files differed from it; a name already taken gets ``-2``, ``-3``, ..."""
    commit = (record["commit"] or "nogit-" + record["source_sha256"])[:7 if record["commit"] else 13]
    parts = [name, record["date"][:10], commit + ("-dirty" if record.get("dirty") else "")]
    extra = suffix or (module.suffix(record) if callable(getattr(module, "suffix", None)) else None)
    if extra:
        parts.append(re.sub(r"[^A-Za-z0-9._-]+", "-", str(extra)).strip("-"))
    stem = "-".join(parts)
    path, n = out_dir / f"{stem}.json", 2
    while path.exists():
        path, n = out_dir / f"{stem}-{n}.json", n + 1
    return path


def write_record(path: Path, record: dict) -> None:
    """One line of JSON, written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, default=str) + "\n")
    tmp.replace(path)


# ---- the generated page -----------------------------------------------------------------------------------------

HEAD = """# Benchmarks

Generated by `python -m benchmarks render` from the raw records under `benchmarks/results/`; do not edit by hand
(`tests/unit/test_benchmarks.py` fails when this page differs from what the records render). Each section shows the
current figure of one benchmark (its newest record), the newest record of each other variant where it keeps several
(one per machine, model or shape) as one line, and links its older runs: the history stays in the raw records. A figure's commit is the commit whose files ran ("uncommitted changes" where the source files
differed from it).

Run a benchmark with `python -m benchmarks NAME [options]` (`python -m benchmarks NAME --help` says what it measures
and takes); it writes its raw record to `benchmarks/results/` and regenerates this page.
"""


def _link(path: Path) -> str:
    """A record's link from docs/ (a record is named for where it is kept: ``benchmarks/results/``)."""
    return f"[`{path.name}`](../benchmarks/results/{path.name})"


def _variant(module: ModuleType, record: Record) -> str:
    return str(module.variant(record.data)) if callable(getattr(module, "variant", None)) else ""


def _body(lines) -> list[str]:
    """A block's lines without a heading of its own at the top (the page gives each section and variant its own)."""
    lines = list(lines)
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("#")):
        lines.pop(0)
    return lines


def current(name: str, module: ModuleType, recs: list[Record]) -> list[tuple[str, Record, list[str]]]:
    """``(variant, record, lines)`` for the newest record of each variant that renders; a record that states an
    ``error`` (a failed run; the run exits 1) or whose fields ``render`` cannot read (an older form) is never current."""
    out: dict[str, tuple[str, Record, list[str]]] = {}
    for rec in recs:
        if rec.data.get("error"):
            continue
        try:
            var = _variant(module, rec)
            if var in out:
                continue
            lines = _body(module.render(rec.data))
        except OLDER_FORM:
            continue
        out[var] = (var, rec, lines)
    return sorted(out.values(), key=lambda v: v[0])


def section(name: str, module: ModuleType, results: Path | None = None) -> str:
    """One benchmark's section: its current figure (the newest record that renders, in full), one line for the newest
    record of each other variant, and the older runs as links (the history stays in the raw records)."""
    recs = records(name, module, results)
    blocks = sorted(current(name, module, recs), key=lambda b: (b[1].when, b[1].path.name), reverse=True)
    lines = [f"## {title(name, module)} (`python -m benchmarks {name}`)", ""]
    if not blocks:
        lines += ["No record yet.", ""]
    shown = {b[1].path for b in blocks}
    if blocks:
        var, rec, body = blocks[0]
        if var and len(blocks) > 1:
            lines += [f"### {var}", ""]
        analysis = rec.data.get("analysis")
        lines += [*body, *(["", analysis.strip()] if isinstance(analysis, str) and analysis.strip() else []), "",
                  f"Raw data: {_link(rec.path)}.", ""]
    if len(blocks) > 1:
        lines += ["Other variants, newest record each (`python -m benchmarks " + name + " render FILE` shows one): "
                  + "; ".join(f"{var or 'default'} ({rec.when[:10]}, {_link(rec.path)})" for var, rec, _ in blocks[1:])
                  + ".", ""]
    older = [r for r in recs if r.path not in shown]
    if older:
        lines += ["Older runs: " + ", ".join(_link(r.path) for r in older) + ".", ""]
    return "\n".join(lines)


def page(results: Path | None = None) -> str:
    """docs/benchmarks.md as the records under ``results`` (default :data:`RESULTS`) render it."""
    mods = {n: load(n) for n in names()}
    toc = ["| benchmark | section |", "|---|---|"]
    for n, m in mods.items():
        anchor = re.sub(r"[^a-z0-9 _-]", "", f"{title(n, m)} (python -m benchmarks {n})".lower()).replace(" ", "-")
        toc.append(f"| `{n}` | [{title(n, m)}](#{anchor}) |")
    body = "\n".join(section(n, m, results) for n, m in mods.items())
    return HEAD + "\n" + "\n".join(toc) + "\n\n" + body.rstrip("\n") + "\n"


def is_current(doc: Path | None = None, results: Path | None = None) -> bool:
    """Whether ``doc`` (default :data:`DOC`) is what the records render."""
    doc = doc or DOC
    return doc.is_file() and doc.read_text() == page(results)


def render_doc(doc: Path | None = None, results: Path | None = None) -> bool:
    """Rewrite ``doc`` (default :data:`DOC`) from the records. -> whether it changed."""
    doc = doc or DOC
    text = page(results)
    if doc.is_file() and doc.read_text() == text:
        return False
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(doc)
    return True


# ---- the command line -------------------------------------------------------------------------------------------


def parser(name: str, module: ModuleType) -> argparse.ArgumentParser:
    # a benchmark's own option of the same name as a shared one wins ("resolve"): the shared one then stays unset
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=inspect.cleandoc(module.__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter, conflict_handler="resolve")
    shared = ap.add_argument_group("the instrument's options (every benchmark)")
    shared.add_argument("--no-record", "--no-doc", dest="no_record", action="store_true",
                        help="print the block only; write neither the raw record nor docs/benchmarks.md")
    shared.add_argument("--out", dest="out_dir", type=Path, metavar="DIR",
                        help="write the raw record under DIR instead (e.g. on a GPU host); docs/ untouched. "
                             "Copy it into benchmarks/results/ and run `python -m benchmarks render` to show it")
    shared.add_argument("--suffix", help="added to the raw record's file name")
    shared.add_argument("--note", help="a note kept in the raw record (what the run was for, what differed)")
    module.add_arguments(ap)
    return ap


def run(name: str, argv: list[str]) -> int:
    module = load(name)
    args = parser(name, module).parse_args(argv)
    no_record, out_dir, suffix, note = (getattr(args, k, None) for k in ("no_record", "out_dir", "suffix", "note"))
    state = provenance()
    fields = module.run(args)
    if fields is None:
        return 0
    if not isinstance(fields, dict):
        raise TypeError(f"benchmarks/{name}.py: run() returned {type(fields).__name__}, not a dict")
    record = {"benchmark": name, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **state}
    for key in sorted(set(fields) & set(PROVENANCE)):  # the instrument's own: the run's value is kept beside it
        print(f"warning: benchmarks/{name}.py: run() returned the instrument's field {key!r}; kept as 'run_{key}'",
              file=sys.stderr)
        fields[f"run_{key}"] = fields.pop(key)
    record.update(fields)
    if note:
        record["note"] = note
    print("\n".join(module.render(record)))
    if no_record:
        print("\n(not recorded: --no-record)")
        return 1 if record.get("error") else 0
    path = result_path(name, record, module, out_dir or RESULTS, suffix)
    write_record(path, record)
    print(f"\nRaw data: {path}")
    if out_dir is None:
        render_doc()
        print(f"Regenerated {DOC}")
    return 1 if record.get("error") else 0


def render_files(name: str, files: list[str]) -> int:
    module = load(name)
    if not files:
        print(section(name, module))
        render_doc()
        return 0
    for f in files:
        p = Path(f)
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{f}: not a readable JSON record ({exc})") from None
        try:
            lines = _body(module.render(data))
        except OLDER_FORM as exc:
            raise UsageError(f"{f}: not a record benchmarks/{name}.py renders ({type(exc).__name__}: {exc}); an "
                             f"older form, or another benchmark's") from None
        print("\n".join(lines) + "\n")
    return 0


def listing() -> str:
    rows = [f"  {n:<28} {title(n, load(n))}" for n in names()]
    return ("usage: python -m benchmarks NAME [run|render] [options] | python -m benchmarks render [--check]\n\n"
            + "\n".join(rows))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0] in ("-h", "--help", "list"):
            print(listing())
            return 0
        if argv[0] == "render":
            extra = [a for a in argv[1:] if a != "--check"]
            if extra:
                raise UsageError(f"`render` takes only --check, not {' '.join(extra)}")
            if "--check" in argv:
                if not is_current():
                    print(f"{DOC} differs from its records: run `python -m benchmarks render`", file=sys.stderr)
                    return 1
                return 0
            changed = render_doc()
            print(f"{DOC} {'regenerated' if changed else 'already current'}")
            return 0
        name, rest = argv[0], argv[1:]
        sub = rest.pop(0) if rest and rest[0] in SUBCOMMANDS else "run"
        if sub == "render":
            return render_files(name, rest)
        return run(name, rest)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
