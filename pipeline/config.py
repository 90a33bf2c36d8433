"""Compose, validate and slice the Hydra config. Every config problem becomes a :class:`UserError` with one line."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from pathlib import Path
from typing import Any, Iterable, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline import schema
from pipeline.catalog import STAGE_NAMES
from pipeline.errors import UserError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUP_NAMES = tuple(schema.GROUPS)


def conf_dir() -> Path:
    if not (CONF_DIR / "config.yaml").is_file():
        raise UserError(f"config directory {CONF_DIR} not found; run from a checkout installed with `pip install -e .`")
    return CONF_DIR


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def shipped_targets() -> dict[str, dict]:
    """Every shipped target (``conf/target/*.yaml`` but ``auto``): name -> its yaml (read again when a file of the
    folder changed: every command composes through it, a test session hundreds of times)."""
    import copy

    files = sorted((conf_dir() / "target").glob("*.yaml"))
    key = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if _TARGETS.get("key") != key:
        _TARGETS.update(key=key, targets={p.stem: OmegaConf.to_container(OmegaConf.load(p)) or {}
                                          for p in files if p.stem != "auto"})
    return copy.deepcopy(_TARGETS["targets"])


_TARGETS: dict[str, Any] = {}


def _first_line(text: str) -> str:
    return " ".join(str(text).strip().splitlines()[0].split()) if str(text).strip() else str(text)


def _schema_keys(full_key: str) -> list[str] | None:
    """Valid keys of the node that holds ``full_key`` (e.g. ``build.foo`` -> fields of BuildSettings)."""
    node: Any = schema.PipelineConfig
    for part in full_key.split(".")[:-1]:
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return None
        node = _field_type(node, part)
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else None


@functools.lru_cache(maxsize=None)
def _hints(owner: type) -> dict[str, Any]:
    """The schema dataclass's resolved field types (static: ``validate`` reads them for every composed config)."""
    import typing

    return typing.get_type_hints(owner)


def _field_type(owner: type, name: str) -> Any:
    import typing

    hint = _hints(owner)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def explain(exc: BaseException) -> str:
    """Turn a Hydra/OmegaConf composition error into one actionable line."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(exc, MissingConfigException):
        missing = exc.missing_cfg_file or ""
        group, _, option = missing.rpartition("/")
        if group in GROUP_NAMES:
            return f"unknown {group} '{option}'; choose one of: {', '.join(group_options(group))}"
        return _first_line(exc)
    if isinstance(exc, OverrideParseException):
        return f"cannot parse override: {_first_line(exc)}"
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", "") or ""
        msg = _first_line(getattr(cause, "msg", None) or str(cause))
        if "not in" in msg and key:
            valid = _schema_keys(key)
            hint = f"; valid keys: {', '.join(valid)}" if valid else ""
            return f"unknown config key '{key}'{hint}"
        if msg.startswith("Invalid value") and key:
            if key == "quant.kv_cache":
                value = msg.split("'")[1] if msg.count("'") >= 2 else ""
                refused = schema.unserved_kv_preset(value)
                if refused:
                    return refused
            return f"{key}: {msg[0].lower()}{msg[1:]}"
        if key:
            return f"{key}: {msg}"
        return msg
    return _first_line(exc)


def compose(overrides: Iterable[str] = ()) -> DictConfig:
    """Compose the root config with Hydra overrides, as given, and validate it. Raises UserError with one line.
    ``target``/``runtime`` ``auto`` stay the groups' placeholders: :func:`pipeline.hardware.compose` makes them this
    machine's first (what every command does)."""
    result = compose_many([list(overrides)])[0]
    if isinstance(result, UserError):
        raise result
    return result


def compose_many(jobs: list[list[str]]) -> list[DictConfig | UserError]:
    """Compose several override lists, as given, under one Hydra initialisation (``validate`` composes hundreds)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton

    schema.register()
    out: list[DictConfig | UserError] = []
    # Called inside a running Hydra app too (launchers): put Hydra's global state back afterwards.
    saved = Singleton.get_state() if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"), _lazy_interpolation_map():
            _share_config_files(GlobalHydra.instance())
            for job in jobs:
                try:
                    cfg = hydra_compose(config_name="config", overrides=list(job))
                except UserError as exc:
                    out.append(exc)
                    continue
                except Exception as exc:  # hydra wraps everything; translate to one line
                    err = UserError(explain(exc))
                    err.__cause__ = exc
                    out.append(err)
                    continue
                from pipeline import own_model

                problems = own_model.adopt(cfg, own_model.group_of(job, conf_dir()), conf_dir(), job) or validate(cfg)
                if problems:
                    out.append(UserError(problems[0] if len(problems) == 1 else
                                         f"{len(problems)} config problems: " + "; ".join(problems),
                                         problems=problems))
                else:
                    out.append(cfg)
    finally:
        GlobalHydra.instance().clear()
        if saved is not None:
            Singleton.set_state(saved)
    return out


@contextlib.contextmanager
def _lazy_interpolation_map() -> Iterator[None]:
    """Hydra builds the map that resolves interpolated defaults (``- db: ${group}``) for every node of the defaults
    tree, a fresh OmegaConf object each time, and reads it only where a default of that node is an interpolation;
    none of the project's are. While composing, it is built only where a node has one (about a sixth of
    ``validate``'s time otherwise); Hydra's own function builds it, unchanged. A Hydra without the function composes
    as it always does."""
    from hydra._internal import defaults_list as dl

    original = getattr(dl, "_create_interpolation_map", None)
    if original is None:
        yield
        return

    def only_where_read(overrides: Any, defaults: list[Any], self_added: bool) -> Any:
        if any(not d.is_self() and d.is_interpolation() for d in defaults):
            return original(overrides, defaults, self_added)
        return None  # no interpolated child reads it

    dl._create_interpolation_map = only_where_read
    try:
        yield
    finally:
        dl._create_interpolation_map = original


# What the composes of this process have read, while the config directory is as it was (``_conf_snapshot``): a
# command composes once, a test session or a sweep's checks many times
_FILES: dict[str, Any] = {"snapshot": None, "files": {}, "search_path": None}


def _conf_snapshot() -> tuple:
    """The config directory's files with their sizes and modification times (a changed file reads anew)."""
    root = conf_dir()
    out = []
    for p in sorted(root.rglob("*")):
        try:
            st = p.stat()
        except OSError:
            continue
        out.append((str(p.relative_to(root)), st.st_size, st.st_mtime_ns))
    return (str(root), tuple(out))


def _share_config_files(global_hydra: Any) -> None:
    """Let the composes of this process read each config file once (while the config directory is unchanged).

    Hydra gives every compose a fresh ``CachingConfigRepository`` (a deep copy of the file repository, an empty cache),
    so each of ``validate``'s hundreds of composes re-reads and re-parses the same YAML files. Here the files' loaded
    results are kept across composes, and each compose gets deep copies of them (Hydra merges the loaded nodes into its
    result without copying them), so every compose is exactly Hydra's own (tests/unit/test_config.py compares them).
    A Hydra whose loader lacks the hook composes as it always does."""
    import copy

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.config_repository import CachingConfigRepository
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = getattr(getattr(global_hydra, "hydra", None), "config_loader", None)
    if not isinstance(loader, ConfigLoaderImpl) or not hasattr(loader, "_process_config_searchpath"):
        return
    snapshot = _conf_snapshot()
    if _FILES["snapshot"] != snapshot:  # a config file written, added or removed since: read them again
        _FILES.update(snapshot=snapshot, files={}, search_path=None)
    shared = _FILES
    delegate = copy.deepcopy(loader.repository)

    class SharedFiles(CachingConfigRepository):
        def __init__(self) -> None:  # the one delegate; this compose's own cache, as Hydra's
            self.delegate = delegate
            self.cache = {}

        def initialize_sources(self, config_search_path: Any) -> None:
            key = repr([(p.provider, p.path) for p in config_search_path.get_path()])
            if key != shared["search_path"]:  # another search path: other files
                shared["files"].clear()
                shared["search_path"] = key
            super().initialize_sources(config_search_path)

        def load_config(self, config_path: str) -> Any:
            if config_path not in self.cache:
                files = shared["files"]
                if config_path not in files:
                    files[config_path] = self.delegate.load_config(config_path=config_path)
                self.cache[config_path] = copy.deepcopy(files[config_path])
            return self.cache[config_path]

    def parse_overrides_and_create_caching_repo(config_name: Any, overrides: list[str]) -> Any:
        parsed = OverridesParser.create().parse_overrides(overrides=overrides)
        repo = SharedFiles()
        loader._process_config_searchpath(config_name, parsed, repo)
        return parsed, repo

    loader._parse_overrides_and_create_caching_repo = parse_overrides_and_create_caching_repo


def expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """Expand multirun sweep overrides (``quant=fp8,none``) into one override list per job, as BasicSweeper does."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:
        raise UserError(explain(exc)) from exc
    batches = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for batch in batches for job in batch]


def _unknown_keys(node: Any, owner: type, prefix: str) -> list[str]:
    """Keys the schema does not know, e.g. added with ``+build.foo=1`` (Hydra lets ``+`` add keys to any node)."""
    if not isinstance(node, DictConfig) or not dataclasses.is_dataclass(owner):
        return []
    fields = [f.name for f in dataclasses.fields(owner)]
    problems = []
    for key in node.keys():
        full = f"{prefix}{key}"
        if key not in fields:
            problems.append(f"unknown config key '{full}'; valid keys: {', '.join(fields)}")
        else:
            problems.extend(_unknown_keys(node._get_node(key), _field_type(owner, str(key)), f"{full}."))
    return problems


def _unresolvable_key(node: Any, prefix: str = "") -> str | None:
    """The first key under ``node`` whose value cannot be resolved, or None."""
    if not isinstance(node, (DictConfig, ListConfig)):
        return None
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        full = f"{prefix}{key}" if isinstance(node, DictConfig) else f"{prefix.rstrip('.')}[{key}]"
        try:
            child = node[key]
        except OmegaConfBaseException:
            return full
        found = _unresolvable_key(child, f"{full}.")
        if found:
            return found
    return None


def validate(cfg: DictConfig) -> list[str]:
    """Every problem with a composed config, at once: missing values, ranges, stage names, resolution."""
    problems: list[str] = []
    unset = _workload_problems(cfg, sizes_only=True)
    if unset:  # the rest of the checks would resolve them
        return unset
    try:  # one plain, resolved copy: the checks below read it rather than walking OmegaConf nodes (many times faster)
        plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except Exception as exc:  # the checks below would read the unresolvable value: this problem alone
        key = _unresolvable_key(cfg)
        why = explain(exc)
        why = why[len(key) + 2:] if key and why.startswith(f"{key}: ") else why  # the key is named once
        return [f"cannot resolve config{f' key {key}' if key else ''}: {why}; an interpolation "
                f"${{...}} must name a config key that exists (e.g. ${{build.max_seq_len}})"]
    problems.extend(_unknown_keys(cfg, schema.PipelineConfig, ""))
    missing = [f"{key} is required but not set" for key in _missing_keys(plain)]
    if missing:  # the checks below would read the missing values
        return missing + problems
    for group, node_type in schema.GROUPS.items():
        problems.extend(_check_ranges(plain.get(group), node_type, group))
    if cfg.until is not None and cfg.until not in STAGE_NAMES:
        problems.append(f"until: unknown stage '{cfg.until}'; choose one of: {', '.join(STAGE_NAMES)}")
    for name in cfg.force:
        if name not in STAGE_NAMES:
            problems.append(f"force: unknown stage '{name}'; choose from: {', '.join(STAGE_NAMES)}")
    conc = list(cfg.bench.concurrency)
    if not conc or any(int(c) < 1 or int(c) > 4096 for c in conc):
        problems.append(f"bench.concurrency={conc} is out of range: give a non-empty list of integers in [1, 4096]")
    b = cfg.build
    if b.max_input_len and b.max_seq_len and b.max_input_len >= b.max_seq_len:
        problems.append(f"build.max_input_len={b.max_input_len} must be below build.max_seq_len={b.max_seq_len}")
    problems.extend(_workload_problems(cfg))
    if cfg.serve.launcher.value == "external" and not cfg.serve.url:
        problems.append("serve.launcher=external needs serve.url=HOST:GRPC_PORT of a running Triton server")
    bs = str(cfg.quant.calib.batch_size)
    if bs != "auto" and not (bs.isdigit() and 1 <= int(bs) <= 4096):
        problems.append(f"quant.calib.batch_size={bs} is invalid: give 'auto' or an integer in [1, 4096]")
    import re

    safe = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    for key in ("model.name", "target.name"):
        value = str(OmegaConf.select(cfg, key))
        if not safe.match(value) or ".." in value:
            problems.append(f"{key}={value!r} is not a safe name: use letters, digits, '.', '_' and '-' (it names "
                            f"output directories)")
    if cfg.model.source == "synthetic" and cfg.model.synthetic is None:
        problems.append("model.synthetic must be set when model.source=synthetic")
    return problems


def _workload_problems(cfg: DictConfig, *, sizes_only: bool = False) -> list[str]:
    """``bench.only`` names known workloads; every workload has its sizes for the target device."""
    problems: list[str] = []
    known = list(cfg.bench.workloads)
    for w in (cfg.bench.only if cfg.bench.only is not None else []):
        if w not in known:
            problems.append(f"bench.only: unknown workload '{w}'; choose from: {', '.join(known)} "
                            f"(or add it under bench.workloads)")
    if not known or cfg.bench.only == []:
        problems.append("bench: no workload to run; give bench.workloads at least one entry and bench.only a "
                        "non-empty list (or null)")
    for w in known:
        node = cfg.bench.workloads[w]
        for key in ("prompt_words", "max_tokens"):
            try:
                node[key]
            except OmegaConfBaseException:
                problems.append(f"bench.workloads.{w}.{key} is not set for target.device={cfg.target.device.value}: "
                                f"give bench.workloads.{w}.{key} or bench.workloads.{w}.by_device."
                                f"{cfg.target.device.value}.{key}")
    return [p for p in problems if "is not set for" in p] if sizes_only else problems


def _missing_keys(node: Any, prefix: str = "") -> list[str]:
    """The keys whose value is missing (``???``) in a plain container, named as ``OmegaConf.missing_keys`` names
    them (``a.b``, ``a.l[0]``)."""
    out: list[str] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        full = f"{prefix}.{key}".lstrip(".") if isinstance(node, dict) else f"{prefix}[{key}]"
        if isinstance(value, str) and value == "???":
            out.append(full)
        else:
            out.extend(_missing_keys(value, full))
    return out


def _check_ranges(node: Any, node_type: type, prefix: str) -> list[str]:
    """Range problems of a plain (resolved) container against the schema dataclass's ``min``/``max`` metadata."""
    out: list[str] = []
    if not isinstance(node, dict) or not dataclasses.is_dataclass(node_type):
        return out
    for f in dataclasses.fields(node_type):
        key = f"{prefix}.{f.name}"
        value = node.get(f.name)
        if isinstance(value, str) and value == "???":
            continue
        lo, hi = f.metadata.get("min"), f.metadata.get("max")
        if (lo is not None or hi is not None) and isinstance(value, (int, float)) and not isinstance(value, bool):
            derived = f.metadata.get("zero_derives") and value == 0  # 0: the serving plan derives the value
            if not derived and ((lo is not None and value < lo) or (hi is not None and value > hi)):
                bounds = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
                if f.metadata.get("zero_derives"):
                    bounds += ", or 0 to derive it"
                out.append(f"{key}={value} is out of range: must be {bounds}")
        sub = _field_type(node_type, f.name)
        if dataclasses.is_dataclass(sub) and isinstance(value, dict):
            out.extend(_check_ranges(value, sub, key))
        entry = _dict_value_type(node_type, f.name)
        if entry is not None and isinstance(value, dict):
            for name, item in value.items():
                out.extend(_check_ranges(item, entry, f"{key}.{name}"))
    return out


def _dict_value_type(owner: type, name: str) -> type | None:
    """The dataclass of a ``Dict[str, X]`` field's values, else None."""
    import typing

    hint = _hints(owner)[name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return args[1]
    return None


def to_plain(node: Any) -> Any:
    """Resolved plain-Python view of a config node (enums as strings), for hashing and manifests."""
    if isinstance(node, DictConfig) or OmegaConf.is_list(node):
        return OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    if hasattr(node, "value") and hasattr(node, "name") and not isinstance(node, (str, int, float)):
        return node.value
    return node


def select(cfg: DictConfig, key: str) -> Any:
    return to_plain(OmegaConf.select(cfg, key, throw_on_missing=True))


def slice_of(cfg: DictConfig, keys: Iterable[str]) -> dict[str, Any]:
    """The config slice a stage reads: ``{"quant": {...}, "model.source": "..."}``."""
    return {k: select(cfg, k) for k in keys}


def resolved_paths(cfg: DictConfig) -> dict[str, Path]:
    paths = to_plain(cfg.paths)
    root = Path(paths["root"]).expanduser().resolve()
    out = {}
    for k, v in paths.items():
        p = Path(v).expanduser()
        out[k] = (p if p.is_absolute() else (Path.cwd() / p)).resolve() if k != "root" else root
    return out


AXES = ("model", "quant", "target", "runtime")


def combinations(only: dict[str, list[str]] | None = None) -> list[dict[str, str]]:
    """Every shipped model × quant × target × runtime combination (for ``validate``); ``only``: the options kept per
    axis (``validate quant=fp8,nvfp4``), each of which must be shipped (else a :class:`UserError` naming the
    choices)."""
    axes = {g: [o for o in group_options(g) if o != "auto"] for g in AXES}
    for axis, wanted in (only or {}).items():
        if axis not in axes:
            raise UserError(f"validate: {axis}= is not an axis of the combinations; filter by "
                            f"{', '.join(f'{a}=' for a in AXES)}")
        unknown = [w for w in wanted if w not in axes[axis]]
        if unknown:
            raise UserError(f"validate: {axis}={unknown[0]} is not a shipped {axis}; choose from "
                            f"{', '.join(axes[axis])}")
        axes[axis] = [o for o in axes[axis] if o in wanted]
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]
