"""Bundles for ops: the manifest schema, publishing to any fsspec destination, ``verify`` and ``diff``.

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
import shutil
import stat
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Optional

from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import StageFailed, UserError, disk_full
from pipeline.identity import ArtifactKey
from pipeline.results import Gates

SCHEMA = "llm-pipeline/bundle/v2"


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    size: int
    mtime_ns: Optional[int] = Field(None, description="modification time when listed (local integrity hint)")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    source: str
    revision: Optional[str] = Field(None, description="resolved commit sha for hf:// sources")


class QuantInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Optional[str]
    kv_cache: Optional[str]
    quant_algo: Optional[str]
    kv_cache_quant_algo: Optional[str]
    group_size: Optional[int]
    exclude_modules: Optional[list[str]]
    calibration_sha256: Optional[str]
    # dataset, rows, seq_len, tokens, short and short_reasons of the quantize stage's calibration
    calibration: Optional[dict[str, Any]] = None


class RuntimeVersions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tensorrt_llm: Optional[str] = None
    tensorrt: Optional[str] = None
    cuda: Optional[str] = None
    driver: Optional[str] = None
    torch: Optional[str] = None
    transformers: Optional[str] = None
    container: Optional[str] = Field(None, description="the Triton container tag the bundle is meant for")


class Provenance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pipeline: str
    git_commit: Optional[str]
    host: dict[str, Any]


class BundleManifest(BaseModel):
    """``bundle.json``: what a bundle is, how it was made, how it did, and every file's checksum."""

    model_config = ConfigDict(extra="forbid")
    schema_: str = Field(SCHEMA, alias="schema")
    version: str
    model: ModelInfo
    quant: QuantInfo
    target: dict[str, Any] = Field(description="name, SM, GPU, memory per GPU, GPUs per node")
    runtime: dict[str, Any]
    runtime_versions: RuntimeVersions
    build: dict[str, Any]
    capacity: Optional[dict[str, Any]]
    accuracy: Optional[dict[str, Any]]
    bench: dict[str, Any]
    eval: Optional[dict[str, Any]] = Field(None, description="task accuracy vs the unquantized baseline, per task "
                                           "(the evaluate stage's result)")
    gates: Gates
    lineage: dict[str, str] = Field(description="stage -> fingerprint")
    provenance: Provenance
    files: list[FileEntry]
    recipe: Optional[dict[str, dict[str, Any]]] = Field(
        None, description="stage -> the resolved config that stage ran with (its manifest's config): the whole recipe")
    served_by: Optional[dict[str, Any]] = Field(
        None, description="the server the bench ran on: launcher, binary or image, and the name and version the "
                          "server reported (KServe v2 server metadata)")
    dirs: Optional[list[str]] = Field(None, description="every directory of the bundle (relative, sorted): the tree "
                                                        "verify checks exactly, empty version directories included")


SIGNATURE = "bundle.sig"
KEEP = ".keep"  # an empty file that keeps a directory that must exist but has no files (a model's version directory)
LITTER_DIRS = ("__pycache__",)  # written by a Python process that imported from the tree
LITTER_SUFFIXES = (".pyc", ".pyo")


def is_litter(path: Path, root: Path) -> bool:
    """Whether ``path`` (under ``root``) is run-time litter that never belongs in a bundle: a byte-code cache
    directory or file. The empty ``__pycache__`` *file* the package stage puts beside each model's python files
    (``pipeline.triton.repository.block_bytecode``: it keeps the server from writing byte code) is part of the bundle."""
    parts = path.relative_to(root).parts
    if path.name.endswith(LITTER_SUFFIXES):
        return True
    return any(p in LITTER_DIRS for p in parts[:-1]) or (path.name in LITTER_DIRS and path.is_dir())


def bundle_tree(out: Path, source: Path, rel: str) -> None:
    """Make the bundle's copy ``out/rel`` of the directory ``source`` keep its structure and nothing else: run-time
    litter (``__pycache__``, ``*.pyc``) copied with it is removed, every directory of ``source`` exists (a Triton
    model's empty version directory included: Triton refuses a model without one, "at least one version must be
    available"), and a directory left without files gets an empty ``.keep``, so that every transport keeps it
    (object stores have no directories; ``aws s3 sync`` and fsspec copies carry files only)."""
    dst = out / rel
    for p in sorted(dst.rglob("*"), reverse=True):
        if p.exists() and is_litter(p, dst):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    for d in sorted(source.rglob("*")):
        if d.is_dir() and not is_litter(d, source):
            (dst / d.relative_to(source)).mkdir(parents=True, exist_ok=True)
    for d in [dst, *sorted(dst.rglob("*"))]:
        if d.is_dir() and not any(d.iterdir()):
            (d / KEEP).write_bytes(b"")


def store_dirs(root: Path) -> list[str]:
    """Every directory under ``root``, relative and sorted (what ``bundle.json`` records as ``dirs``)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_dir() and not p.is_symlink())


def sign_problems(sign, *, environment: bool = True) -> list[str]:
    """Plan-time problems of ``publish.sign``: settings a method needs; with ``environment``, also what this machine
    must have (the key files, the password variable, the library)."""
    method = sign.method.value if hasattr(sign.method, "value") else str(sign.method)
    if method == "none":
        return []
    problems = []
    need = {"key": ("private_key",), "certificate": ("private_key", "signing_certificate")}.get(method, ())
    for key in need:
        if not sign.get(key):
            problems.append(f"publish.sign.method={method} needs publish.sign.{key} (a PEM file)")
    if not environment or problems:
        return problems
    try:
        import model_signing  # noqa: F401
    except ImportError:
        problems.append(f"publish.sign.method={method} needs OpenSSF model-signing: pip install -e '.[sign]'")
    for key in need:
        if not Path(str(sign.get(key))).expanduser().is_file():
            problems.append(f"publish.sign.{key}={sign.get(key)}: no such file")
    if method == "certificate":
        for c in sign.certificate_chain or []:
            if not Path(str(c)).expanduser().is_file():
                problems.append(f"publish.sign.certificate_chain: {c}: no such file")
    if sign.get("password_env") and sign.password_env not in os.environ:
        problems.append(f"publish.sign.password_env={sign.password_env}: that environment variable is not set")
    return problems


def sign(bundle_dir: Path, sign_cfg) -> Path | None:
    """Sign ``bundle_dir/bundle.json`` with OpenSSF model_signing (a Sigstore bundle over the file's sha256), writing
    ``bundle.sig`` beside it; None when ``publish.sign.method=none``. bundle.json names every file with its sha256,
    so the signature covers the whole bundle once ``verify`` has checked the files against it."""
    method = sign_cfg.method.value if hasattr(sign_cfg.method, "value") else str(sign_cfg.method)
    if method == "none":
        return None
    problems = sign_problems(sign_cfg)
    if problems:
        raise UserError(problems[0])
    from model_signing import hashing, signing

    expand = lambda v: Path(str(v)).expanduser()  # noqa: E731
    config = signing.Config().set_hashing_config(hashing.Config().use_file_serialization(hashing_algorithm="sha256"))
    password = os.environ.get(sign_cfg.password_env) if sign_cfg.get("password_env") else None
    out = bundle_dir / SIGNATURE
    try:
        if method == "key":
            config.use_elliptic_key_signer(private_key=expand(sign_cfg.private_key), password=password)
        elif method == "certificate":
            config.use_certificate_signer(private_key=expand(sign_cfg.private_key),
                                          signing_certificate=expand(sign_cfg.signing_certificate),
                                          certificate_chain=[expand(c) for c in sign_cfg.certificate_chain or []])
        else:
            config.use_sigstore_signer(use_ambient_credentials=True)
        config.sign(bundle_dir / "bundle.json", out)
    except Exception as exc:  # model_signing and cryptography raise many types for a bad key, password or network
        out.unlink(missing_ok=True)
        raise UserError(f"publish.sign.method={method}: signing failed ({type(exc).__name__}: "
                        f"{(str(exc).splitlines() or [''])[0]}); check the key, its password and certificates") from exc
    return out


def signature_check(fs, root: str, raw_manifest: bytes, *, public_key: str | None = None,
                    certificate_chain: list[str] | None = None,
                    require: bool = False) -> tuple[str, bool | None, str]:
    """The ``signature`` check: ``bundle.sig`` verified over the bundle.json that the checksums were checked against,
    with a public key (method key) or a certificate chain (method certificate)."""
    import tempfile

    try:
        sig = fs.cat_file(f"{root}/{SIGNATURE}")
    except FileNotFoundError:
        if require:
            return ("signature", False, f"bundle is not signed (no {SIGNATURE}) and a signature is required")
        return ("signature", None, f"bundle is not signed (no {SIGNATURE})")
    if not public_key and not certificate_chain:
        return ("signature", False, f"bundle is signed ({SIGNATURE}): give --public-key PEM or --certificate-chain PEM "
                                    f"to check who signed it")
    try:
        from model_signing import verifying
    except ImportError:
        return ("signature", False, "checking bundle.sig needs OpenSSF model-signing: pip install -e '.[sign]'")
    for path in [public_key, *(certificate_chain or [])]:
        if path and not Path(path).expanduser().is_file():
            raise UserError(f"{path}: no such file (a PEM public key or certificate)")
    with tempfile.TemporaryDirectory(prefix="verify-") as tmp:
        (Path(tmp) / "bundle.json").write_bytes(raw_manifest)
        (Path(tmp) / SIGNATURE).write_bytes(sig)
        config = verifying.Config()
        if public_key:
            config.use_elliptic_key_verifier(public_key=Path(public_key).expanduser())
            how = f"public key {Path(public_key).name}"
        else:
            config.use_certificate_verifier(certificate_chain=[Path(c).expanduser() for c in certificate_chain])
            how = "certificate chain " + ", ".join(Path(c).name for c in certificate_chain)
        try:
            config.verify(Path(tmp) / "bundle.json", Path(tmp) / SIGNATURE)
        except Exception as exc:  # model_signing raises ValueError and sigstore/cryptography errors
            why = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
            if "Signature mismatch" in why or "Hash mismatch" in why:
                why = "bundle.json does not match the signed digest (edited after signing)"
            return ("signature", False, f"{SIGNATURE} does not verify bundle.json with the {how}: {why}")
    return ("signature", True, f"{SIGNATURE} verifies bundle.json with the {how}")


def schema_json() -> str:
    return json.dumps(BundleManifest.model_json_schema(by_alias=True), indent=2) + "\n"


def published_base(cfg) -> tuple[Any, str]:
    """The filesystem of ``publish.dest`` and the directory of ``cfg``'s entry on it:
    ``<dest>/<model>/<quant>-kv<kv>/<target>/<runtime>``."""
    fs, root = _fs(str(cfg.publish.dest))
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


def _fs(url: str):
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
    import re

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
    low = f"{kind} {text}".lower()
    if "credential" in low or "accessdenied" in low or "permission" in low or "403" in low or "401" in low \
            or "signature" in low or "invalidaccesskey" in low:
        hint = "check the credentials in the environment (AWS_* for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://)"
    elif isinstance(exc, FileNotFoundError) or "nosuchbucket" in low or "not found" in low or "404" in low:
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


def _is_local(fs) -> bool:
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


def _sha256(fs, path: str) -> str:
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
            if size != f["size"] or (not unchanged and _sha256(fs, path) != f["sha256"]):
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
    from pipeline import store

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
    import time

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
    fs, root = _fs(dest)
    with store_errors(f"publish.dest={dest}", f"publishing {manifest['version']}"):
        return _publish(fs, root, local, dest, manifest, move_latest=move_latest, lock_dir=lock_dir)


def _publish(fs, root: str, local: Path, dest: str, manifest: dict[str, Any], *, move_latest: bool,
             lock_dir: Path | None) -> dict[str, Any]:
    base = f"{root}/{ArtifactKey.of_manifest(manifest).publish_prefix}"
    target = f"{base}/{manifest['version']}"
    if _is_local(fs):
        from pipeline import store

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


def _open_manifest(where: str) -> tuple[Any, str, dict[str, Any]]:
    fs, root = _fs(where)
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


def verify(where: str, *, container: str | None = None, public_key: str | None = None,
           certificate_chain: list[str] | None = None,
           require_signature: bool = False) -> list[tuple[str, bool | None, str]]:
    """Checks of a bundle, each (name, ok: True/False/None for not applicable, message)."""
    with store_errors(where, "reading the bundle"):
        return _verify(where, container=container, public_key=public_key, certificate_chain=certificate_chain,
                       require_signature=require_signature)


def _verify(where: str, *, container: str | None, public_key: str | None, certificate_chain: list[str] | None,
            require_signature: bool) -> list[tuple[str, bool | None, str]]:
    from pipeline import hardware
    from pipeline.runtime import trtllm

    if container:
        from pipeline import upstream

        pairs = upstream.container_pairs()
        if container not in pairs:  # before any hashing: a usage error
            raise UserError(f"--container {container}: not a recorded serving image; recorded: {', '.join(pairs)}")
    fs, root, doc = _open_manifest(where)
    raw = fs.cat_file(f"{root}/bundle.json")  # the bytes every check below reads, signature included
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}/bundle.json is not valid JSON (damaged bundle)") from exc
    out: list[tuple[str, bool | None, str]] = []
    try:
        BundleManifest.model_validate(doc)
        out.append(("manifest", True, f"bundle.json matches schema {SCHEMA}"))
    except Exception as exc:
        out.append(("manifest", False, f"bundle.json does not match the schema: {str(exc).splitlines()[0]}"))
    bad = []
    for f in doc.get("files", []):
        try:
            sha = _sha256(fs, f"{root}/{f['path']}")
        except FileNotFoundError:
            bad.append(f"{f['path']} is missing")
            continue
        except IsADirectoryError:  # e.g. the python backend's __pycache__ where the package stage put its block file
            bad.append(f"{f['path']} is a directory; the manifest lists a file")
            continue
        if sha != f["sha256"]:
            bad.append(f"{f['path']} has sha256 {sha[:12]}…, the manifest says {f['sha256'][:12]}…")
    n = len(doc.get("files", []))
    if n == 0:  # nothing compared is no pass
        bad.append("bundle.json lists no files, so nothing was checked (a damaged or hand-made manifest)")
    out.append(("checksums", not bad, f"{n} files match their sha256" if not bad else "; ".join(bad[:5])))
    files, dirs = _tree(fs, root)
    out.append(tree_check(doc, files, dirs, local=_is_local(fs)))
    out.append(loadability_check(fs, root, files, dirs))
    out.append(signature_check(fs, root, raw, public_key=public_key, certificate_chain=certificate_chain,
                               require=require_signature))
    t = doc.get("target", {})
    if t.get("device") != "cuda":
        out.append(("gpu", None, f"target {t.get('name')} needs no GPU"))
    else:
        gpu = hardware.local_gpu()
        if gpu is None:
            out.append(("gpu", False, f"bundle is for sm{t.get('sm')} ({t.get('name')}); this machine has no GPU"))
        else:
            ok = gpu["sm"] == int(t.get("sm", -1))
            out.append(("gpu", ok, f"bundle sm{t.get('sm')} {'=' if ok else '≠'} local {gpu['name']} (sm{gpu['sm']})"))
    want = doc.get("runtime_versions", {})
    if doc.get("runtime", {}).get("name") == "reference":
        out.append(("runtime", None, "reference runtime: no TensorRT-LLM needed"))
    elif container:
        out.append(container_check(want, container))
    else:
        info = trtllm.detect()
        if info.version is None:
            out.append(("runtime", False, f"bundle needs TensorRT-LLM {want.get('tensorrt_llm')}; none installed here "
                                          f"(give --container TAG to check against a serving image)"))
        else:
            ok = info.version == want.get("tensorrt_llm") and (not want.get("tensorrt") or
                                                                 info.tensorrt == want.get("tensorrt"))
            out.append(("runtime", ok, f"bundle TensorRT-LLM {want.get('tensorrt_llm')}/TensorRT {want.get('tensorrt')}"
                                       f"; installed {info.version}/{info.tensorrt}"))
    return out


def _tree(fs, root: str) -> tuple[set[str], set[str]]:
    """(files, directories) under a bundle root, relative POSIX paths. On an object store a directory is any key
    prefix (it has no others)."""
    files, dirs = set(), set()
    base = root.rstrip("/")
    for path, info in fs.find(base, withdirs=True, detail=True).items():
        rel = path.rstrip("/")[len(base):].lstrip("/")
        if not rel:
            continue
        (dirs if info.get("type") == "directory" else files).add(rel)
    for f in list(files):  # every parent of a file is a directory (object stores list only some)
        parts = f.split("/")[:-1]
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return files, dirs


def _topmost(paths: set[str]) -> list[str]:
    """The paths of ``paths`` that lie under no other one of them."""
    return sorted(p for p in paths if not any(p.startswith(f"{q}/") for q in paths))


def tree_check(doc: dict[str, Any], files: set[str], dirs: set[str], *, local: bool) -> tuple[str, bool, str]:
    """The bundle's tree against its manifest, exactly: every file and directory ``bundle.json`` lists and nothing
    else (an added, removed or renamed file or directory fails, named): byte code written into it (a ``__pycache__``
    directory) fails it too, since serving a bundle leaves it byte-identical. Besides the listed files a bundle holds
    ``bundle.json``, ``bundle.sig``, and in the local stage store its ``manifest.json``. A manifest without ``dirs``
    (older bundles) lists its directories through its files' parents."""
    want = {f["path"] for f in doc.get("files", [])}
    allowed = {"bundle.json", SIGNATURE} | ({"manifest.json"} if local else set())
    want_dirs = set(doc["dirs"]) if isinstance(doc.get("dirs"), list) else \
        {"/".join(p.split("/")[:i]) for p in want for i in range(1, p.count("/") + 1)}
    gone, added = _topmost(want_dirs - dirs), _topmost(dirs - want_dirs)
    problems = []
    for d in list(gone):
        parent = d.rsplit("/", 1)[0] if "/" in d else ""
        twin = next((e for e in added if (e.rsplit("/", 1)[0] if "/" in e else "") == parent), None)
        if twin is not None:  # one directory gone and one added beside it: a rename
            problems.append(f"directory {d}/ was renamed to {twin}/")
            added.remove(twin)
        else:
            problems.append(f"directory {d}/ is missing")
    problems += [f"directory {e}/ is not in the manifest" for e in added]
    under = lambda p, tops: any(p.startswith(f"{t}/") for t in tops)  # noqa: E731
    problems += [f"{p} is missing" for p in sorted(want - files) if not under(p, gone)]
    problems += [f"{p} is not in the manifest" for p in sorted(files - want - allowed)
                 if not under(p, _topmost(dirs - want_dirs))]
    if problems:
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        return ("tree", False, "; ".join(problems[:6]) + more)
    return ("tree", True, f"{len(want)} files and {len(want_dirs)} directories, exactly as listed")


def loadability_check(fs, root: str, files: set[str], dirs: set[str]) -> tuple[str, bool | None, str]:
    """Whether Triton can load the bundle's ``triton_repo/`` (:func:`pipeline.triton.lint.loadability`): every model
    has a version directory, the layout's models agree on decoupled mode and batch sizes."""
    from pipeline.triton import lint

    pre = "triton_repo/"
    rf = {f[len(pre):] for f in files if f.startswith(pre)}
    rd = {d[len(pre):] for d in dirs if d.startswith(pre)}
    if not rf:
        return ("loadable", False, "no triton_repo/ in the bundle")
    findings = lint.loadability(rf, rd, lambda rel: fs.cat_file(f"{root}/{pre}{rel}").decode(errors="replace"))
    if findings:
        return ("loadable", False, "; ".join(f"triton_repo/{f}" for f in findings[:3]))
    models = sorted({f.split("/", 1)[0] for f in rf if f.endswith("/config.pbtxt") and f.count("/") == 1})
    return ("loadable", True, f"{len(models)} models, each with a version directory; decoupled mode and batch "
                              f"sizes agree")


def _same_version(a: str | None, b: str | None) -> bool:
    """Equal versions, where one may carry fewer components (TensorRT 10.13.3 is 10.13.3.9)."""
    if not a or not b:
        return False
    x, y = str(a).split("."), str(b).split(".")
    n = min(len(x), len(y))
    return n >= 2 and x[:n] == y[:n]


def container_check(want: dict[str, Any], container: str) -> tuple[str, bool, str]:
    """The ``runtime`` check against a serving image: the image's TensorRT-LLM and TensorRT versions, from the
    recorded container pairs (NVIDIA's Release Compatibility Matrix), against the versions the bundle was built
    with. An image not in the record is a usage error naming the recorded ones."""
    from pipeline import upstream

    pairs = upstream.container_pairs()
    if container not in pairs:
        raise UserError(f"--container {container}: not a recorded serving image; recorded: {', '.join(pairs)}")
    have = pairs[container]
    built, trt = want.get("tensorrt_llm"), want.get("tensorrt")
    if not built and want.get("container") in pairs:  # versions not recorded: the image it was built for
        built, trt = pairs[want["container"]]["trtllm"], pairs[want["container"]]["tensorrt"]
    if not built:
        return ("runtime", False, f"bundle records no TensorRT-LLM version; cannot check it against {container} "
                                  f"(TensorRT-LLM {have['trtllm']})")
    problems = []
    if str(built) != have["trtllm"]:
        problems.append(f"TensorRT-LLM {built} ≠ {have['trtllm']}")
    if trt and not _same_version(trt, have["tensorrt"]):
        problems.append(f"TensorRT {trt} ≠ {have['tensorrt']}")
    what = f"bundle TensorRT-LLM {built}/TensorRT {trt or '?'}; {container} has {have['trtllm']}/{have['tensorrt']}"
    return ("runtime", not problems, what if not problems else f"{'; '.join(problems)} ({what})")


def _get(d: dict[str, Any], *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


UNCOMPARED = ("paths.", "publish.dest", "publish.link", "publish.sign", "publish.move_latest")  # where, not what


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"a.b.c": value}``."""
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def recipe_settings(doc: dict[str, Any]) -> dict[str, Any]:
    """A bundle's recorded recipe (``recipe``: each stage's resolved config) as one flat ``key -> value`` map
    (every stage reads one config: a key has one value); paths and the destination are left out. Empty for a
    bundle that records no recipe."""
    out: dict[str, Any] = {}
    for cfg in (doc.get("recipe") or {}).values():
        out.update(flatten(cfg))
    return {k: v for k, v in out.items() if not k.startswith(UNCOMPARED)}


def serving_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``pipeline diff``'s rows for the serving plan each bundle records (``capacity.serving``,
    pipeline/serving_plan.py): every serving setting, the profile's TP and batch, and the predicted figures of the
    typical request at the chosen KV dtype with the tables' TensorRT-LLM version and the model's version."""
    sa, sb = _get(a, "capacity", "serving") or {}, _get(b, "capacity", "serving") or {}
    rows: list[tuple[str, Any, Any]] = []
    names = list(dict.fromkeys([*(sa.get("settings") or {}), *(sb.get("settings") or {})]))
    for n in names:
        rows.append((f"serving {n}", _get(sa, "settings", n, "value"), _get(sb, "settings", n, "value")))
    for key in ("tp", "batch"):
        rows.append((f"profile {key}", _get(sa, "profile", "chosen", key), _get(sb, "profile", "chosen", key)))

    def typical(s: dict[str, Any]) -> dict[str, Any]:
        w = _get(s, "predictions", "workloads", "typical") or {}
        return next((v for k, v in w.items() if k.startswith("kv_")), {}) or {}

    ta, tb = typical(sa), typical(sb)
    for key in ("ttft_ms", "tpot_ms", "tokens_per_s_per_gpu", "memory_gb"):
        rows.append((f"predicted {key}", ta.get(key), tb.get(key)))
    rows.append(("predicted from TensorRT-LLM tables", _get(sa, "predictions", "trtllm_tables"),
                 _get(sb, "predictions", "trtllm_tables")))
    rows.append(("performance model", sa.get("model"), sb.get("model")))
    return rows


def diff(old: str, new: str) -> str:
    """A Markdown table of what changed between two bundles: the config first (the recipe of every stage), then
    the server benched on, size, accuracy, bench, versions."""
    with store_errors(old, "reading the bundle"):
        _, _, a = _open_manifest(old)
    with store_errors(new, "reading the bundle"):
        _, _, b = _open_manifest(new)
    rows: list[tuple[str, Any, Any]] = [("version", a.get("version"), b.get("version"))]
    ca, cb = recipe_settings(a), recipe_settings(b)
    for key in sorted(set(ca) | set(cb)):  # first: why two versions differ
        rows.append((f"config {key}", ca.get(key), cb.get(key)))
    sa, sb = a.get("served_by") or {}, b.get("served_by") or {}
    for key in ("launcher", "binary", "image", "version"):
        rows.append((f"server {key}", sa.get(key), sb.get(key)))
    rows += serving_rows(a, b)
    rows += [
        ("bytes", sum(f["size"] for f in a.get("files", [])), sum(f["size"] for f in b.get("files", []))),
        ("quant_algo", _get(a, "quant", "quant_algo"), _get(b, "quant", "quant_algo")),
        ("kv_cache_quant_algo", _get(a, "quant", "kv_cache_quant_algo"), _get(b, "quant", "kv_cache_quant_algo")),
    ]
    for key in ("kl_mean", "top1_agreement", "ppl_ratio"):
        rows.append((f"accuracy {key}", _get(a, "accuracy", "quantized_vs_unquantized", key),
                     _get(b, "accuracy", "quantized_vs_unquantized", key)))
    for w in sorted(set(_get(a, "bench", "workloads") or {}) | set(_get(b, "bench", "workloads") or {})):
        old_rows = {r["concurrency"]: r for r in _get(a, "bench", "workloads", w) or []}
        new_rows = {r["concurrency"]: r for r in _get(b, "bench", "workloads", w) or []}
        for c in sorted(set(old_rows) | set(new_rows)):
            for key in ("ttft_p50_ms", "latency_p95_ms", "output_tokens_per_s"):
                rows.append((f"{w} c={c} {key}", (old_rows.get(c) or {}).get(key), (new_rows.get(c) or {}).get(key)))
    for task in sorted(set(_get(a, "eval", "tasks") or {}) | set(_get(b, "eval", "tasks") or {})):
        for key in ("baseline", "quantized", "difference", "ci_low", "items", "verdict"):
            rows.append((f"task {task} {key}", _get(a, "eval", "tasks", task, key), _get(b, "eval", "tasks", task, key)))
    rows.append(("lm-eval version", _get(a, "eval", "lm_eval"), _get(b, "eval", "lm_eval")))
    for key in ("tensorrt_llm", "tensorrt", "cuda", "driver", "torch", "transformers", "container"):
        rows.append((f"{key} version", _get(a, "runtime_versions", key), _get(b, "runtime_versions", key)))
    rows.append(("pipeline", _get(a, "provenance", "pipeline"), _get(b, "provenance", "pipeline")))
    lines = ["| field | old | new | change |", "|---|---|---|---|"]
    for name, o, n in rows:
        if o == n:
            continue
        change = ""
        if isinstance(o, (int, float)) and isinstance(n, (int, float)) and o and not name.startswith("config "):
            change = f"{100 * (n / o - 1):+.1f}%"
        fmt = lambda v: "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
        lines.append(f"| {name} | {fmt(o)} | {fmt(n)} | {change} |")
    if len(lines) == 2:
        lines.append("| (no differences) | | | |")
    return "\n".join(lines) + "\n"
