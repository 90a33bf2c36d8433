"""The build stage's engine spec and its shared TensorRT timing cache (no TensorRT-LLM needed)."""
from __future__ import annotations

from pipeline import hardware


def _engine_ctx(tmp_path, shared_content: bytes | None):
    from pipeline import planning
    from pipeline.runner.contract import Context
    from pipeline.runner.fingerprint import capacity_fields
    from pipeline.stages import build

    cfg = hardware.compose(["model=qwen32b", "target=h100", "runtime=trtllm_engine"])
    quantize = tmp_path / "quantize"
    (quantize / "checkpoint").mkdir(parents=True)
    (quantize / "checkpoint" / "tokenizer.json").write_text("{}")
    (quantize / "checkpoint" / "model.safetensors").write_bytes(b"weights")
    out = tmp_path / "engines" / ".build.tmp-1"
    (out / "engine").mkdir(parents=True)
    shared = build.timing_cache_path(tmp_path / "store", 90, "10.13")
    if shared_content is not None:
        shared.parent.mkdir(parents=True)
        shared.write_bytes(shared_content)
    capacity = planning.CapacityView(planning.resolve(cfg).values(capacity_fields(cfg, build.STAGE)))
    ctx = Context(cfg=cfg, stage=build.STAGE, out=out, final=tmp_path / "engines" / "build", inputs={"quantize":
                  quantize}, manifests={"quantize": {}}, paths={"store": tmp_path / "store"}, capacity=capacity)
    return ctx, shared


def test_engine_build_reads_and_writes_its_own_copy_of_the_timing_cache(tmp_path):
    from pipeline.stages import build

    ctx, shared = _engine_ctx(tmp_path, b"shared cache")
    spec = build.engine_build_spec(ctx, "FP8", "FP8", "10.13")
    args = spec["trtllm_build_args"]
    own = ctx.out / build.TIMING_CACHE
    assert args[args.index("--input_timing_cache") + 1] == args[args.index("--output_timing_cache") + 1] == str(own)
    assert own.read_bytes() == b"shared cache" and shared.name == "sm90-trt10.13.cache"
    assert (ctx.out / "engine" / "tokenizer.json").is_file() and not (ctx.out / "engine" / "model.safetensors").exists()
    own.write_bytes(b"shared cache + this build's timings")  # what trtllm-build's --output_timing_cache does
    build.publish_timing_cache(own, shared)
    assert shared.read_bytes() == b"shared cache + this build's timings"
    assert not own.exists() and [p.name for p in shared.parent.iterdir()] == [shared.name]

    first, _ = _engine_ctx(tmp_path / "first", None)  # no shared cache yet: the build starts without one
    build.engine_build_spec(first, "FP8", "FP8", "10.13")
    assert not (first.out / build.TIMING_CACHE).exists()


def test_concurrent_timing_cache_publishes_are_never_seen_half_written(tmp_path):
    """Builds finishing together each replace the shared cache; a build starting meanwhile copies one of them
    whole (each cache is 4 MB of one repeated byte, so a torn file would mix bytes or be short)."""
    import threading

    from pipeline.stages import build

    shared = build.timing_cache_path(tmp_path / "store", 100, "10.13")
    size, writers, done = 4 << 20, 4, threading.Event()

    def publisher(k: int):
        for n in range(10):
            own = tmp_path / f"own-{k}-{n}.cache"
            own.write_bytes(bytes([k]) * size)
            build.publish_timing_cache(own, shared)

    seen: list[bytes] = []

    def starter():
        while not done.is_set():
            own = tmp_path / "starting.cache"
            build.seed_timing_cache(shared, own)
            if own.exists():
                data = own.read_bytes()
                seen.append(data[:1] if len(data) == size and data.count(data[:1]) == size else b"torn")

    threads = [threading.Thread(target=publisher, args=(k,)) for k in range(1, writers + 1)]
    reader = threading.Thread(target=starter)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    reader.join()
    assert seen and b"torn" not in seen
    assert shared.read_bytes() in {bytes([k]) * size for k in range(1, writers + 1)}
    assert [p.name for p in shared.parent.iterdir()] == [shared.name]  # no temp file left behind


def test_one_tokenizer_file_list_serves_fetch_quantize_and_build():
    from pipeline.stages import fetch
    from pipeline.tokenizer_files import TOKENIZER_GLOBS, is_tokenizer_file

    assert set(TOKENIZER_GLOBS) <= set(fetch.META_PATTERNS)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                 "tokenizer.model", "qwen.tiktoken", "chat_template.jinja"):
        assert is_tokenizer_file(name), name
    for name in ("model.safetensors", "config.json", "hf_quant_config.json", "rank0.engine"):
        assert not is_tokenizer_file(name), name
