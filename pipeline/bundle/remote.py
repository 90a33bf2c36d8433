"""The remote store of bundles: publishing to any fsspec destination, its versions and its ``latest`` pointer, and
reading them back.

Published layout: ``<dest>/<model>/<quant>-kv<kv>/<target>/<runtime>/<version>/`` with ``version`` derived from the
publish stage's fingerprint, plus a ``latest`` file naming the newest version that passed every gate. A version is
complete once its ``bundle.json`` exists (it is uploaded last, or, on a local filesystem, the version is renamed into
place whole); every reader treats a version without it as absent. A complete version's content never changes:
republishing it only restores files found missing or damaged.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

from pipeline import store
from pipeline.bundle.manifest import SIGNATURE
from pipeline.errors import StageFailed, UserError, disk_full
from pipeline.identity import ArtifactKey


def published_base(cfg) -> tuple[Any, str]:
    """The filesystem of ``publish.dest`` and the directory of ``cfg``'s entry on it:
    ``<dest>/<model>/<quant>-kv<kv>/<target>/<runtime>``."""
    fs, root = filesystem(str(cfg.publish.dest))
    return fs, f"{root}/{ArtifactKey.of(cfg).publish_prefix}"


def read_published(cfg) -> tuple[str, str | None, bytes | None]:
    """The published bundle of ``cfg``'s entry that readers take (:func:`current_version`): (the entry's directory,
    the version, its raw ``bundle.json``); version and bytes are None when no complete version is published. The
    destination's errors (unreachable, denied, a ``bundle.json`` gone since it was listed) propagate."""
    fs, base = published_base(cfg)
    version = current_version(fs, base)
    if version is None:
        return base, None, None
    return base, version, fs.cat_file(f"{base}/{version}/bundle.json")


def filesystem(url: str):
    """(the fsspec filesystem of ``url``, the path on it without a trailing slash); fresh listings."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise UserError(f"publish.dest={redact(url)}: {exc} (install its fsspec implementation: pip install -e "
                        f"'.[s3]' for s3://, '.[gcs]' for gs://)") from exc
    fs.invalidate_cache()  # listings cached by an earlier call in this process may be stale
    return fs, path.rstrip("/")


OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "abfs", "az", "oss")
_STORE_LIBS = ("botocore", "aiobotocore", "s3fs", "gcsfs", "google", "aiohttp", "adlfs", "azure", "requests",
               "urllib3", "fsspec")


def _is_object_store(fs) -> bool:
    """No directories, no rename: directories are never created (s3fs would create a missing bucket)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return any(p in OBJECT_STORES for p in protocols)


def redact(url: str) -> str:
    """``url`` without credentials embedded in it (``scheme://user:secret@host``)."""
    return re.sub(r"(//)[^/@]+@", r"\1***@", str(url))


def store_error(url: str, doing: str, exc: BaseException) -> UserError | None:
    """A destination's error (OSError, or an error type of s3fs/gcsfs and the clients below them) as one line naming
    the destination and what was being done; None for any other error."""

    module = type(exc).__module__.split(".")[0]
    if not isinstance(exc, OSError) and module not in _STORE_LIBS:
        return None
    if disk_full(exc):
        return None  # a full local disk: the one disk-full mapping (pipeline.errors.known) names it
    text = " ".join(str(exc).split()) or type(exc).__name__
    kind = type(exc).__name__
    # the words of the error, without the URLs and paths it names (a bucket "…1f4018eb" or a port is no HTTP status)
    words = re.sub(r"\S*(://|/)\S*", " ", f"{kind} {text}").lower()
    status = set(re.findall(r"\b[45]\d\d\b", words))
    if isinstance(exc, PermissionError) or status & {"401", "403"} or any(
            w in words for w in ("credential", "accessdenied", "permission", "signature", "invalidaccesskey")):
        hint = "check the credentials in the environment (AWS_* for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://)"
    elif isinstance(exc, FileNotFoundError) or "404" in status or "nosuchbucket" in words or "not found" in words:
        hint = "check that the bucket exists"
    else:
        hint = "check that the endpoint is reachable and the credentials in the environment grant access"
    return UserError(f"{redact(url)}: {doing} failed ({kind}: {text[:300]}); {hint}")


@contextlib.contextmanager
def store_errors(url: str, doing: str) -> Iterator[None]:
    """Map the destination's own error types (see :func:`store_error`) to one clear line (``UserError``)."""
    try:
        yield
    except (UserError, StageFailed):
        raise
    except Exception as exc:
        err = store_error(url, doing, exc)
        if err is None:
            raise
        raise err from exc


def is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _timestamp(info: dict[str, Any]) -> float:
    """An fsspec entry's modification time as a POSIX timestamp (0 when the filesystem reports none)."""
    for key in ("mtime", "LastModified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


def complete_versions(fs, base: str) -> dict[str, float]:
    """{version: when its ``bundle.json`` was written} for the complete versions under ``base``. A version directory
    without ``bundle.json`` (an upload that has not finished) and hidden temp directories are absent."""
    try:
        found = fs.glob(f"{base}/*/bundle.json", detail=True)
    except FileNotFoundError:
        return {}
    versions = {}
    for path, info in found.items():
        version = path.rstrip("/").split("/")[-2]
        if not version.startswith("."):
            versions[version] = _timestamp(info)
    return versions


def current_version(fs, base: str) -> str | None:
    """The complete version ``latest`` names, else the newest complete version; None when there is none. The named
    version is checked by reading its ``bundle.json`` directly, not through a listing (object store listings can lag
    behind writes)."""
    try:
        named = fs.cat_file(f"{base}/latest").decode().strip()
    except FileNotFoundError:
        named = None
    if named and not named.startswith(".") and "/" not in named and fs.exists(f"{base}/{named}/bundle.json"):
        return named
    versions = complete_versions(fs, base)
    return max(versions, key=versions.__getitem__) if versions else None


def _published_manifest(fs, target: str) -> dict[str, Any] | None:
    """The manifest of the version at ``target``, or None when it is absent, incomplete or unreadable."""
    try:
        doc = json.loads(fs.cat_file(f"{target}/bundle.json"))
    except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("files"), list) else None


def sha256(fs, path: str) -> str:
    h = hashlib.sha256()
    with fs.open(path, "rb") as fh:
        while chunk := fh.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _damaged(fs, target: str, files: list[dict[str, Any]], *, local_dest: bool) -> list[dict[str, Any]]:
    """The entries of ``files`` that are missing under ``target`` or differ from their size or sha256. On a local
    filesystem (where uploads keep each file's modification time) only files modified since they were listed are
    hashed; elsewhere every file is."""
    bad = []
    for f in files:
        path = f"{target}/{f['path']}"
        try:
            if local_dest:
                st = os.stat(path)
                size, unchanged = st.st_size, st.st_mtime_ns == f.get("mtime_ns")
            else:
                size, unchanged = fs.size(path), False
            if size != f["size"] or (not unchanged and sha256(fs, path) != f["sha256"]):
                bad.append(f)
        except (FileNotFoundError, IsADirectoryError):
            bad.append(f)
    return bad


def _put(fs, src: Path, dst: str, *, local_dest: bool) -> None:
    """Upload one file. Locally: a read-only copy with the source's modification time, renamed into place."""
    if not local_dest:
        if not _is_object_store(fs):
            fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(src), dst)
        return
    path = Path(dst)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    shutil.copy2(src, tmp)
    os.chmod(tmp, tmp.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))  # published files are read-only
    os.replace(tmp, path)


def _upload_version(fs, local: Path, target: str, files: list[dict[str, Any]], *, local_dest: bool,
                    dirs: list[str] | None = None) -> None:
    """Upload a whole version, ``bundle.json`` last. Locally it is assembled in a hidden sibling directory and renamed
    into place (replacing an incomplete one), so the version appears complete or not at all."""
    extra = [SIGNATURE] if (local / SIGNATURE).is_file() else []  # the signature before bundle.json
    if not local_dest:
        for rel in [f["path"] for f in files] + extra:
            _put(fs, local / rel, f"{target}/{rel}", local_dest=False)
        _put(fs, local / "bundle.json", f"{target}/bundle.json", local_dest=False)  # last: marks the version complete
        return
    final = Path(target)
    store.clean_partials(final)
    _clean_stale_uploads(final.parent)
    tmp = store.new_tmp_dir(final)
    for rel in dirs or []:  # the whole tree, empty directories included
        (tmp / rel).mkdir(parents=True, exist_ok=True)
    for rel in [f["path"] for f in files] + extra:
        _put(fs, local / rel, str(tmp / rel), local_dest=True)
    _put(fs, local / "bundle.json", str(tmp / "bundle.json"), local_dest=True)
    store.commit_dir(tmp, final)


STALE_UPLOAD_S = 24 * 3600


def _clean_stale_uploads(base: Path, max_age_s: float = STALE_UPLOAD_S) -> None:
    """Remove the temp directories of other versions' uploads (``.v<version>.tmp-*``) left by a publisher killed a
    day or more ago, so that the published tree holds only bundles (a killed upload of this version is removed at
    once, under its lock)."""
    cutoff = time.time() - max_age_s
    for p in base.glob(".v*.tmp-*"):
        try:
            if p.is_dir() and p.stat().st_mtime < cutoff:
                shutil.rmtree(p, ignore_errors=True)
        except FileNotFoundError:  # another publisher removed it
            continue


def _publish_version(fs, local: Path, target: str, manifest: dict[str, Any], *,
                     local_dest: bool) -> tuple[int, list[str]]:
    """(files uploaded, paths repaired). A complete version is never rewritten: its files are checked against its
    ``bundle.json`` and a missing or damaged one is uploaded again from this bundle's identical copy."""
    published = _published_manifest(fs, target)
    if published is None:
        _upload_version(fs, local, target, manifest["files"], local_dest=local_dest, dirs=manifest.get("dirs"))
        return len(manifest["files"]) + 1 + (local / SIGNATURE).is_file(), []
    ours = {f["path"]: f["sha256"] for f in manifest["files"]}
    damaged = _damaged(fs, target, published["files"], local_dest=local_dest)
    for f in damaged:
        if ours.get(f["path"]) != f["sha256"]:
            raise StageFailed(f"{target}/{f['path']} is missing or damaged and this bundle has no identical copy to "
                              f"restore it from; remove {target} to publish this version again")
        _put(fs, local / f["path"], f"{target}/{f['path']}", local_dest=local_dest)
    repaired = [f["path"] for f in damaged]
    if (local / SIGNATURE).is_file() and not fs.exists(f"{target}/{SIGNATURE}") and \
            fs.cat_file(f"{target}/bundle.json") == (local / "bundle.json").read_bytes():
        _put(fs, local / SIGNATURE, f"{target}/{SIGNATURE}", local_dest=local_dest)  # a lost signature
        repaired.append(SIGNATURE)
    return len(repaired), repaired


def publish(local: Path, dest: str, *, move_latest: bool, lock_dir: Path | None = None) -> dict[str, Any]:
    """Upload the bundle directory ``local`` to ``dest``; returns where, how many files were uploaded, which files of
    an existing version were repaired, and whether ``latest`` moved.

    Readers treat a version without ``bundle.json`` as absent, and it is always written last. Republishing a
    complete version uploads only the files found missing or damaged (same content: versions stay immutable).
    On a local destination one publisher of a version runs at a time; its lock lives in ``lock_dir`` (the stage
    store; default: ``.locks`` beside the local bundle), never in the published tree."""
    manifest = json.loads((local / "bundle.json").read_text())
    fs, root = filesystem(dest)
    with store_errors(f"publish.dest={dest}", f"publishing {manifest['version']}"):
        return _publish(fs, root, local, dest, manifest, move_latest=move_latest, lock_dir=lock_dir)


def _publish(fs, root: str, local: Path, dest: str, manifest: dict[str, Any], *, move_latest: bool,
             lock_dir: Path | None) -> dict[str, Any]:
    base = f"{root}/{ArtifactKey.of_manifest(manifest).publish_prefix}"
    target = f"{base}/{manifest['version']}"
    if is_local(fs):
        locks = Path(lock_dir) if lock_dir is not None else Path(local).resolve().parent / ".locks"
        name = hashlib.sha256(str(Path(target).resolve()).encode()).hexdigest()[:16]
        with store.locked(locks / f"publish-{manifest['version']}-{name}"):  # one publisher of a version at a time
            uploaded, repaired = _publish_version(fs, local, target, manifest, local_dest=True)
    else:
        uploaded, repaired = _publish_version(fs, local, target, manifest, local_dest=False)
    moved = False
    if move_latest:
        pointer = (manifest["version"] + "\n").encode()
        if _is_object_store(fs):
            fs.pipe_file(f"{base}/latest", pointer)  # one object PUT: readers see the old or the new pointer
        else:
            tmp = f"{base}/.latest-{uuid.uuid4().hex[:8]}"
            fs.pipe_file(tmp, pointer)
            fs.mv(tmp, f"{base}/latest")  # a rename
        moved = True
    return {"url": f"{dest.rstrip('/')}/{ArtifactKey.of_manifest(manifest).publish_prefix}/{manifest['version']}", "uploaded_files": uploaded,
            "repaired": repaired, "latest_moved": moved}


def open_manifest(where: str) -> tuple[Any, str, dict[str, Any]]:
    fs, root = filesystem(where)
    if fs.isfile(root) and root.endswith("bundle.json"):
        root = root.rsplit("/", 1)[0]
    if fs.exists(f"{root}/latest") and not fs.exists(f"{root}/bundle.json"):
        named = fs.cat_file(f"{root}/latest").decode().strip()
        if not fs.exists(f"{root}/{named}/bundle.json"):
            raise UserError(f"{where}: latest names {named}, which has no bundle.json (its upload has not finished); "
                            f"publish it again")
        root = f"{root}/{named}"
    try:
        doc = json.loads(fs.cat_file(f"{root}/bundle.json"))
    except FileNotFoundError as exc:
        raise UserError(f"{where}: no bundle.json there (not a bundle, or a version whose upload has not finished); "
                        f"give a bundle directory or URL") from exc
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}/bundle.json is not valid JSON (damaged bundle)") from exc
    return fs, root, doc
