"""The llmapi layout's TensorRT-LLM python model (``pipeline/triton/layouts/llmapi/models/tensorrt_llm.llmapi``)
answers as upstream's (NVIDIA/TensorRT-LLM ``triton_backend/all_models/llmapi/tensorrt_llm/1/model.py`` and
``helpers.py`` @ 044a90d209), in the real Triton server bundled in nvidia-pytriton, with a STAND-IN of TensorRT-LLM's
LLM API behind it (``tests/helpers/trtllm_standin``: TensorRT-LLM cannot be installed here, so this is never
TensorRT-LLM itself).

The repository is rendered by the package stage's own code (``runtime=trtllm_llmapi``: decoupled, unary, and two
instances with ``gpu_device_ids``), with a tokenizer for the front end; the stand-in is copied into each model's
version folder, which Triton's python backend puts on the stub's ``sys.path`` (the stub runs Python isolated, so
``PYTHONPATH`` does not reach it). The stand-in records what the model hands it (``LLM`` and ``SamplingParams``
arguments, aborts). Checked over tritonclient gRPC and through the project's OpenAI front end:

- streamed responses carry the cumulative text, and the front end returns exactly the stand-in's text, streamed and
  not;
- ``SamplingParams`` gets ``exclude_input_from_output`` False when the request lacks it (one response holds the
  prompt and the text), and no ``max_tokens`` when the request has none;
- a ``stop`` request aborts the running generation of its id and is answered CANCELLED (without an id it fails),
  also when the front end stops a stream its client left; a client cancellation aborts a generation;
- the perf outputs come back as STRING tensors of the LLM API's values;
- two instances get ``CUDA_VISIBLE_DEVICES`` from ``gpu_device_ids`` and ``gpus_per_node`` 2 each;
- streaming on a unary model fails with upstream's message.

Negative controls: each check also runs against a copy of model.py with one defect planted (:data:`PLANTS`), served
beside the real one (or reloaded in its place for the front end's checks), and must fail there.
"""
from __future__ import annotations

import itertools
import json
import queue
import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline import hardware
from pipeline.catalog import ENGINE_REL
from pipeline.triton.repository import render_repository
from pipeline.triton import lint, server
from tests.conftest import REPO
from tests.helpers.trtllm_standin import tensorrt_llm as standin

pytestmark = pytest.mark.e2e

STANDIN = Path(standin.__file__).parent
MODEL_PY = REPO / "pipeline" / "triton" / "layouts" / "llmapi" / "models" / "tensorrt_llm.llmapi" / "1" / "model.py"
MODEL = "tiny-standin"
PACE_S = 0.01  # the stand-in's seconds per generated word
UID = itertools.count()  # makes every prompt and request id unique
LONG = 300  # words of a generation that a check stops (3 s unless stopped)

# One defect each, planted in a copy of model.py: (old, new); each check must fail against its plant.
PLANTS = {
    "delta": ("_strings(s.text for s in seqs)", "_strings(s.text_diff for s in seqs)"),
    "exclude": ('"exclude_input_from_output": False, ', ""),
    "maxtokens": ('_SAMPLING_DEFAULTS = {"best_of": 1,', '_SAMPLING_DEFAULTS = {"max_tokens": 16, "best_of": 1,'),
    "nostop": ('if _scalar(request, "stop"):', "if False:"),
    "nocancel": ("if job.sender.is_cancelled():", "if False:"),
    "noperf": ("if metrics:", "if False:"),
    "nogpus": ('options["gpus_per_node"] = ', "_ = "),
    "unarystream": ("if streaming and not self.decoupled:", "if False:"),
}
BASE = {"delta": "decoupled", "exclude": "decoupled", "maxtokens": "decoupled", "nostop": "decoupled",
        "nocancel": "decoupled", "noperf": "decoupled", "nogpus": "multi", "unarystream": "unary"}


def _planted(name: str) -> str:
    old, new = PLANTS[name]
    text = MODEL_PY.read_text()
    assert text.count(old) == 1, (name, old)
    return text.replace(old, new)


def _render(dest: Path, *overrides: str) -> Path:
    repo = dest / "repo"
    (repo / ENGINE_REL).mkdir(parents=True)
    render_repository(hardware.compose(["model=tiny-qwen3", "runtime=trtllm_llmapi", *overrides]), repo)
    return repo / "tensorrt_llm"


def _add(repo: Path, src: Path, name: str, model_py: str | None = None) -> None:
    """``src`` (a rendered ``tensorrt_llm`` model) as model ``name``, with the stand-in in its version folder and
    its own ``model`` path in model.yaml (so the stand-in's records say which model they are from)."""
    dst = repo / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("engine"))
    cfg = dst / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('name: "tensorrt_llm"', f'name: "{name}"', 1))
    doc = yaml.safe_load((dst / "1" / "model.yaml").read_text())
    doc["model"] = f"/models/{name}"
    (dst / "1" / "model.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    if model_py is not None:
        (dst / "1" / "model.py").write_text(model_py)
    shutil.copytree(STANDIN, dst / "1" / "tensorrt_llm", ignore=shutil.ignore_patterns("__pycache__"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, repository, record folder): every model served at once, by explicit model control (the front end's
    checks reload ``tensorrt_llm``)."""
    from pipeline.stages.fetch import train_tokenizer

    base = tmp_path_factory.mktemp("llmapi-standin")
    repo = base / "repo"
    main = _render(base / "decoupled")
    shutil.copytree(main.parent, repo)
    assert lint.lint(repo) == []
    train_tokenizer(512).save_pretrained(repo / ENGINE_REL)  # for the front end; the stand-in reads no checkpoint
    shutil.copytree(STANDIN, repo / "tensorrt_llm" / "1" / "tensorrt_llm", ignore=shutil.ignore_patterns("__pycache__"))
    sources = {"decoupled": main, "unary": _render(base / "unary", "serve.decoupled=false"),
               "multi": _render(base / "multi", "target=h100", "build.tp_size=2", "serve.llm_instance_count=2")}
    assert 'string_value: "0,1;2,3"' in (sources["multi"] / "config.pbtxt").read_text()
    _add(repo, sources["unary"], "tensorrt_llm_unary")
    _add(repo, sources["multi"], "tensorrt_llm_multi")
    for plant, src in BASE.items():
        _add(repo, sources[src], f"tensorrt_llm_{plant}", _planted(plant))
    record = base / "record"
    record.mkdir()
    names = sorted(p.name for p in repo.iterdir() if (p / "config.pbtxt").is_file())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRTLLM_STANDIN_RECORD", str(record))
        mp.setenv("TRTLLM_STANDIN_TOKEN_S", str(PACE_S))
        with server.local_server(repo, host="127.0.0.1", server_bin=None, work_dir=base / "w", timeout_s=300,
                                 models=names) as s:
            yield s, repo, record


# --------------------------------------------------------------------------------------------------- helpers
def records(record: Path, event: str, **match) -> list[dict]:
    out = []
    for f in sorted(record.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            doc = json.loads(line)
            if doc["event"] == event and all(doc.get(k) == v for k, v in match.items()):
                out.append(doc)
    return out


def _model_path(name: str) -> str:
    return "/models/tensorrt_llm/1/engine" if name == "tensorrt_llm" else f"/models/{name}"


def _inputs(prompt: str | None = "", **values):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    arrays = {} if prompt is None else {"text_input": np.array([prompt], dtype=object)}
    for name, v in values.items():
        if isinstance(v, bool):
            arrays[name] = np.array([v])
        elif isinstance(v, int):
            arrays[name] = np.array([v], dtype=np.int32)
        elif isinstance(v, float):
            arrays[name] = np.array([v], dtype=np.float32)
        else:
            arrays[name] = np.array([s.encode() for s in v], dtype=object)
    out = []
    for name, arr in arrays.items():
        t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


class Stream:
    """A tritonclient gRPC stream collecting every response (or error) it gets."""

    def __init__(self, s):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(s.grpc_url)
        self.got: queue.Queue = queue.Queue()
        self.client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), self.got))
        self.closed = False

    def send(self, model: str, request_id: str, prompt: str | None = "", **values) -> "Stream":
        self.client.async_stream_infer(model, _inputs(prompt, **values), request_id=request_id)
        return self

    def next(self, timeout: float = 30):
        return self.got.get(timeout=timeout)

    def close(self, cancel: bool = False) -> list:
        """Close the stream once the server has ended its requests, or at once cancelling them (``cancel``; only
        while one runs: Triton 2.51 keeps a model version it has answered a request of on a stream cancelled after
        that answer, so it never unloads); -> everything received since the last ``next``."""
        if not self.closed:
            self.closed = True
            self.client.stop_stream(cancel_requests=cancel)
            self.client.close()
        items = []
        while not self.got.empty():
            items.append(self.got.get())
        return items


def ask(s, model: str, prompt: str | None = "", request_id: str = "1", **values) -> list:
    """One request on a stream of its own -> every response or error, once the server has ended it."""
    return Stream(s).send(model, request_id, prompt, **values).close()


def unary(s, model: str, prompt: str | None = "", request_id: str = "1", **values):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        return grpcclient.InferenceServerClient(s.grpc_url).infer(model, _inputs(prompt, **values),
                                                                  request_id=request_id, client_timeout=30)
    except InferenceServerException as exc:
        return exc


def errors(items) -> list[str]:
    from tritonclient.utils import InferenceServerException

    return [str(i) for i in items if isinstance(i, InferenceServerException)]


def text(result, name: str = "text_output") -> str | None:
    a = result.as_numpy(name)
    return None if a is None else a.reshape(-1)[0].decode("utf-8")


def generated(prompt: str, n: int) -> str:
    return "".join(standin.words(prompt, n))


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def for_each(check, model: str, plant: str, *args) -> None:
    """``check`` passes against ``model`` and fails (AssertionError) against ``plant``'s copy of it."""
    check(*args, model)
    with pytest.raises(AssertionError):
        check(*args, f"tensorrt_llm_{plant}")


# ---------------------------------------------------------------------------------------------------- checks
def check_cumulative(s, record, model):
    prompt = f"cumulative {model} {next(UID)}"
    items = ask(s, model, prompt, sampling_param_max_tokens=6, streaming=True)
    assert errors(items) == []
    want = standin.words(prompt, 6)
    assert [text(r) for r in items] == ["".join(want[:i + 1]) for i in range(6)]


def check_exclude_default(s, record, model):
    prompt = f"exclude {model} {next(UID)}"
    one = (lambda *a, **k: [unary(*a, **k)]) if model == "tensorrt_llm_unary" else ask
    got = one(s, model, prompt, sampling_param_max_tokens=5)
    assert errors(got) == [] and [text(r) for r in got] == [prompt + generated(prompt, 5)]
    sampling = records(record, "generate", model=_model_path(model), prompt=prompt)[-1]["sampling"]
    assert sampling["exclude_input_from_output"] is False
    without = f"excluded {model} {next(UID)}"
    got = one(s, model, without, sampling_param_max_tokens=5, sampling_param_exclude_input_from_output=True)
    assert [text(r) for r in got] == [generated(without, 5)]


def check_max_tokens_default(s, record, model):
    prompt = f"default length {model} {next(UID)}"
    items = ask(s, model, prompt)  # no sampling_param_max_tokens
    assert errors(items) == [] and [text(r) for r in items] == [prompt + generated(prompt, 32)]  # the LLM API's 32
    sampling = records(record, "generate", model=_model_path(model), prompt=prompt)[-1]["sampling"]
    assert "max_tokens" not in sampling
    assert sampling == {"best_of": 1, "exclude_input_from_output": False, "return_perf_metrics": False}


def check_guide(s, record, model):
    """A guide in this project's two inputs becomes ``SamplingParams(guided_decoding=GuidedDecodingParams(...))``, the
    field the record names for its type (``json`` -> ``json_object``); an unknown type fails the request."""
    schema = '{"type": "object"}'
    for kind, guide, want in (("json_schema", [schema], {"json": schema}), ("json", [], {"json_object": True})):
        prompt = f"guided {kind} {model} {next(UID)}"
        extra = {"guided_decoding_guide": guide} if guide else {}
        items = ask(s, model, prompt, sampling_param_max_tokens=2, guided_decoding_guide_type=[kind], **extra)
        assert errors(items) == []
        sampling = records(record, "generate", model=_model_path(model), prompt=prompt)[-1]["sampling"]
        assert sampling["guided_decoding"] == {"GuidedDecodingParams": want}
    refused = ask(s, model, f"guided xml {model} {next(UID)}", guided_decoding_guide_type=["xml"])
    assert any("unknown guided_decoding_guide_type 'xml'" in e for e in errors(refused))


def check_stop(s, record, model):
    """A stop request aborts the streaming generation of its id (which ends with its text so far, finish reason
    ``cancelled``) and a non-streaming one (which ends CANCELLED); the stop request is answered CANCELLED, also for
    an id nothing runs under; without an id it fails."""
    prompt, rid = f"stop me {model} {next(UID)}", f"stop-{model}-{next(UID)}"
    running = Stream(s).send(model, rid, prompt, sampling_param_max_tokens=LONG, streaming=True,
                             return_finish_reason=True)
    try:
        first = running.next()
        assert not errors([first])
        stop = ask(s, model, "", request_id=rid, stop=True)
        assert len(stop) == 1 and errors(stop) and "Request cancelled by client" in errors(stop)[0]
    finally:
        rest = running.close()
    assert errors(rest) == [] and rest
    assert rest[-1].as_numpy("finish_reason").tolist() == [b"cancelled"]
    assert text(rest[-1]) == generated(prompt, len(rest)) and len(rest) < LONG
    assert records(record, "abort", model=_model_path(model), prompt=prompt)
    # non-streaming, on a stream of its own
    quiet = f"stop me quietly {model} {next(UID)}"
    running = Stream(s).send(model, rid, quiet, sampling_param_max_tokens=LONG)
    try:
        assert wait_for(lambda: records(record, "generate", model=_model_path(model), prompt=quiet), 10)
        assert "Request cancelled by client" in errors(ask(s, model, "", request_id=rid, stop=True))[0]
        ended = running.next(timeout=10)
    finally:
        running.close()
    assert errors([ended]) and "Request cancelled by client" in errors([ended])[0]
    # an id nothing runs under; no id at all
    assert "Request cancelled by client" in errors(ask(s, model, "", request_id="nothing-runs", stop=True))[0]
    no_id = errors(ask(s, model, "", request_id="", stop=True))
    assert no_id and "A request id must be provided for request cancellation" in no_id[0]


def check_client_cancel(s, record, model):
    """A stream cancelled by its client: the cancellation thread aborts the generation within its period."""
    prompt = f"cancel me {model} {next(UID)}"
    running = Stream(s).send(model, f"cancel-{model}", prompt, sampling_param_max_tokens=LONG, streaming=True)
    try:
        assert not errors([running.next()])
    finally:
        running.close(cancel=True)
    assert wait_for(lambda: records(record, "abort", model=_model_path(model), prompt=prompt), 1.5)


def check_perf(s, record, model):
    plain = ask(s, model, f"no perf {model} {next(UID)}", sampling_param_max_tokens=2)
    assert plain and all(r.as_numpy(n) is None for r in plain for n in standin.PERF_STRINGS)
    for streaming in (False, True):
        items = ask(s, model, f"perf {model} {streaming} {next(UID)}", sampling_param_max_tokens=2, streaming=streaming,
                    sampling_param_return_perf_metrics=True)
        assert errors(items) == [] and len(items) == (2 if streaming else 1)
        for r in items:
            got = {n: r.as_numpy(n) for n in standin.PERF_STRINGS}
            assert all(a is not None and a.dtype == object for a in got.values()), got
            assert {n: a.reshape(-1)[0].decode() for n, a in got.items()} == standin.PERF_STRINGS
            assert r.get_output("arrival_time_ns").datatype == "BYTES"


def check_instances(s, record, model):
    llms = records(record, "LLM", cuda_visible_devices="0,1") + records(record, "LLM", cuda_visible_devices="2,3")
    mine = sorted((r["cuda_visible_devices"], r["trtllm_visible_devices"], r["kwargs"].get("gpus_per_node"))
                  for r in llms if r["kwargs"]["model"] == _model_path(model))
    assert mine == [("0,1", "0,1", 2), ("2,3", "2,3", 2)]


def check_unary_streaming(s, record, model):
    # one token: without the model's refusal, a unary model would send its one response
    refused = unary(s, model, f"stream unary {model} {next(UID)}", sampling_param_max_tokens=1, streaming=True)
    assert errors([refused]) and "Error generating request: Streaming is only supported in decoupled mode." in \
        errors([refused])[0]


# ----------------------------------------------------------------------------------------------------- tests
def test_streamed_responses_carry_the_cumulative_text(served):
    s, _, record = served
    for_each(check_cumulative, "tensorrt_llm", "delta", s, record)
    check_guide(s, record, "tensorrt_llm")


def test_exclude_input_from_output_defaults_to_false_and_max_tokens_to_the_llm_api(served):
    s, _, record = served
    for_each(check_exclude_default, "tensorrt_llm", "exclude", s, record)
    check_exclude_default(s, record, "tensorrt_llm_unary")
    for_each(check_max_tokens_default, "tensorrt_llm", "maxtokens", s, record)


def test_a_stop_request_aborts_the_generation_of_its_id(served):
    import tritonclient.grpc as grpcclient

    s, _, record = served
    for_each(check_stop, "tensorrt_llm", "nostop", s, record)
    # unary: the running call ends CANCELLED, and the stop request's own status is CANCELLED
    model, prompt = "tensorrt_llm_unary", "stop unary"
    got: queue.Queue = queue.Queue()
    grpcclient.InferenceServerClient(s.grpc_url).async_infer(
        model, _inputs(prompt, sampling_param_max_tokens=LONG), request_id="unary-stop",
        callback=partial(lambda q, result, error: q.put(error or result), got))
    assert wait_for(lambda: records(record, "generate", model=_model_path(model), prompt=prompt), 10)
    stop = unary(s, model, "", request_id="unary-stop", stop=True)
    assert errors([stop]) and "Request cancelled by client" in str(stop) and stop.status() == "StatusCode.CANCELLED"
    ended = got.get(timeout=10)
    assert errors([ended]) and "Request cancelled by client" in str(ended)
    assert records(record, "abort", model=_model_path(model), prompt=prompt)


def test_a_client_cancellation_aborts_the_generation(served):
    import tritonclient.grpc as grpcclient

    s, _, record = served
    for_each(check_client_cancel, "tensorrt_llm", "nocancel", s, record)
    # a unary call cancelled by its client
    prompt = "cancel unary"
    got: queue.Queue = queue.Queue()
    call = grpcclient.InferenceServerClient(s.grpc_url).async_infer(
        "tensorrt_llm_unary", _inputs(prompt, sampling_param_max_tokens=LONG),
        callback=partial(lambda q, result, error: q.put(error or result), got), request_id="unary-cancel")
    assert wait_for(lambda: records(record, "generate", model=_model_path("tensorrt_llm_unary"), prompt=prompt), 10)
    call.cancel()
    assert "CANCELLED" in errors([got.get(timeout=10)])[0]
    assert wait_for(lambda: records(record, "abort", model=_model_path("tensorrt_llm_unary"), prompt=prompt), 1.5)


def test_perf_outputs_are_strings(served):
    s, _, record = served
    for_each(check_perf, "tensorrt_llm", "noperf", s, record)


def test_each_instance_gets_its_gpus_and_gpus_per_node(served):
    s, _, record = served
    for_each(check_instances, "tensorrt_llm_multi", "nogpus", s, record)


def test_streaming_on_a_unary_model_is_refused(served):
    s, _, record = served
    for_each(check_unary_streaming, "tensorrt_llm_unary", "unarystream", s, record)


# ------------------------------------------------------------------------------------------------- front end
def _front(s, repo):
    from pipeline.serving import run

    cfg = hardware.compose([f"serve.openai.model_name={MODEL}"])
    return run.running(repo, s.grpc_url, cfg.serve.openai)


def _reloaded(s, repo: Path, model_py: str):
    """``tensorrt_llm`` reloaded with ``model_py``."""
    import tritonclient.grpc as grpcclient

    (repo / "tensorrt_llm" / "1" / "model.py").write_text(model_py)
    grpcclient.InferenceServerClient(s.grpc_url).load_model("tensorrt_llm")


def check_front_end_text(url, record):
    import openai

    prompt = f"The front end asks {next(UID)}"
    with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60) as c:
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=7, stream=True))
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        whole = c.completions.create(model=MODEL, prompt=prompt, max_tokens=7)
    assert streamed == generated(prompt, 7) == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length"


def check_front_end_stops(url, record):
    """A client leaving a stream: the front end sends the model a ``stop`` request, which aborts the generation."""
    import httpx

    prompt = f"The front end stops {next(UID)}"
    with httpx.Client(base_url=url, timeout=60) as h:
        with h.stream("POST", "/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": LONG,
                                                    "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
    assert wait_for(lambda: records(record, "abort", model=_model_path("tensorrt_llm"), prompt=prompt), 2)


def test_the_front_end_returns_the_llm_apis_text_and_stops_what_it_leaves(served):
    s, repo, record = served
    checks = {"delta": check_front_end_text, "nostop": check_front_end_stops}
    with _front(s, repo) as url:
        for check in checks.values():
            check(url, record)
    original = (repo / "tensorrt_llm" / "1" / "model.py").read_text()
    try:
        for plant, check in checks.items():
            _reloaded(s, repo, _planted(plant))
            with _front(s, repo) as url:
                with pytest.raises(AssertionError):
                    check(url, record)
    finally:
        _reloaded(s, repo, original)
