"""Child process for TensorRT-LLM work: ``python -m pipeline.runtime.trtllm_child SPEC.json``.

Runs the engine build (``trtllm-build``) and/or a load-and-generate check, so that GPU memory is returned when it
exits. Prints one JSON line (the result) last on stdout; exits non-zero with the error on stderr. The check asks for
``check_tokens`` greedy tokens with EOS ignored (``SamplingParams.ignore_eos``, tensorrt_llm/sampling_params.py)
and fails unless that many tokens and non-empty text come back (``trtllm.generation_problems``).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time


def _generate(llm, prompt: str, max_tokens: int) -> dict:
    from tensorrt_llm import SamplingParams

    from pipeline.runtime.trtllm import generation_problems

    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    first = out[0].outputs[0]
    check = {"prompt": prompt, "completion": first.text, "tokens": len(first.token_ids),
             "requested_tokens": max_tokens, "seconds": round(time.perf_counter() - t0, 3)}
    problems = generation_problems(check, max_tokens)
    if problems:
        print(json.dumps({"check": check}), flush=True)
        raise SystemExit(f"load-and-generate check failed: {'; '.join(problems)}")
    return check


def engine(spec: dict) -> dict:
    t0 = time.perf_counter()
    subprocess.run(spec["trtllm_build_args"], check=True)
    built = time.perf_counter() - t0
    from tensorrt_llm._tensorrt_engine import LLM

    llm = LLM(model=spec["engine_dir"], tokenizer=spec["tokenizer_dir"])
    return {"build_s": round(built, 2), "check": _generate(llm, spec["prompt"], spec["check_tokens"])}


def llmapi(spec: dict) -> dict:
    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi import CudaGraphConfig, KvCacheConfig

    opts = dict(spec["options"])
    opts["kv_cache_config"] = KvCacheConfig(**opts["kv_cache_config"])
    opts["cuda_graph_config"] = CudaGraphConfig(**opts["cuda_graph_config"])
    t0 = time.perf_counter()
    llm = LLM(model=spec["checkpoint_dir"], **opts)
    return {"load_s": round(time.perf_counter() - t0, 2), "check": _generate(llm, spec["prompt"],
                                                                             spec["check_tokens"])}


def versions() -> dict:
    import torch

    out = {"cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
           "sm": "%d%d" % torch.cuda.get_device_capability(0)}
    try:
        import pynvml

        pynvml.nvmlInit()
        out["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception:
        out["driver"] = None
    return out


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    result = {"engine": engine, "llmapi": llmapi}[spec["kind"]](spec)
    result["versions"] = versions()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
