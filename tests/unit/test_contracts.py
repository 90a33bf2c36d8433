"""Stage contracts: a stage sees only the config keys it declares (so every key it uses enters its fingerprint), and
its code digest covers the package modules it imports."""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf.errors import ConfigAttributeError, ReadonlyConfigError

from pipeline import config, hardware, planning

from pipeline.runner import executor as runner, fingerprint
from pipeline.runner.contract import Stage
from pipeline.stages import STAGE_NAMES, STAGES, bench, build, package

BIG = ["model.shape.num_layers=80", "model.shape.hidden_size=8192", "model.shape.num_heads=64",
       "model.shape.num_kv_heads=8", "model.shape.head_dim=128", "model.shape.intermediate_size=28672",
       "model.shape.vocab_size=128000"]


def _cfg(tmp_path: Path, *extra: str):
    return hardware.compose(["model=tiny-qwen3", f"paths.root={tmp_path}", *extra])


# ------------------------------------------------------------------------------------------------ the config view
def _reads_name(ctx):
    (ctx.out / "name.txt").write_text(ctx.cfg.model.name)
    return {"format": ctx.cfg.quant.format.value}  # typed: enum values keep .value


def test_a_stage_reading_an_undeclared_key_fails(tmp_path):
    cfg = _cfg(tmp_path)
    undeclared = Stage(name="a", run=_reads_name, reads=("quant.format",), label=lambda c: "t")
    planned = {p.stage.name: p for p in runner.plan(cfg, [undeclared])}
    with pytest.raises(ConfigAttributeError, match="model"):
        runner.execute(cfg, planned["a"], planned)
    assert not planned["a"].out.exists()
    # negative control: the same run with the key declared
    declared = Stage(name="a", run=_reads_name, reads=("quant.format", "model.name"), label=lambda c: "t")
    planned = {p.stage.name: p for p in runner.plan(cfg, [declared])}
    m = runner.execute(cfg, planned["a"], planned)
    assert m["result"] == {"format": "fp8"} and (planned["a"].out / "name.txt").read_text() == "tiny-qwen3"


def test_the_view_is_read_only_resolved_and_typed(tmp_path):
    cfg = _cfg(tmp_path, "target=cpu")
    view = runner.stage_config(cfg, bench.STAGE)
    assert view.bench.concurrency == list(cfg.bench.concurrency)  # interpolated from target.device, resolved
    assert view.target.device.value == "cpu" and view.publish.dest == cfg.publish.dest
    with pytest.raises(ConfigAttributeError):
        view.target.sm  # bench declares target.name and target.device only
    with pytest.raises(ReadonlyConfigError):
        view.bench.seed = 7
    with pytest.raises(KeyError, match="no_such"):
        runner.stage_config(cfg, Stage(name="x", run=_reads_name, reads=("model.no_such",)))


def test_every_stage_declares_keys_the_config_has(tmp_path):
    cfg = _cfg(tmp_path)
    for st in STAGES:
        view = runner.stage_config(cfg, st)
        assert set(view.keys()) == {k.split(".")[0] for k in (*st.reads, *st.unhashed_reads)}


def test_unhashed_reads_stay_out_of_the_fingerprint(tmp_path):
    """bench reads publish.dest (its regression baseline) without it entering the fingerprint: the bundle version,
    derived from the fingerprints, must not depend on where it is uploaded."""
    lone = dataclasses.replace(bench.STAGE, inputs=())
    a = runner.plan(_cfg(tmp_path, "publish.dest=/tmp/one"), [lone])[0]
    b = runner.plan(_cfg(tmp_path, "publish.dest=/tmp/two"), [lone])[0]
    assert a.fingerprint == b.fingerprint
    c = runner.plan(_cfg(tmp_path, "publish.dest=/tmp/one", "bench.seed=7"), [lone])[0]  # negative control
    assert c.fingerprint != a.fingerprint


# ------------------------------------------------------------------------------- what each stage's helpers read
def test_build_takes_tp_from_the_resolved_capacity_plan_and_its_fingerprint_follows_model_shape(tmp_path):
    """build writes TP into the LLM-API options; with build.tp_size=0 the planner picks it from model.shape. The
    preflight resolves the plan once, and the fields build declares (Stage.capacity) enter its fingerprint."""
    # a TensorRT-LLM runtime on a GPU without performance-model tables: the capacity planner's TP (the reference
    # runtime runs on one GPU, and the model would choose TP by its profile)
    small = _cfg(tmp_path, "target=a10g", "runtime=trtllm_llmapi", "quant=int4_awq", "model.shape.params_b=1", *BIG)
    large = _cfg(tmp_path, "target=a10g", "runtime=trtllm_llmapi", "quant=int4_awq", "model.shape.params_b=60", *BIG)
    caps = [planning.resolve(c) for c in (small, large)]
    assert caps[0].tp == 1 and caps[1].tp > 1 and caps[1].summary["tp"] == caps[1].tp
    lone = dataclasses.replace(build.STAGE, inputs=())
    planned = [runner.preflight(c, [lone], environment=False) for c in (small, large)]
    assert [p.capacity.tp for p in planned] == [c.tp for c in caps]
    fps = [p.stages[0].fingerprint for p in planned]
    assert fps[0] != fps[1]
    assert planned[1].stages[0].parts["capacity"] == {"tp": caps[1].tp, "pp": 1, "summary": caps[1].summary,
                                                      "settings": caps[1].settings}
    assert runner.plan(large, [lone])[0].fingerprint == fps[1]  # resolved on demand when no plan is given
    # negative control: declaring no capacity field, build would share one fingerprint across the two shapes (it
    # reads no model.shape itself), and its run would get no capacity plan
    blind = dataclasses.replace(lone, capacity=())
    assert runner.plan(small, [blind])[0].fingerprint == runner.plan(large, [blind])[0].fingerprint
    assert "capacity" not in runner.plan(large, [blind])[0].parts
    with pytest.raises(ConfigAttributeError):
        runner.stage_config(large, build.STAGE).model  # the shape reaches build only through the plan


def test_a_stage_sees_only_the_capacity_fields_it_declares(tmp_path):
    cfg = _cfg(tmp_path, "target=a10g", "runtime=trtllm_llmapi", "quant=int4_awq", "build.tp_size=2")

    def uses_tp(ctx):
        return {"tp": ctx.capacity.tp}

    declared = Stage(name="a", run=uses_tp, reads=(), capacity=("tp",), label=lambda c: "t")
    planned = {p.stage.name: p for p in runner.plan(cfg, [declared])}
    assert runner.execute(cfg, planned["a"], planned)["result"] == {"tp": 2}
    # negative controls: a field not declared, and a stage declaring none
    other = Stage(name="a", run=uses_tp, reads=(), capacity=("pp",), label=lambda c: "u")
    planned = {p.stage.name: p for p in runner.plan(cfg, [other])}
    with pytest.raises(AttributeError, match="'tp' is not declared"):
        runner.execute(cfg, planned["a"], planned)
    none = Stage(name="a", run=uses_tp, reads=(), label=lambda c: "v")
    planned = {p.stage.name: p for p in runner.plan(cfg, [none])}
    with pytest.raises(AttributeError):
        runner.execute(cfg, planned["a"], planned)
    assert not planned["a"].out.exists()
    with pytest.raises(KeyError, match="no capacity field 'tpp'"):
        runner.plan(cfg, [dataclasses.replace(declared, capacity=("tpp",))])


def test_quantize_takes_the_mapping_only_for_the_engine_runtime(tmp_path):
    """Only trtllm_engine's quantize exports a TP/PP-mapped TRT-LLM checkpoint: the mapping enters its fingerprint
    alone; the other runtimes share one quantize output whatever the build's TP."""
    from pipeline.stages import quantize

    def planned(cfg, tp: int):
        cfg = copy.deepcopy(cfg)
        cfg.build.tp_size = tp
        return runner.plan(cfg, [dataclasses.replace(quantize.STAGE, inputs=(), extra=None)])[0]

    engine, llmapi = config.compose_many([["model=tiny-qwen3", f"paths.root={tmp_path}", "target=h100",
                                           f"runtime={rt}"] for rt in ("trtllm_engine", "trtllm_llmapi")])
    one, two = planned(engine, 1), planned(engine, 2)
    assert one.fingerprint != two.fingerprint and two.parts["capacity"] == {"tp": 2, "pp": 1}
    # negative control: the other runtimes declare no field; TP leaves their (shared) output alone
    one, two = planned(llmapi, 1), planned(llmapi, 2)
    assert one.fingerprint == two.fingerprint and "capacity" not in two.parts
    assert runner.capacity_fields(llmapi, quantize.STAGE) == ()
    llmapi.runtime.name = "reference"
    assert runner.capacity_fields(llmapi, quantize.STAGE) == ()


def test_the_engine_build_spec_reads_only_declared_keys(tmp_path):
    """The trtllm_engine path (TensorRT-LLM is not installed here): its spec comes from the build's view alone."""
    from pipeline.runner.contract import Context

    cfg = hardware.compose(["model=qwen32b", "target=h100", "runtime=trtllm_engine", "quant=fp8"])
    ckpt = tmp_path / "quantize" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "tokenizer.json").write_text("{}")
    out = tmp_path / "out"
    (out / "engine").mkdir(parents=True)
    ctx = Context(cfg=runner.stage_config(cfg, build.STAGE), stage=build.STAGE, out=out, final=tmp_path / "final",
                  inputs={"quantize": tmp_path / "quantize"}, manifests={"quantize": {}},
                  paths={"store": tmp_path / "store"},
                  capacity=planning.CapacityView(planning.resolve(cfg).values(build.STAGE.capacity)))
    args = build.engine_build_spec(ctx, "FP8", "FP8", "10.13")["trtllm_build_args"]
    # the serving plan's length for the H100 (the build's declared capacity field), not the config's 0
    assert args[args.index("--max_seq_len") + 1] == str(planning.resolve(cfg).settings["max_seq_len"]) != "0"
    assert (out / "engine" / "tokenizer.json").is_file()


@pytest.mark.parametrize("runtime", ["reference", "trtllm_llmapi"])
def test_package_values_read_only_declared_keys(tmp_path, runtime):
    cfg = _cfg(tmp_path, "target=h100", f"runtime={runtime}")
    view = runner.stage_config(cfg, package.STAGE)
    ps = runner.plan(cfg, [dataclasses.replace(package.STAGE, inputs=())])[0]
    seen = planning.CapacityView(ps.parts["capacity"])  # what its run gets (Context.capacity)
    full = planning.resolve(cfg)
    from pipeline.triton import layouts, repository

    model_yaml = layouts.get("llmapi").part("placeholders").model_yaml
    assert repository.values(view, {}, seen) == repository.values(cfg, {}, full)
    assert model_yaml(view, tmp_path, seen) == model_yaml(cfg, tmp_path, full)


def test_bench_gates_and_baseline_read_only_declared_keys(tmp_path):
    cfg = _cfg(tmp_path, f"publish.dest={tmp_path / 'published'}")
    view = runner.stage_config(cfg, bench.STAGE)
    (tmp_path / "bundles").mkdir()
    ctx = SimpleNamespace(cfg=view, stage=bench.STAGE, paths={"bundles": tmp_path / "bundles"})
    baseline = bench.previous_bench(ctx)
    assert baseline["status"] == "none" and baseline["source"] == str(tmp_path / "published")
    assert bench.gates(view, {"workloads": {}}, baseline)["verdict"] == "incomplete"  # nothing measured is never a pass


def test_the_registry_holds_the_stage_names_config_checks():
    assert STAGE_NAMES == config.STAGE_NAMES == tuple(s.name for s in STAGES)


# ---------------------------------------------------------------------------------------------------- code digest
def _plant(root: Path, files: dict[str, str] | None = None) -> dict[str, Path]:
    """A planted ``pipeline`` tree under ``root``: ``files`` (path -> text), by default a stage and its helpers."""
    files = files or {
        "pipeline/__init__.py": "",
        "pipeline/stages/__init__.py": "from pipeline.stages import s, other\n",
        "pipeline/stages/s.py": ("from pipeline import ui\n\n\ndef run(ctx):\n    from pipeline import helper\n"
                                 "    return helper.f(), ['-m', 'pipeline.child']\n"),
        "pipeline/stages/other.py": "import pipeline.unrelated\n",
        "pipeline/helper.py": "from .deep import g\n\n\ndef f():\n    return g()\n",
        "pipeline/deep.py": "def g():\n    return 1\n",
        "pipeline/child.py": "print('a child process')\n",
        "pipeline/unrelated.py": "X = 1\n",
        "pipeline/ui.py": "console = None\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return {rel: root / rel for rel in files}


def test_the_code_digest_follows_the_import_graph(tmp_path):
    f = _plant(tmp_path)
    stage_file = f["pipeline/stages/s.py"]

    def digest() -> str:
        return fingerprint.code_digest("pipeline.stages.s", stage_file, tmp_path)

    assert set(fingerprint.code_modules("pipeline.stages.s", stage_file, tmp_path)) == {
        "pipeline.stages.s", "pipeline.helper", "pipeline.deep", "pipeline.child"}
    before = digest()
    for rel in ("pipeline/helper.py", "pipeline/deep.py", "pipeline/child.py", "pipeline/stages/s.py"):
        f[rel].write_text(f[rel].read_text() + "# changed\n")
        after = digest()
        assert after != before, f"{rel}: a module the stage uses changed, the digest did not"
        before = after
    # negative controls: a module it does not import, and an excluded presentation module
    for rel in ("pipeline/unrelated.py", "pipeline/ui.py", "pipeline/stages/other.py", "pipeline/stages/__init__.py"):
        f[rel].write_text(f[rel].read_text() + "# changed\n")
        assert digest() == before, f"{rel} is not used by the stage, yet its change moved the digest"


def test_a_package_that_discovers_its_modules_brings_them_all_into_the_digest(tmp_path):
    """The format registry imports its modules by listing its directory (pkgutil.iter_modules over __path__), so no
    import statement names them: the digest counts each of them, and a package that does not list itself does not
    bring its siblings along (negative control)."""
    files = {
        "pipeline/__init__.py": "",
        "pipeline/stages/s.py": "from pipeline import registry, plain\n",
        "pipeline/registry/__init__.py": ("import importlib, pkgutil\n\n"
                                          "FOUND = [importlib.import_module(f'{__name__}.{m.name}')"
                                          " for m in pkgutil.iter_modules(__path__)]\n"),
        "pipeline/registry/one.py": "X = 1\n",
        "pipeline/registry/two.py": "Y = 2\n",
        "pipeline/plain/__init__.py": "",
        "pipeline/plain/sibling.py": "Z = 3\n",
    }
    stage = _plant(tmp_path, files)["pipeline/stages/s.py"]
    assert set(fingerprint.code_modules("pipeline.stages.s", stage, tmp_path)) == {
        "pipeline.stages.s", "pipeline.registry", "pipeline.registry.one", "pipeline.registry.two", "pipeline.plain"}
    before = fingerprint.code_digest("pipeline.stages.s", stage, tmp_path)
    (tmp_path / "pipeline/plain/sibling.py").write_text("Z = 40\n")
    assert fingerprint.code_digest("pipeline.stages.s", stage, tmp_path) == before
    (tmp_path / "pipeline/registry/two.py").write_text("Y = 20\n")
    assert fingerprint.code_digest("pipeline.stages.s", stage, tmp_path) != before


# what the stages listed by hand before the digest came from the import graph (each must still be covered; the
# hand lists also named pipeline.upstream.pbtxt for package, which only the recording tool imports)
HAND_LISTED = {
    "fetch": {"pipeline.calib", "pipeline.synthetic"},
    "quantize": {"pipeline.calib", "pipeline.quality", "pipeline.quant.proof", "pipeline.runtime.reference",
                 "pipeline.runtime.trtllm"},
    "build": {"pipeline.runtime.reference", "pipeline.runtime.trtllm", "pipeline.runtime.trtllm_child",
              "pipeline.planning", "pipeline.capacity", "pipeline.compat"},
    "package": {"pipeline.triton.render", "pipeline.triton.lint", "pipeline.runtime.reference",
                "pipeline.runtime.decode_engine", "pipeline.planning", "pipeline.capacity", "pipeline.upstream"},
    "bench": {"pipeline.stages.bench.triton_client", "pipeline.triton.server", "pipeline.calib"},
    "eval_baseline": {"pipeline.eval", "pipeline.eval.harness", "pipeline.eval.stats", "pipeline.eval.tasks",
                      "pipeline.eval.env", "pipeline.eval.endpoint", "pipeline.triton.server",
                      "pipeline.runtime.reference"},
    "evaluate": {"pipeline.eval", "pipeline.eval.harness", "pipeline.eval.stats", "pipeline.eval.tasks",
                 "pipeline.eval.endpoint", "pipeline.triton.server"},
    "publish": {"pipeline.bundle"},
}


@pytest.mark.parametrize("st", STAGES, ids=lambda s: s.name)
def test_every_stage_digest_covers_its_helpers_and_nothing_excluded(st):
    name = st.run.__module__
    mods = set(fingerprint.code_modules(name, Path(importlib.util.find_spec(name).origin)))
    assert HAND_LISTED[st.name] <= mods, HAND_LISTED[st.name] - mods
    assert not any(fingerprint._excluded(m) for m in mods)
    others = {s.run.__module__ for s in STAGES if s is not st}
    if st.name in ("fetch", "quantize", "build"):  # upstream stages never depend on a downstream stage's module
        assert not mods & others, mods & others
