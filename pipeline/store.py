"""Content hashing, manifests and atomic, locked output directories."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock, Timeout

from pipeline.errors import UserError

MANIFEST = "manifest.json"
_CHUNK = 4 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def digest(obj: Any) -> str:
    return hashlib.sha256(canonical(obj)).hexdigest()


def file_digest_cached(path: Path, cache_dir: Path) -> str:
    """sha256 of a (large, read-only) input file, memoised by (path, size, mtime_ns, inode) under ``cache_dir``."""
    st = path.stat()
    key = digest([str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino])
    memo = cache_dir / "digests" / f"{key}.sha256"
    if memo.is_file():
        return memo.read_text().strip()
    value = sha256_file(path)
    if not cache_dir.is_dir():  # a memo only, kept in a store that exists: planning creates nothing
        return value
    try:  # `plan` on a root it cannot write still plans (build refuses such a root first)
        memo.parent.mkdir(exist_ok=True)
        write_text_atomic(memo, value)
    except OSError:
        pass
    return value


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def list_files(root: Path, known: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every regular file under ``root`` (except the manifest) with size and sha256.

    ``known`` maps a relative path to a sha256 already computed (e.g. a hard-linked upstream file), so it is not read
    again.
    """
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            raise UserError(f"refusing symlink {p} in a stage output: outputs must be self-contained files")
        if not p.is_file() or p.name == MANIFEST and p.parent == root:
            continue
        rel = p.relative_to(root).as_posix()
        sha = (known or {}).get(rel) or sha256_file(p)
        st = p.stat()
        out.append({"path": rel, "size": st.st_size, "sha256": sha, "mtime_ns": st.st_mtime_ns})
    return out


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def content_digest(manifest: dict[str, Any], volatile: tuple[str, ...] = ()) -> str:
    """Digest of a stage output's contents, from its manifest's file list, leaving out ``volatile`` reports."""
    return digest([(f["path"], f["sha256"]) for f in manifest.get("files", []) if f["path"] not in volatile])


def quick_intact(out_dir: Path, manifest: dict[str, Any]) -> str | None:
    """Integrity of a stage output against its manifest: every file present with its size, and any file whose
    modification time changed since the manifest was written is hashed again (a rewrite, truncation or bit flip
    through the filesystem is caught without hashing every file of every cache hit). Returns the first problem."""
    for f in manifest.get("files", []):
        p = out_dir / f["path"]
        try:
            st = p.stat()
        except FileNotFoundError:
            return f"{p} is missing"
        if st.st_size != f["size"]:
            return f"{p} has {st.st_size} bytes, manifest says {f['size']}"
        if f.get("mtime_ns") != st.st_mtime_ns and sha256_file(p) != f["sha256"]:
            return f"{p} does not match its sha256 in the manifest (corrupted)"
    return None


def lock_path(final: Path, lock_dir: Path | None = None) -> Path:
    """Where the lock of ``final`` lives: ``<lock_dir>/<name>-<hash of final's absolute path>.lock`` (the stage
    store's ``locks/``, so that output folders hold only outputs), or ``<final>.lock`` without a ``lock_dir``."""
    if lock_dir is None:
        return Path(str(final) + ".lock")
    key = hashlib.sha256(str(Path(final).resolve()).encode()).hexdigest()[:16]
    return Path(lock_dir) / f"{Path(final).name}-{key}.lock"


@contextlib.contextmanager
def locked(final: Path, *, timeout: float = 6 * 3600, on_wait=None, lock_dir: Path | None = None) -> Iterator[None]:
    """Hold the lock of ``final`` (:func:`lock_path`). Waiting for another process prints once through ``on_wait``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    path = lock_path(final, lock_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if on_wait:
            on_wait(f"waiting for another run that holds {path} (building {final})")
        try:
            lock.acquire(timeout=timeout)
        except Timeout as exc:
            raise UserError(f"timed out after {timeout:.0f}s waiting for {path} (building {final}); is another build "
                            f"stuck?") from exc
    try:
        yield
    finally:
        lock.release()


def clean_partials(final: Path) -> None:
    """Remove temp/old siblings of ``final`` left by a killed run. Call only while holding the lock."""
    for p in final.parent.glob(f".{final.name}.*"):
        if p.name.endswith((".tmp", ".old")) or ".tmp-" in p.name or ".old-" in p.name:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def orphans(roots: list[Path], lock_dir: Path | None = None) -> list[Path]:
    """Temp and swapped-out directories (``.<name>.tmp-*``, ``.<name>.old-*``) under ``roots`` that no running
    build owns, whatever their age: a build writes them only while it holds the lock of ``<name>``
    (:func:`lock_path` in ``lock_dir``), so one whose lock can be taken now was left by a build that was killed."""
    import re

    found = []
    for root in roots:
        if not root.is_dir():
            continue
        for p in root.iterdir():
            m = re.match(r"^\.(.+)\.(?:tmp|old)-", p.name)
            if not m or not p.is_dir():
                continue
            path = lock_path(root / m.group(1), lock_dir)
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(path))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue  # its build is running
            try:
                found.append(p)
            finally:
                lock.release()
    return found


def remove_orphans(roots: list[Path], lock_dir: Path | None = None) -> list[Path]:
    """Remove :func:`orphans`; returns what was removed."""
    gone = orphans(roots, lock_dir)
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def new_tmp_dir(final: Path) -> Path:
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: Path, final: Path) -> None:
    """Rename a finished temp dir into place; an existing (stale or forced) output is swapped out, then removed."""
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:6]}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def link_or_copy(src: Path, dst: Path, *, link: bool = True) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if link:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)


FICLONE = 0x40049409  # linux/fs.h _IOW(0x94, 9, int): share the source's extents, copy-on-write (btrfs, XFS)


def copy_own(src: Path, dst: Path) -> None:
    """A copy of ``src`` that is the pipeline's own: a reflink where the filesystem has one, else a byte copy. Never
    a hard link (a later chmod or in-place edit would reach the other name); the source is only read, and the copy
    takes the source's permission bits with the owner's read and write added (nothing of the source's is changed)."""
    import fcntl
    import stat

    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        try:
            fcntl.ioctl(fo.fileno(), FICLONE, fi.fileno())
        except OSError:
            shutil.copyfileobj(fi, fo, 16 << 20)
    os.chmod(dst, stat.S_IMODE(os.stat(src).st_mode) | stat.S_IRUSR | stat.S_IWUSR)


def link_tree(src: Path, dst: Path, *, link: bool = True, skip_manifest: bool = True) -> dict[str, str]:
    """Hard-link (or copy) every file of ``src`` under ``dst``; returns {relative path: sha256} from src's manifest."""
    manifest = read_manifest(src) or {}
    known = {f["path"]: f["sha256"] for f in manifest.get("files", [])}
    out: dict[str, str] = {}
    for p in sorted(src.rglob("*")):
        if not p.is_file() or (skip_manifest and p.name == MANIFEST and p.parent == src):
            continue
        rel = p.relative_to(src).as_posix()
        link_or_copy(p, dst / rel, link=link)
        if rel in known:
            out[rel] = known[rel]
    return out


def make_read_only(root: Path) -> None:
    """Drop every write bit of the files under ``root`` (hard links share it with the store, which is fine: nothing
    rewrites a stage output in place)."""
    import stat

    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.chmod(p, p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
