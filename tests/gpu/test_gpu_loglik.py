"""The reference runtime's log-likelihood path on CUDA, as lm-eval reaches it: ``/v1/completions`` with ``echo`` and
``logprobs`` (every prompt position's logits) through the OpenAI front end and Triton, many prompts at once.

Runs unchanged on any CUDA machine with a Triton server (the bundled one or NVIDIA's on PATH); skipped, with the
reason, elsewhere. The tiny model keeps it to a few minutes.

    pytest -m gpu tests/gpu/test_gpu_loglik.py
"""
from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (none visible): the reference runtime's log-likelihood path on CUDA",
                allow_module_level=True)

QUICK_BENCH = ["bench.concurrency=[1]", "bench.requests_per_level=1", "bench.warmup_requests=0", "bench.only=[chat]",
               "bench.openai=false", "bench.plot=false", "bench.aiperf=false"]
SENTENCES = ["The capital of France is Paris.", "Water boils at one hundred degrees Celsius at sea level.",
             "A triangle has three sides.", "The quick brown fox jumps over the lazy dog near the river bank today.",
             "Light travels faster than sound.", "Seven is a prime number, and so are two, three and five.",
             "Mount Everest is the highest mountain above sea level on Earth, on the border of Nepal and China.",
             "Cats sleep a lot.", "Question: Which planet is known as the red planet?\nAnswer: Mars",
             "Question: How many legs does a spider have?\nAnswer: eight", "Bees make honey from nectar.",
             "The Pacific is the largest ocean.", "Iron rusts when it meets water and oxygen over a long time.",
             "Two plus two is four.", "Paper was invented in China.", "Sound cannot travel through a vacuum."]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """tiny-qwen3 built for this GPU up to eval_baseline: lm-eval's log-likelihood task through the front end
    against the unquantized baseline served by the reference runtime on CUDA (the path an H200 run failed on)."""
    import subprocess
    import sys

    from pipeline.errors import UserError
    from pipeline.triton import server
    from tests.conftest import cli_env

    try:
        server.find_server(None)
    except UserError as exc:  # e.g. only the bundled server, under numpy 2, without `make stub-env`
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("gpu-loglik")
    proc = subprocess.run([sys.executable, "-m", "pipeline", "build", "model=tiny-qwen3", "quant=fp8",
                           "quant.gate=warn", *QUICK_BENCH, "eval.limit=20", "until=eval_baseline", f"paths.root={root}"],
                          cwd=root, env=cli_env(root), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _baseline(root: Path) -> Path:
    (manifest,) = root.glob(".store/*-eval_baseline-*/manifest.json")
    return manifest.parent


def test_lm_eval_scores_every_item_through_the_reference_runtime_on_cuda(built):
    out = _baseline(built)
    repo_cfg = (out / "triton_repo" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'key: "device" value: { string_value: "cuda" }' in repo_cfg  # the baseline ran on the GPU
    doc = json.loads((out / "eval.json").read_text())
    items = doc["tasks"]["pipeline_facts"]["items"]["acc"]
    assert len(items) == 20 and set(items.values()) <= {0.0, 1.0}
    assert "ERROR" not in (out / "frontend.log").read_text()  # no request failed


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(f"{url}/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:2000]}") from None


def test_batched_log_likelihoods_on_cuda_are_those_of_each_prompt_alone(built, tmp_path):
    """lm-eval's requests (token ids, ``echo``, ``logprobs: 1``, ``max_tokens: 1``, ``temperature: 0``), one at a
    time and then eight in flight: every request answers, each echoes one log probability per prompt token after the
    first, and a prompt's log probabilities are the same bits whatever shared its pass (fixed-shape passes)."""
    from transformers import AutoTokenizer

    from tests.helpers.serving import Serve

    repo = _baseline(built) / "triton_repo"
    tok = AutoTokenizer.from_pretrained(str(repo / "tensorrt_llm" / "1" / "engine"))
    prompts = [tok(s)["input_ids"] for s in SENTENCES]
    assert len({len(p) for p in prompts}) > 4  # several lengths, so several pass widths
    with Serve(repo, "serve.openai.port=0", cwd=tmp_path) as s:
        with urllib.request.urlopen(f"{s.url}/models", timeout=60) as r:
            model = json.loads(r.read())["data"][0]["id"]

        def ask(ids):
            body = {"model": model, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
            return _post(s.url, body)["choices"][0]["logprobs"]["token_logprobs"]

        alone = [ask(p) for p in prompts]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(ask, prompts + prompts[::-1]))
        assert s.stop() == 0
    for p, lps in zip(prompts, alone):
        assert lps[0] is None and len(lps) >= len(p) and all(isinstance(x, float) for x in lps[1:len(p)])
    got = together[:len(prompts)]
    again = together[len(prompts):][::-1]
    for p, a, b in zip(prompts, alone, got):
        assert a[1:len(p)] == pytest.approx(b[1:len(p)], abs=0.05)  # the same model either way
    diff = [(i, j) for i, (a, b, c) in enumerate(zip(alone, got, again)) for j in range(1, len(prompts[i]))
            if not a[j] == b[j] == c[j]]
    assert not diff, f"{len(diff)} prompt positions' log probabilities depend on what shared their pass: {diff[:10]}"
