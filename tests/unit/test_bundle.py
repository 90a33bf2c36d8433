"""Bundle manifest pieces that need no build: the bench gate from the bench stage's typed result, ``verify --container``
against the recorded container pairs, and one-line errors of object-store clients."""
from __future__ import annotations

import json

import pytest

from pipeline import bundle, upstream
from pipeline.identity import ArtifactKey
from pipeline.errors import StageFailed, UserError
from pipeline.results import Gates
from pipeline.stages import publish

GATES = {"verdict": "pass", "breaches": [], "regressions": ["chat at concurrency 1: TTFT p95 30.0 vs 10.0 (+200%)"],
         "regressions_gated": False, "compared_with_previous_levels": 2,
         "baseline": {"status": "found", "source": "memory://x", "version": "v1", "detail": None}}


def _bench_result(tmp_path, gates) -> object:
    """The bench stage's result as its manifest records it, read the way publish reads it."""
    from pipeline import results

    raw = {"model": "ensemble", "layout": "inflight_batcher_llm", "workloads": {}, "answers_passed": 0, "answers": 0,
           **({"gates": gates} if gates is not None else {})}
    return results.read("bench", json.loads(json.dumps(raw)))


def test_the_bench_verdict_and_its_regressions_are_read_from_the_bench_result(tmp_path):
    got = publish.bench_verdict(_bench_result(tmp_path, GATES))
    assert got["verdict"] == "pass" and got["regressions"] == GATES["regressions"]
    assert got["regressions_gated"] is False and got["compared_with_previous_levels"] == 2
    gates = {"accuracy": "pass", "export_check": "pass", "bench": got["verdict"], "bench_detail": got}
    Gates.model_validate(gates)
    assert publish.gates_passed(gates)
    no_baseline = publish.bench_verdict(_bench_result(tmp_path, {**GATES, "verdict": "no-baseline"}))
    assert no_baseline["verdict"] == "no-baseline"
    assert not publish.gates_passed({**gates, "bench": "no-baseline"})  # latest does not move on no-baseline


@pytest.mark.parametrize("gates, expected", [
    (None, "(gates: Field required)"),
    ({**GATES, "verdict": None}, "(gates.verdict: Input should be 'pass', 'fail', 'no-baseline' or 'incomplete')"),
    ({**GATES, "verdict": "ok"}, "(gates.verdict: Input should be 'pass', 'fail', 'no-baseline' or 'incomplete')"),
    ({k: v for k, v in GATES.items() if k != "regressions"}, "(gates.regressions: Field required)"),
])
def test_a_bench_result_without_a_verdict_fails_publish_instead_of_passing(tmp_path, gates, expected):
    with pytest.raises(StageFailed, match=r"re-run bench \(force=\[bench\]\)") as exc:
        _bench_result(tmp_path, gates)
    assert expected in str(exc.value)


def test_the_bundle_schema_refuses_an_unknown_bench_verdict():
    with pytest.raises(ValueError):
        Gates.model_validate({"accuracy": "pass", "export_check": "pass", "bench": "maybe",
                                     "bench_detail": {**GATES, "verdict": "maybe"}})


def _want(image: str) -> dict:
    pair = upstream.container_pairs()[image]
    return {"tensorrt_llm": pair["trtllm"], "tensorrt": pair["tensorrt"], "container": image}


def test_verify_container_compares_the_images_versions_from_the_recorded_pairs():
    pairs = upstream.container_pairs()
    images = sorted(pairs)
    assert len({pairs[i]["trtllm"] for i in images}) >= 2
    built_for = images[0]
    other = next(i for i in images if pairs[i]["trtllm"] != pairs[built_for]["trtllm"])
    name, ok, msg = bundle.container_check(_want(built_for), built_for)
    assert ok is True and pairs[built_for]["trtllm"] in msg
    # negative controls: another image's TRT-LLM, and a TensorRT that differs under the same TRT-LLM
    name, ok, msg = bundle.container_check(_want(built_for), other)
    assert ok is False and f"TensorRT-LLM {pairs[built_for]['trtllm']} ≠ {pairs[other]['trtllm']}" in msg
    want = {**_want(built_for), "tensorrt": "9.0.0"}
    name, ok, msg = bundle.container_check(want, built_for)
    assert ok is False and f"TensorRT 9.0.0 ≠ {pairs[built_for]['tensorrt']}" in msg
    # the same image under a different tag string is not enough: versions decide, not tags
    want = {**_want(built_for), "container": "registry.example/mirror/tritonserver:custom"}
    assert bundle.container_check(want, built_for)[1] is True
    # TensorRT recorded with fewer components matches its full version
    short = ".".join(pairs[built_for]["tensorrt"].split(".")[:3])
    assert bundle.container_check({**_want(built_for), "tensorrt": short}, built_for)[1] is True


def test_verify_container_with_an_unknown_image_names_the_recorded_ones():
    with pytest.raises(UserError) as exc:
        bundle.container_check(_want(sorted(upstream.container_pairs())[0]), "nvcr.io/nvidia/tritonserver:24.01-py3")
    line = str(exc.value)
    assert "\n" not in line and "nvcr.io/nvidia/tritonserver:24.01-py3: not a recorded serving image" in line
    assert all(image in line for image in upstream.container_pairs())


def test_a_bundle_without_trtllm_versions_maps_its_recorded_container():
    image = sorted(upstream.container_pairs())[0]
    assert bundle.container_check({"container": image}, image)[1] is True
    name, ok, msg = bundle.container_check({"container": None}, image)
    assert ok is False and "records no TensorRT-LLM version" in msg


def test_object_store_errors_become_one_line_without_credentials():
    class ClientError(Exception):  # the shape of botocore's error, as s3fs lets it through
        pass

    ClientError.__module__ = "botocore.exceptions"
    err = bundle.store_error("publish.dest=s3://AKID:SECRET@bucket/x", "publishing v1",
                             ClientError("An error occurred (InvalidAccessKeyId) when calling PutObject"))
    assert isinstance(err, UserError) and "\n" not in str(err)
    assert "SECRET" not in str(err) and "s3://***@bucket/x" in str(err)
    assert "check the credentials in the environment" in str(err)
    missing = bundle.store_error("publish.dest=gs://b", "publishing v1", FileNotFoundError("The bucket does not exist"))
    assert "check that the bucket exists" in str(missing)
    assert bundle.store_error("x", "y", KeyError("a programming error")) is None  # not a store error: re-raised


@pytest.mark.parametrize("exc,hint", [
    # gcsfs' missing bucket names its URL: a bucket '1f4018eb' once read as HTTP 401 (CI's test_object_stores)
    (FileNotFoundError("http://127.0.0.1:4443/storage/v1/b/no-such-bucket-1f4018eb/o"), "the bucket exists"),
    (FileNotFoundError("http://127.0.0.1:40312/storage/v1/b/b/o"), "the bucket exists"),  # a port, not HTTP 403
    (OSError("Forbidden: 403 on http://127.0.0.1:4040/b"), "the credentials"),
    (OSError("401 Unauthorized"), "the credentials"),
    (OSError("404 on s3://bucket-403/x"), "the bucket exists"),
    (PermissionError("s3://b/x"), "the credentials"),
])
def test_a_store_errors_hint_reads_its_words_not_the_urls_it_names(exc, hint):
    assert hint in str(bundle.store_error("publish.dest=gs://b", "publishing", exc)).rsplit("; ", 1)[1]


def test_a_killed_upload_of_another_version_is_removed_from_the_published_tree_after_a_day(tmp_path):
    import os
    import time

    from tests.helpers.bundles import make_bundle

    local = make_bundle(tmp_path / "src")
    doc = json.loads((local / "bundle.json").read_text())
    base = tmp_path / "published" / ArtifactKey.of_manifest(doc).publish_prefix
    old, fresh = base / ".v00000000000a.tmp-999999-abcdef", base / ".v00000000000b.tmp-999998-abcdef"
    for d in (old, fresh):
        (d / "checkpoint").mkdir(parents=True)
    day_ago = time.time() - bundle.STALE_UPLOAD_S - 60
    os.utime(old, (day_ago, day_ago))
    bundle.publish(local, str(tmp_path / "published"), move_latest=False, lock_dir=tmp_path / "locks")
    assert not old.exists() and fresh.exists()  # a recent one may be another publisher's upload in progress
    assert (base / doc["version"] / "bundle.json").is_file()


def test_the_published_bundle_reader_takes_latest_and_skips_incomplete_versions(tmp_path):
    """One reader of published bundles (bench's regression baseline and fleet's outdated both use it)."""
    from pathlib import Path

    from pipeline import hardware

    cfg = hardware.compose(["model=tiny-qwen3", "target=cpu", "runtime=reference", "quant=fp8",
                          f"publish.dest={tmp_path / 'pub'}"])
    _, base = bundle.published_base(cfg)
    assert base == f"{tmp_path / 'pub'}/tiny-qwen3/fp8-kvfp8/cpu/reference"
    assert bundle.read_published(cfg) == (base, None, None)  # nothing published yet
    for version in ("v1", "v2"):
        (Path(base) / version).mkdir(parents=True)
        (tmp_path / "pub" / base / version / "bundle.json").write_text(json.dumps({"version": version}))
    (Path(base) / "latest").write_text("v1")
    assert bundle.read_published(cfg) == (base, "v1", b'{"version": "v1"}')
    # negative control: latest naming an interrupted upload (no bundle.json) is not taken; the newest complete one is
    (Path(base) / "v3").mkdir()
    (Path(base) / "latest").write_text("v3")
    assert bundle.read_published(cfg)[1] in ("v1", "v2")
    assert bundle.read_published(cfg)[1] != "v3"


# ------------------------------------------------------------------------------------------------ the bundle's tree
def _checks(where) -> dict[str, tuple[bool | None, str]]:
    return {name: (ok, msg) for name, ok, msg in bundle.verify(str(where))}


def test_verify_passes_the_tree_exactly_as_listed(tmp_path):
    from tests.helpers.bundles import make_bundle

    checks = _checks(make_bundle(tmp_path))
    assert checks["tree"][0] is True, checks["tree"]
    assert checks["loadable"][0] is True, checks["loadable"]


@pytest.mark.parametrize("change, named", [
    (lambda b: (b / "triton_repo/ensemble/1/extra_module.py").write_text("x = 1\n"),
     "triton_repo/ensemble/1/extra_module.py is not in the manifest"),
    (lambda b: (b / "triton_repo/ensemble/2").mkdir(), "directory triton_repo/ensemble/2/ is not in the manifest"),
    (lambda b: __import__("shutil").rmtree(b / "triton_repo/ensemble/1"), "directory triton_repo/ensemble/1/ is missing"),
    (lambda b: (b / "triton_repo/ensemble/1").rename(b / "triton_repo/ensemble/7"),
     "directory triton_repo/ensemble/1/ was renamed to triton_repo/ensemble/7/"),
    (lambda b: (b / "checkpoint/config.json").rename(b / "checkpoint/config.json.bak"),
     "checkpoint/config.json is missing; checkpoint/config.json.bak is not in the manifest"),
])
def test_verify_fails_an_added_removed_or_renamed_file_or_directory_naming_it(tmp_path, change, named):
    from tests.helpers.bundles import make_bundle

    b = make_bundle(tmp_path)
    for p in b.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    change(b)
    ok, msg = _checks(b)["tree"]
    assert ok is False and named in msg, msg


def test_verify_fails_byte_code_written_into_a_bundle(tmp_path):
    """Serving writes no byte code into a bundle (``repository.block_bytecode``), so a ``__pycache__`` directory in one
    is a change to its tree like any other."""
    from tests.helpers.bundles import make_bundle

    b = make_bundle(tmp_path)
    assert _checks(b)["tree"][0] is True
    cache = b / "triton_repo/ensemble/1/__pycache__"
    cache.mkdir()
    (cache / "model.cpython-311.pyc").write_bytes(b"\0")
    ok, msg = _checks(b)["tree"]
    assert ok is False and "directory triton_repo/ensemble/1/__pycache__/ is not in the manifest" in msg, msg


def test_verify_fails_a_model_without_a_version_directory_even_when_the_manifest_agrees(tmp_path):
    """A bundle published by a file-only copy lists no ``ensemble/1/``: its tree matches, the server refuses it."""
    from tests.helpers.bundles import make_bundle, rewrite_manifest

    b = make_bundle(tmp_path)
    (b / "triton_repo/ensemble/1/.keep").chmod(0o644)
    __import__("shutil").rmtree(b / "triton_repo/ensemble/1")

    def drop(doc):
        doc["files"] = [f for f in doc["files"] if "/1/" not in f["path"]]
        doc["dirs"] = [d for d in doc["dirs"] if not d.endswith("/1")]
    rewrite_manifest(b / "bundle.json", drop)
    checks = _checks(b)
    assert checks["tree"][0] is True and checks["checksums"][0] is True
    assert checks["loadable"] == (False, "triton_repo/ensemble/: no version directory (ensemble/1/); Triton refuses "
                                         "the model (\"at least one version must be available\"): create ensemble/1/")


def test_bundle_tree_keeps_every_directory_and_drops_byte_code(tmp_path):
    src, out = tmp_path / "package", tmp_path / "bundle"
    for d in ("ensemble/1", "m/1/__pycache__"):
        (src / d).mkdir(parents=True)
    (src / "m/1/model.py").write_text("")
    (src / "m/1/__pycache__/model.cpython-311.pyc").write_bytes(b"\0")
    (out / "triton_repo/m/1/__pycache__").mkdir(parents=True)  # what a file copy of src gives
    (out / "triton_repo/m/1/model.py").write_text("")
    (out / "triton_repo/m/1/__pycache__/model.cpython-311.pyc").write_bytes(b"\0")
    (out / "triton_repo/m/1/stray.pyc").write_bytes(b"\0")
    (src / "ensemble/1/__pycache__").write_bytes(b"")  # the package stage's block against byte code: a file, kept
    (out / "triton_repo/ensemble/1").mkdir(parents=True)
    (out / "triton_repo/ensemble/1/__pycache__").write_bytes(b"")
    bundle.bundle_tree(out, src, "triton_repo")
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["triton_repo/ensemble/1/__pycache__", "triton_repo/m/1/model.py"]
    assert bundle.store_dirs(out) == ["triton_repo", "triton_repo/ensemble", "triton_repo/ensemble/1",
                                      "triton_repo/m", "triton_repo/m/1"]


def test_a_local_publish_creates_every_listed_directory(tmp_path):
    """``dirs`` of bundle.json is the tree: an empty directory listed there exists in the published version."""
    from tests.helpers.bundles import make_bundle, rewrite_manifest

    b = make_bundle(tmp_path)
    (b / "reports/empty").mkdir()
    rewrite_manifest(b / "bundle.json", lambda doc: doc["dirs"].append("reports/empty"))
    out = bundle.publish(b, str(tmp_path / "published"), move_latest=True)
    assert (tmp_path / out["url"].split(str(tmp_path) + "/", 1)[1] / "reports/empty").is_dir()
    assert _checks(out["url"])["tree"][0] is True


def test_the_servers_reason_for_a_model_that_did_not_load_is_one_line():
    from pipeline.triton import server

    log = ('E1201 09:47:27.116468 9191 server.cc:241] "CudaDriverHelper has not been initialized."\n'
           'E1201 09:47:32.889070 9191 model_repository_manager.cc:724] "failed to load model \'ensemble\': at least '
           'one version must be available under the version policy of model \'ensemble\'"\n'
           "error: creating server: Internal - failed to load all models\n")
    assert server.load_failures(log) == ["model 'ensemble': at least one version must be available under the "
                                         "version policy of model 'ensemble'"]
    assert server.load_failures("error: creating server: Internal - failed to load all models\n") == []


# ------------------------------------------------------------------------------------------ recipe and latest
@pytest.mark.parametrize("differs, choice, moved, why", [
    ([], None, True, None),
    (["serve.torch_threads: 1 -> 0"], None, False, "the config differs from its matrix entry "
                                                   "(serve.torch_threads: 1 -> 0); publish.move_latest=true moves it"),
    (["serve.torch_threads: 1 -> 0"], True, True, None),
    ([], False, False, "publish.move_latest=false"),
])
def test_latest_moves_only_for_the_matrix_config_or_when_asked(tmp_path, differs, choice, moved, why):
    """An ad-hoc override still publishes its version; only ``latest`` stays where it was."""
    from tests.helpers.bundles import make_bundle

    local = make_bundle(tmp_path)
    res = publish.upload(local, str(tmp_path / "published"), lock_dir=tmp_path / "locks", config_differs=differs,
                         move_latest=choice)
    version_dir = tmp_path / res["url"].split(str(tmp_path) + "/", 1)[1]
    assert (version_dir / "bundle.json").is_file()
    assert res["latest_moved"] is moved and (version_dir.parent / "latest").is_file() is moved
    assert res["latest_not_moved"] == why


def test_a_gate_that_did_not_pass_keeps_latest_even_when_asked(tmp_path):
    from tests.helpers.bundles import make_bundle, rewrite_manifest

    local = make_bundle(tmp_path)
    rewrite_manifest(local / "bundle.json", lambda d: d["gates"].update(accuracy="warn"))
    res = publish.upload(local, str(tmp_path / "published"), lock_dir=tmp_path / "locks", move_latest=True)
    assert res["latest_moved"] is False
    # every gate is named with its verdict, the one that kept latest marked
    assert res["latest_not_moved"] == ("a gate did not pass: accuracy warn (did not pass), export_check pass, "
                                       "bench pass, eval n/a")


def test_the_matrix_entry_of_a_config_and_how_it_differs():
    """The build's recorded settings (what its stages read) against the entry of the shipped matrix."""
    from pipeline import config, hardware, matrix
    from pipeline.bundle import flatten

    smoke = ["model=tiny-qwen3", "quant=fp8", "target=cpu", "runtime=reference", "quant.gate=warn"]
    settings = lambda cfg: {k: v for k, v in flatten(config.to_plain(cfg)).items()  # noqa: E731
                            if k.startswith(("serve.", "quant.", "bench."))}
    cfg = hardware.compose(smoke)
    assert matrix.differences(cfg, settings(cfg)) == ("smoke", [])
    cfg = hardware.compose([*smoke, "serve.torch_threads=0"])
    assert matrix.differences(cfg, settings(cfg)) == ("smoke", ["serve.torch_threads: 1 -> 0"])
    own = hardware.compose([*smoke, "model.name=my-model"])  # a model of one's own is in no matrix
    assert matrix.differences(own, settings(own)) == (None, [])


def test_diff_shows_config_differences_first(tmp_path):
    from tests.helpers.bundles import make_bundle, rewrite_manifest

    a, b = make_bundle(tmp_path / "a"), make_bundle(tmp_path / "b", version="v0000000000bb", size=1000)
    recipe = {"package": {"serve": {"torch_threads": 1}, "paths": {"root": "/x"}}}
    rewrite_manifest(a / "bundle.json", lambda d: d.update(recipe=recipe, served_by={"version": "2.51.0"}))
    rewrite_manifest(b / "bundle.json", lambda d: d.update(
        recipe={"package": {"serve": {"torch_threads": 0}, "paths": {"root": "/y"}}}, served_by={"version": "2.52.0"}))
    rows = [line.split(" | ")[0].lstrip("| ") for line in bundle.diff(str(a), str(b)).splitlines()[2:]]
    assert rows[:4] == ["version", "config serve.torch_threads", "server version", "bytes"], rows
    assert not any("paths" in r for r in rows)


# ---------------------------------------------------------------------------------------------- quant.recipe
RECIPE_RECORD = {"name": "general/ptq/fp8_default-kv_fp8_cast", "description": "FP8, cast KV", "algorithm": "max",
                 "probe": "qwen3", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "group_size": None,
                 "exclude_modules": ["lm_head"], "kv_constant_amax": True, "format": "fp8", "kv_cache": "fp8_cast",
                 "partial": []}


def test_the_recipe_reaches_bundle_json_names_its_published_entry_and_shows_in_diff(tmp_path):
    """The quantize result's recipe record -> bundle.json's quant.recipe (publish.quant_info, schema-checked) -> the
    published entry's prefix (``.recipe-<name>``) and ``pipeline diff``'s rows; a preset bundle records null."""
    from pipeline.results import QuantizeResult
    from tests.helpers.bundles import make_bundle, rewrite_manifest

    q = QuantizeResult.model_validate({"format": "fp8", "kv_cache": "fp8_cast", "recipe": RECIPE_RECORD,
                                       "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"})
    info = bundle.QuantInfo.model_validate(publish.quant_info("fp8", "fp8_cast", q)).model_dump(mode="json")
    assert info["recipe"] == RECIPE_RECORD
    preset_q = QuantizeResult.model_validate({"format": "fp8", "kv_cache": "fp8"})
    assert "recipe" not in preset_q.model_dump(mode="json")  # a preset build's manifest is as before
    assert publish.quant_info("fp8", "fp8", preset_q)["recipe"] is None
    with pytest.raises(ValueError):  # the record's keys are fixed
        bundle.QuantInfo.model_validate({**info, "recipe": {**RECIPE_RECORD, "extra": 1}})
    a = make_bundle(tmp_path / "a", kv="fp8_cast")
    b = make_bundle(tmp_path / "b", kv="fp8_cast", version="v0000000000bb")
    rewrite_manifest(b / "bundle.json", lambda d: d["quant"].update(recipe=info["recipe"]))
    bundle.BundleManifest.model_validate(json.loads((b / "bundle.json").read_text()))
    res = publish.upload(b, str(tmp_path / "published"), lock_dir=tmp_path / "locks")
    assert "/tiny-qwen3/fp8-kvfp8_cast.recipe-fp8_default-kv_fp8_cast/cpu/reference/v0000000000bb" in res["url"]
    table = bundle.diff(str(a), str(b))
    assert "| quant recipe | - | general/ptq/fp8_default-kv_fp8_cast |" in table, table
    assert "| quant recipe calibration | - | max |" in table, table
    assert "quant recipe leaves unquantized" not in table  # none on either side: no row
