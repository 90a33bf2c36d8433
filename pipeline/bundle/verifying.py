"""``verify``: the checks of a bundle, local or published (manifest schema, checksums, the exact tree, Triton
loadability, signature, GPU, runtime or serving image)."""
from __future__ import annotations

import json
from typing import Any

from pipeline.bundle.manifest import SCHEMA, SIGNATURE, BundleManifest
from pipeline.bundle.remote import is_local, open_manifest, sha256, store_errors
from pipeline.bundle.signing import signature_check
from pipeline.errors import UserError


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
    fs, root, doc = open_manifest(where)
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
            sha = sha256(fs, f"{root}/{f['path']}")
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
    out.append(tree_check(doc, files, dirs, local=is_local(fs)))
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
    """Whether Triton can load the bundle's ``triton_repo/``, by the rules `lint` applies
    (:func:`pipeline.triton.lint.repository_problems`): every config parses, every model has a version directory,
    the layout's models agree on decoupled mode and batch sizes, each ensemble agrees with its steps."""
    from pipeline.triton import lint

    pre = "triton_repo/"
    rf = {f[len(pre):] for f in files if f.startswith(pre)}
    rd = {d[len(pre):] for d in dirs if d.startswith(pre)}
    if not rf:
        return ("loadable", False, "no triton_repo/ in the bundle")
    findings = lint.repository_problems(rf, rd, lambda rel: fs.cat_file(f"{root}/{pre}{rel}").decode(errors="replace"))
    if findings:
        return ("loadable", False, "; ".join(f"triton_repo/{f}" for f in findings[:3]))
    models = sorted({f.split("/", 1)[0] for f in rf if f.endswith("/config.pbtxt") and f.count("/") == 1})
    return ("loadable", True, f"{len(models)} models, each with a version directory, every config parses; "
                              f"decoupled mode, batch sizes and the ensemble's steps agree")


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
