"""What code a benchmark ran: the commit its checkout was at, whether the working tree differed from it, and a
digest of the source files, written into every raw JSON under ``benchmarks/results/`` by the script itself.

Where the script runs from a copy without git metadata (a GPU host given the files only), ``commit`` is None,
``commit_claimed`` is what its launcher says in ``PIPELINE_COMMIT`` (if anything), and ``commit_note`` says so; ``source_sha256`` (the files the pipeline runs: ``pipeline/``, ``conf/``, ``benchmarks/*.py``,
``pyproject.toml``) still identifies the code, and ``python -m benchmarks._provenance --match DIGEST`` finds the
commit whose files have that digest. A hand-written commit is never recorded.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pipeline", "conf", "benchmarks", "pyproject.toml")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


def _is_source(rel: str) -> bool:
    if "__pycache__" in rel or rel.startswith("benchmarks/results/"):
        return False
    return rel == "pyproject.toml" or rel.startswith(("pipeline/", "conf/")) or (
        rel.startswith("benchmarks/") and rel.endswith(".py"))


def _digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + hashlib.sha256(files[rel]).hexdigest().encode() + b"\n")
    return h.hexdigest()


def source_sha256(root: Path = REPO) -> str:
    """The digest of the source files under ``root`` as they are on disk (tracked or not; git-ignored outputs such
    as ``conf/local/*.yaml`` included where present, as they change what runs)."""
    files = {}
    for top in SOURCES:
        p = root / top
        for f in ([p] if p.is_file() else sorted(p.rglob("*")) if p.is_dir() else []):
            rel = f.relative_to(root).as_posix()
            if f.is_file() and _is_source(rel):
                files[rel] = f.read_bytes()
    return _digest(files)


def commit_sha256(commit: str) -> str:
    """The same digest over the files of ``commit`` (to match a run made from a copy without git metadata)."""
    names = _git("ls-tree", "-r", "--name-only", commit).stdout.split("\n")
    files = {}
    for rel in filter(None, names):
        if _is_source(rel):
            files[rel] = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{rel}"], capture_output=True,
                                        check=True).stdout
    return _digest(files)


def source_state() -> dict:
    """``{"commit", "dirty", "commit_note", "source_sha256"}`` for this checkout, as the script sees it."""
    import os

    head = _git("rev-parse", "HEAD")
    if head.returncode != 0:
        claimed = os.environ.get("PIPELINE_COMMIT") or None
        return {"commit": None, "dirty": None, "commit_claimed": claimed, "source_sha256": source_sha256(),
                "commit_note": "no git checkout here (a copy of the files)"
                               + (f"; its launcher says {claimed} (PIPELINE_COMMIT)" if claimed else "")
                               + ": `python -m benchmarks._provenance --match DIGEST` finds the commit with these "
                                 "files"}
    status = _git("status", "--porcelain", "--untracked-files=normal", "--", *SOURCES).stdout
    dirty = [line[3:] for line in status.splitlines() if _is_source(line[3:].strip())]
    return {"commit": head.stdout.strip(), "dirty": bool(dirty), "source_sha256": source_sha256(),
            "commit_note": f"uncommitted changes in {', '.join(dirty[:5])}{' ...' if len(dirty) > 5 else ''}"
            if dirty else None}


def commit_label(doc: dict, width: int = 10) -> str:
    """A raw JSON's commit as a doc section states it: ``commit_matched`` where :func:`annotate` found the commit a
    lagging copy's files belong to, else the commit the script saw, flagged when its source files differed."""
    seen = str(doc.get("commit") or "?")
    if "+dirty" in seen:  # records of an older form
        return seen + " (uncommitted changes in the tree that ran)"
    dirty = bool(doc.get("dirty"))
    if seen.endswith("-dirty"):  # records of an older form: the mark in the commit
        seen, dirty = seen.removesuffix("-dirty"), True
    if doc.get("commit_matched"):
        return (f"{doc['commit_matched'][:width]} (the files that ran have its source digest; the copy's git "
                f"metadata read {seen[:width]}{' with uncommitted changes' if dirty else ''})")
    return seen[:width] + (" (uncommitted changes)" if dirty else "")


def match(digest: str, max_count: int = 200) -> str | None:
    """The newest of the last ``max_count`` commits whose source files have ``digest``, or None."""
    for commit in _git("rev-list", f"--max-count={max_count}", "HEAD").stdout.split():
        if commit_sha256(commit) == digest:
            return commit
    return None


def annotate(path: Path, note: str | None = None, max_count: int = 200) -> str | None:
    """Add ``commit_matched`` (the commit whose files have the run's ``source_sha256``) to a raw JSON file, beside
    the ``commit`` the script saw, which is left as it is (a copy's git metadata can lag behind its files); with
    ``note``, also a ``note``. -> the matched commit."""
    import json

    doc = json.loads(path.read_text())
    found = match(doc["source_sha256"], max_count) if doc.get("source_sha256") else None
    doc["commit_matched"] = found
    doc["commit_matched_by"] = ("source_sha256 against the last 200 commits "
                                "(python -m benchmarks._provenance --annotate)")
    if note:
        doc["note"] = note
    path.write_text(json.dumps(doc, default=str) + "\n")
    return found


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--match":
        found = match(argv[1])
        if found:
            print(found)
            return 0
        print("no commit of the last 200 has these files (uncommitted code ran)", file=sys.stderr)
        return 1
    if len(argv) in (2, 4) and argv[0] == "--annotate" and (len(argv) == 2 or argv[2] == "--note"):
        found = annotate(Path(argv[1]), argv[3] if len(argv) == 4 else None)
        print(found or "no commit of the last 200 has these files (uncommitted code ran)")
        return 0 if found else 1
    import json

    print(json.dumps(source_state(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
