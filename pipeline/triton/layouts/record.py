"""One Triton layout's record, :class:`Layout`: what a layout folder's ``__init__.py`` declares as ``LAYOUT`` (with
keyword arguments), and the way to the rest of its folder (templates, placeholders, the served-model reading, the
front end's codec, its interface). The folder itself is described in ``pipeline/triton/layouts/__init__.py``."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from pipeline.errors import UserError
from pipeline.catalog import ENGINE_REL, LAYOUT_INTERFACE as INTERFACE, LLM_MODEL

PARTS = ("placeholders", "served", "openai_codec")  # the modules every layout folder holds beside its __init__.py


def _nothing(model_dirs: Mapping[str, Path]) -> bool:
    return False


@dataclass(frozen=True)
class Layout:
    """One model-repository layout. A folder declares every field but ``folder`` and ``package``, which the registry
    sets from where it found the folder."""

    name: str  # the folder's name
    models: Mapping[str, tuple[str, ...]]  # runtime -> model templates (the folder's models/<template>/)
    entry_points: tuple[str, ...]  # models a client may send text to; the first is the default
    text_input: str  # BYTES prompt
    max_tokens: str  # INT32 number of tokens to generate
    stream: str  # BOOL: stream the answer (a decoupled model)
    exclude_input: str = ""  # optional BOOL: leave the prompt out of the returned text (sent as true when present)
    # a row of the sampling table (pipeline/triton/layouts/sampling.py) -> the entry point's tensor for it
    sampling: Mapping[str, str] = field(default_factory=dict)
    # guided decoding's (guide type, guide) inputs of the entry point (TensorRT-LLM's guided_decoding_guide_type and
    # guided_decoding_guide); () where the layout has none
    guide: tuple[str, ...] = ()
    output: str = "text_output"  # BYTES answer
    cumulative: bool = False  # each streamed response holds the whole text so far (the LLM API's RequestOutput)
    detect: Callable[[Mapping[str, Path]], bool] = _nothing  # is a written repository's {model: dir} of this layout?
    auto_for: tuple[str, ...] = ()  # runtimes for which serve.layout=auto picks this layout
    fallback: bool = False  # the layout of a repository no layout detects (lint then names what it lacks); one only
    reference: tuple[str, ...] = ()  # templates that run the reference runtime (its copies go beside model.py)
    required_models: tuple[str, ...] | None = None  # models lint requires (None: every model of its interface)
    entry_note: str = ""  # why another model is not an entry point (the message for serve.openai.entry_point)
    folder: Path | None = None  # set by the registry
    package: str = ""  # set by the registry: the folder as a python package

    # --- what it serves ------------------------------------------------------------------------------------------
    @property
    def text_tensors(self) -> tuple[str, str, str]:
        """(text input, max-tokens input, streaming flag input): what every text request sends."""
        return self.text_input, self.max_tokens, self.stream

    @property
    def runtimes(self) -> tuple[str, ...]:
        return tuple(self.models)

    def templates(self, runtime: str) -> tuple[str, ...]:
        return self.models[runtime]

    def template_dir(self, template: str) -> Path:
        """``models/<template>/`` of the folder: ``config.pbtxt.tmpl`` and ``1/*.py``."""
        return self.folder / "models" / template

    @staticmethod
    def model_name(template: str) -> str:
        """The model a template renders (``tensorrt_llm.reference`` -> ``tensorrt_llm``)."""
        return template.split(".")[0]

    def check_entry(self, entry: str) -> None:
        """``serve.openai.entry_point``: a :class:`UserError` unless it is one of the entry points."""
        if entry in self.entry_points:
            return
        pts = self.entry_points
        what = (f"entry point is {pts[0]}" if len(pts) == 1 else
                f"text entry points are {', '.join(pts[:-1])} and {pts[-1]}")
        raise UserError(f"serve.openai.entry_point={entry}: the {self.name} layout's {what}"
                        + (f" ({self.entry_note})" if self.entry_note else ""))

    # --- its interface -------------------------------------------------------------------------------------------
    @property
    def upstream(self) -> bool:
        """Whether it is one of NVIDIA's layouts (its interface is ``pipeline/upstream/trtllm-<line>.yaml``); else the
        folder's own ``interface.yaml`` holds it, in the same form."""
        return not (self.folder / INTERFACE).is_file()

    def _own(self) -> dict[str, Any]:
        import yaml

        return yaml.safe_load((self.folder / INTERFACE).read_text()) or {}

    def has_line(self, line: str) -> bool:
        """Whether the TensorRT-LLM ``line`` has this layout (``main`` ships only ``llmapi``); a layout with its own
        interface has every line."""
        from pipeline import upstream

        return not self.upstream or self.name in upstream.record(line)["layouts"]

    def interface(self, line: str | None = None) -> dict[str, dict[str, Any]]:
        """``{model: {inputs, outputs, parameters, backend, ...}}`` as upstream ships it for ``line`` (the default
        line when None); a layout with its own ``interface.yaml``: its ``models``."""
        from pipeline import upstream

        if not self.upstream:
            return self._own().get("models") or {}
        return upstream.interface(line or upstream.DEFAULT_LINE, self.name)

    def reads(self, line: str | None = None) -> dict[str, dict[str, Any]]:
        """``{model: {required: [...], optional: [...], source}}``: the parameters each model reads."""
        from pipeline import upstream

        if not self.upstream:
            return self._own().get("reads") or {}
        return upstream.reads(line or upstream.DEFAULT_LINE, self.name)

    def input_types(self, model: str | None = None, line: str | None = None) -> dict[str, str]:
        """Input tensor -> Triton data type (``TYPE_STRING``, ``TYPE_INT32``...) of an entry point (the default one
        when None), from the interface of ``line``."""
        spec = self.interface(line)[model or self.entry_points[0]]
        return {t["name"]: t["data_type"] for t in spec["inputs"]}

    # --- the rest of the folder ----------------------------------------------------------------------------------
    def part(self, module: str):
        """One of the folder's modules (:data:`PARTS`), imported."""
        return importlib.import_module(f"{self.package}.{module}")

    def values(self, cfg, engine_cfg: dict[str, Any], capacity) -> dict[str, dict[str, Any]]:
        """``placeholders.values``: every placeholder of every template, from the config, the build record
        (``engine_cfg``) and the resolved capacity plan."""
        return self.part("placeholders").values(cfg, engine_cfg, capacity)

    def files(self, cfg, repo: Path, capacity) -> dict[str, str]:
        """``placeholders.files`` where the folder has it: files besides the rendered configs (repository-relative
        path -> text), written after them."""
        fn = getattr(self.part("placeholders"), "files", None)
        return fn(cfg, repo, capacity) if fn is not None else {}

    def max_batch_size(self, cfg, capacity) -> int:
        """``placeholders.max_batch_size``: the batch size the package result records."""
        return int(self.part("placeholders").max_batch_size(cfg, capacity))

    def read(self, repo: Path, model_dirs: Mapping[str, Path]):
        """``served.read``: what a written repository says about its model (tokenizer directory, context length,
        how prompts are tokenized), a ``contract.Reading``."""
        return self.part("served").read(repo, model_dirs)

    def codec(self, served):
        """``openai_codec.Codec``: the front end's mapping of OpenAI requests onto this layout's tensors, for ``served``."""
        return self.part("openai_codec").Codec(self, served)

    # --- its own consistency -------------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """What in the folder disagrees with the record (each a sentence naming the file): a template or python
        model that is missing, a part module that is missing, an entry point no template renders, a tensor the
        record names that the interface of an entry point lacks, a reference template no runtime uses, a sampling
        row that is not in the sampling table."""
        out: list[str] = []
        where = f"layout {self.name} ({self.folder})"
        for part in PARTS:
            if not (self.folder / f"{part}.py").is_file():
                out.append(f"{where}: {part}.py is missing")
        rendered = set()
        for runtime, templates in self.models.items():
            for t in templates:
                rendered.add(self.model_name(t))
                if not (self.template_dir(t) / "config.pbtxt.tmpl").is_file():
                    out.append(f"{where}: models/{t}/config.pbtxt.tmpl is missing (a template of runtime {runtime})")
        for t in self.reference:
            if t not in self.models.get("reference", ()):
                out.append(f"{where}: reference template {t} is not one of runtime reference's templates")
            elif not (self.template_dir(t) / "1" / "model.py").is_file():
                out.append(f"{where}: models/{t}/1/model.py is missing (the reference runtime's python model)")
        for runtime in self.auto_for:
            if runtime not in self.models:
                out.append(f"{where}: auto_for names runtime {runtime}, which it has no templates for")
        if not self.entry_points:
            out.append(f"{where}: no entry point (a model a client sends text to)")
        from pipeline.triton.layouts import sampling

        for name in sampling.unknown(self.sampling):
            out.append(f"{where}: sampling names {name!r}, which is no row of the sampling table "
                       f"(pipeline/triton/layouts/sampling.py: {', '.join(sampling.BY_NAME)})")
        for entry in self.entry_points:
            if entry not in rendered:
                out.append(f"{where}: entry point {entry} is rendered by no template")
        out += self._interface_problems()
        return out

    def _interface_problems(self) -> list[str]:
        from pipeline import upstream

        out = []
        lines = upstream.lines() if self.upstream else (None,)
        for line in lines:
            if line is not None and not self.has_line(line):
                continue  # main ships only the llmapi layout
            try:
                iface = self.interface(line)
            except Exception as exc:  # an unreadable interface.yaml
                return [f"layout {self.name}: its interface cannot be read ({exc})"]
            label = (f"layout {self.name}: its interface ({INTERFACE})" if line is None else
                     f"layout {self.name}: TensorRT-LLM {line}'s recorded interface")
            for entry in self.entry_points:
                if entry not in iface:
                    out.append(f"{label} has no entry point {entry}")
                    continue
                ins = {t["name"] for t in iface[entry].get("inputs", [])}
                outs = {t["name"] for t in iface[entry].get("outputs", [])}
                for name in (*self.text_tensors, *([self.exclude_input] if self.exclude_input else []),
                             *self.sampling.values(), *self.guide):
                    if name not in ins:
                        out.append(f"{label} has no input {name} in model {entry}, which the record names")
                if self.output not in outs:
                    out.append(f"{label} has no output {self.output} in model {entry}, which the record names")
        return out
