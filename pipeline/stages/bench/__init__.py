"""bench: serve the packaged repository on a real Triton server, check answers, measure streaming load, gate.

The only stage (with ``pipeline.triton``) that talks to Triton. The server comes from ``serve.launcher``: a local
binary, an NGC container, or an external URL; before measuring, the server's models and their configs (names,
inputs, outputs) must match the packaged repository. The load goes through the layout's own entry point, recorded by
the package stage: ``ensemble`` (or ``tensorrt_llm_bls``, ``bench.model``) for ``inflight_batcher_llm``, the
``tensorrt_llm`` model with its LLM-API tensor names for ``llmapi``. Two workloads (``chat``: short prompts, long
outputs; ``rag``: long prompts, short outputs) are drawn reproducibly from the shipped corpus (``bench.seed``),
rendered with the chat template when ``model.chat_template`` is on, and swept over ``bench.concurrency`` after
``bench.warmup_requests`` warm-up requests (sent once, before the first workload). The default sweep depends on the
target device (``bench.sweep``): a short smoke on CPU, the full sweep on GPUs.

Output tokens are counted by re-tokenizing each response's returned text with the model's tokenizer (no special
tokens), as genai-perf and aiperf do: a response without text adds nothing. Inter-token latency is (request latency -
TTFT) / (output tokens - 1) per request, aiperf's definition.

- ``bench.json`` keeps genai-perf/aiperf profile-export field names (``time_to_first_token``,
  ``inter_token_latency``, ``request_latency``, ``output_token_throughput``, ``request_throughput``; ms).
- ``aiperf/<workload>/concurrency_<N>/`` holds aiperf's own export of each level (``bench.aiperf``): aiperf run
  natively with its OpenAI chat endpoint type (``--endpoint-type chat --streaming``, no request template) against the
  front end, with the level's prompts (``profile_export_aiperf.json``/``.csv``, ``profile_export.jsonl``,
  ``inputs.json``), which ``aiperf plot`` reads.
- ``requests.jsonl`` holds one line per request sent (answer checks, warm-up and every measured level).
- each level's ``noise`` (``bench.json``, and the bundle's bench rows): the bootstrap 95% interval of its TTFT p50,
  request latency p95 and output tokens/s over its own requests (``pipeline.stages.bench.noise``), which ``bench.md``
  shows and ``pipeline diff`` holds two bundles' changes against.

Gates (``bench.json["gates"]``): absolute limits (``bench.gates``) and the regression against the previous bundle of
the same model/quant/target/runtime (output tokens/s, and the p95 of TTFT, inter-token and request latency, each
within ``bench.gates.regression_pct``). The verdict is ``fail`` on a breach (the stage fails, naming the number and
by how much), ``no-baseline`` when the regression gate applies but the previous bundle cannot be read (an
unreachable ``publish.dest``, a corrupt ``bundle.json``) or shares no concurrency level with the run (nothing
compared), ``incomplete`` when no level was measured or a gated regression measure is missing on either side, else
``pass``. Only "nothing published yet" is an empty baseline.
"""
from pipeline.stages.bench import aiperf
from pipeline.stages.bench.gates import (GATE_FIELDS, REGRESSION_METRICS, baseline_line, gates, previous_bench,
                                         summary_row)
from pipeline.stages.bench.load import COUNTING, make_prompts, workload_names
from pipeline.stages.bench.bench_md import markdown, plot
from pipeline.stages.bench.stage import STAGE, bench_result, check, choose_entry, env_check, packaged_configs, run

__all__ = ["COUNTING", "GATE_FIELDS", "REGRESSION_METRICS", "STAGE", "aiperf",
           "baseline_line", "bench_result", "check", "choose_entry", "env_check", "gates", "make_prompts", "markdown",
           "packaged_configs", "plot", "previous_bench", "run", "summary_row", "workload_names"]
