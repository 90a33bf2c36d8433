"""TensorRT-LLM's ``tensorrt_llm`` model (``inflight_batcher_llm`` layout) computed by the reference runtime.

The tensors are upstream's (tensorrtllm_backend all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt): the
model reads the inputs and outputs its ``config.pbtxt`` declares and serves them with the semantics of upstream's
python ``tensorrt_llm`` model. Every prompt of every request goes to one batching engine (``reference_decode_engine.py``),
so concurrent requests share each forward pass.

- Decoupled or not (``model_transaction_policy.decoupled``); several prompts per request (the batch dimension),
  each answered separately with ``batch_index`` when there are several; ``num_return_sequences`` sampled sequences
  per prompt (seeds ``seed``, ``seed + 1``, ...) with ``sequence_index``.
- ``streaming``: one response per generated token per prompt (decoupled only); otherwise one response per sequence
  (decoupled) or one response for the whole request (not decoupled).
- ``exclude_input_in_output`` (the request's, else the ``exclude_input_in_output`` parameter), ``end_id`` (not part
  of the output, as in TensorRT-LLM), ``pad_id`` (pads ragged outputs of one unary response), ``stop_words_list`` /
  ``bad_words_list`` in upstream's ``[2, N]`` format (flat ids; cumulative end offsets padded with -1),
  ``embedding_bias``, ``temperature``, ``runtime_top_k``, ``runtime_top_p`` (as TensorRT-LLM reads them: top-k and
  top-p both 0, their defaults, decode greedily whatever the temperature), ``seed``, ``min_tokens``,
  ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``return_log_probs`` (``cum_log_probs``,
  ``output_log_probs``), ``return_context_logits``, ``return_generation_logits``, ``return_num_input_tokens``,
  ``return_num_output_tokens``, ``return_perf_metrics`` (timings measured here; the reference keeps no paged KV
  cache and drafts nothing, so block and draft counts are 0), ``stop`` (stops the requests with that request id)
  and client cancellation.
- Guided decoding as the C++ backend sets it up (``triton_backend/inflight_batcher_llm/src/model_instance_state.cc``
  ``getGuidedDecodingConfigFromParams`` and ``utils.cc`` ``getGuidedDecodingParamsFromTensors`` @ c8c6df08): with the
  ``guided_decoding_backend`` (``xgrammar``) and ``xgrammar_tokenizer_info_path`` parameters set, a request's
  ``guided_decoding_guide_type`` (``json``, ``json_schema``, ``regex``, ``ebnf_grammar``) and
  ``guided_decoding_guide`` are compiled with XGrammar from that tokenizer info (``reference_guided.py``, each type
  as TensorRT-LLM compiles it) and its token bitmask masks every step of the sequence. Where upstream ignores an
  unknown guide type, and has no guided decoding when the parameters are empty, the reference refuses the request
  with the reason.
- Load metrics under the C++ backend's names (``nv_trt_llm_request_metrics``, ``nv_trt_llm_kv_cache_block_metrics``,
  ``nv_trt_llm_general_metrics``; ``reference_common.LoadMetrics``), read from the batching engine.
- Beam-search-only knobs (``len_penalty``, ``early_stopping``, ``beam_search_diversity_rate``) and KV-cache retention
  hints have no effect on single-beam reference decoding and are accepted. ``decoder_input_ids`` /
  ``decoder_input_lengths`` (what preprocessing sends for decoder-only models) are ignored.
- Refused per request, naming the feature: beam search (``beam_width`` > 1), draft tokens, encoder / multimodal
  inputs, prompt tables, LoRA, mrope, disaggregated context phase, lookahead decoding, top-p decay.
"""
import json
import os
import queue
import sys
import threading
import time
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_common import (LoadMetrics, RequestError, Sender as _Sender, param as _param,  # noqa: E402
                              repo_path, watch_cancellation)

# Inputs whose presence (non-empty) asks for something the reference cannot compute -> the feature it names.
UNSUPPORTED = {
    "draft_input_ids": "speculative decoding (draft_input_ids)",
    "draft_logits": "speculative decoding (draft_logits)",
    "encoder_input_features": "encoder-decoder / multimodal inputs (encoder_input_features)",
    "encoder_output_lengths": "encoder-decoder / multimodal inputs (encoder_output_lengths)",
    "cross_attention_mask": "encoder-decoder / multimodal inputs (cross_attention_mask)",
    "skip_cross_attn_blocks": "encoder-decoder / multimodal inputs (skip_cross_attn_blocks)",
    "prompt_embedding_table": "prompt tuning (prompt_embedding_table)",
    "mrope_rotary_cos_sin": "multimodal rotary embeddings (mrope_rotary_cos_sin)",
    "mrope_position_deltas": "multimodal rotary embeddings (mrope_position_deltas)",
    "lora_task_id": "LoRA adapters (lora_task_id)",
    "lora_weights": "LoRA adapters (lora_weights)",
    "lora_config": "LoRA adapters (lora_config)",
    "context_phase_params": "disaggregated serving (context_phase_params)",
    "lookahead_window_size": "lookahead decoding (lookahead_window_size)",
    "lookahead_ngram_size": "lookahead decoding (lookahead_ngram_size)",
    "lookahead_verification_set_size": "lookahead decoding (lookahead_verification_set_size)",
}
NP_TYPES = {"TYPE_FP32": np.float32, "TYPE_FP16": np.float16, "TYPE_BF16": np.float32, "TYPE_INT32": np.int32,
            "TYPE_INT64": np.int64, "TYPE_UINT8": np.uint8, "TYPE_BOOL": np.bool_}


def _array(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    a = t.as_numpy()
    return None if a.size == 0 else a


def _scalar(request, name, b, batch, default):
    """The value of an optional per-prompt scalar input for prompt ``b`` (shape [B], [B, 1] or one shared value)."""
    a = _array(request, name)
    if a is None:
        return default
    flat = a.reshape(-1)
    if flat.size == batch:
        return flat[b].item()
    if flat.size == 1:
        return flat[0].item()
    raise RequestError(f"{name}: expected one value per prompt ({batch}), got shape {list(a.shape)}")


def _text(request, name, b, batch):
    """An optional per-prompt BYTES input as text (None without it)."""
    a = _array(request, name)
    if a is None:
        return None
    flat = a.reshape(-1)
    if flat.size not in (1, batch):
        raise RequestError(f"{name}: expected one value per prompt ({batch}), got shape {list(a.shape)}")
    v = flat[b if flat.size == batch else 0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def _words(request, name, b, batch):
    """Upstream's word-list format -> list of token-id lists: row 0 the flat ids, row 1 cumulative end offsets."""
    a = _array(request, name)
    if a is None:
        return []
    if a.ndim == 2:
        a = a[None]
    if a.ndim != 3 or a.shape[1] != 2:
        raise RequestError(f"{name}: expected shape [batch, 2, N] (flat ids, offsets), got {list(a.shape)}")
    row = a[b] if a.shape[0] == batch else a[0]
    ids, offsets = row[0].tolist(), row[1].tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:
            continue
        if end > len(ids) or end < start:
            raise RequestError(f"{name}: offset {end} does not fit {len(ids)} flat ids")
        if end > start:
            words.append(ids[start:end])
        start = end
    return words


def _sampling(temperature, top_k, top_p):
    """TensorRT-LLM's sampling semantics -> the batching engine's (temperature, top_k, top_p). TensorRT-LLM's defaults
    are temperature 1, top-k 0, top-p 0 (cpp/tensorrt_llm/layers/defaultDecodingParams.h), and it regularizes
    top-k 0 with top-p 0 to greedy (top-k 1) and top-k > 0 with top-p 0 to top-p 1
    (cpp/tensorrt_llm/kernels/samplingTopKKernels.h ``regularizeTopKTopP``): a request that sets only a temperature
    decodes greedily. The engine decodes greedily at temperature 0."""
    if top_k == 0 and top_p == 0.0:
        return 0.0, 0, 1.0
    return temperature, top_k, (1.0 if top_p == 0.0 else top_p)


def _i32(values):
    return np.array(values, dtype=np.int32)


class _Job:
    """One Triton request: its prompts' sequences, the engine's events for them, and how to answer."""

    def __init__(self, request, sender, user_id, prompts, streaming, arrival_ns):
        self.request, self.sender, self.user_id = request, sender, user_id
        self.prompts = prompts          # list of dicts, one per (batch_index, sequence_index)
        self.streaming = streaming
        self.arrival_ns = arrival_ns
        self.events = queue.Queue()
        self.handles = []
        self.batch_size = 1 + max(p["batch_index"] for p in prompts)
        self.num_sequences = 1 + max(p["sequence_index"] for p in prompts)
        try:
            self.requested = set(request.requested_output_names())
        except Exception:
            self.requested = None

    def cancel(self):
        for h in self.handles:
            h.cancel()


class TritonPythonModel:
    def initialize(self, args):
        import torch
        import reference_decode_engine as decode_engine
        import reference_runtime as rt
        import reference_formats as formats

        cfg = json.loads(args["model_config"])
        self.cfg = cfg
        self.outputs = {o["name"]: o["data_type"] for o in cfg.get("output", [])}
        # engine_dir: the checkpoint, relative to the repository root (gpt_model_path is where the C++ backend would
        # find an engine inside the serving container).
        key = "engine_dir" if _param(cfg, "engine_dir") else "gpt_model_path"
        path = _param(cfg, key)
        if not path:
            raise pb_utils.TritonModelException("parameter engine_dir (the checkpoint directory) is not set")
        if not os.path.isabs(path):
            path = os.path.normpath(os.path.join(args["model_repository"], "..", path))
        if not os.path.isdir(path):
            raise pb_utils.TritonModelException(f"parameter {key}: {path} is not a directory")
        threads = int(_param(cfg, "torch_threads", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        device = _param(cfg, "device", "cpu")
        dtype = rt.compute_dtype(_param(cfg, "dtype", "auto"), device)  # auto: bfloat16 where it is native
        self.model = rt.load(path, dtype=dtype, device=device, formats=formats)
        gen_cfg = getattr(self.model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None) or self.model.config.eos_token_id
        self.model_eos = frozenset(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        max_seq = _param(cfg, "max_seq_len")
        self.decode_engine = decode_engine
        self.engine = decode_engine.BatchEngine(self.model, max_batch_size=max(1, int(cfg.get("max_batch_size") or 1)),
                                           max_seq_len=int(max_seq) if max_seq else None)
        # the load TensorRT-LLM's backend reports (nv_trt_llm_request_metrics, nv_trt_llm_kv_cache_block_metrics),
        # every stats_check_period_ms as upstream's parameter says (100 ms, its default)
        self.load = LoadMetrics(self.engine, args["model_name"], args["model_version"],
                                period_s=int(_param(cfg, "stats_check_period_ms", "100")) / 1000.0)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.exclude_default = (_param(cfg, "exclude_input_in_output", "false").lower() in ("1", "true"))
        self.logits_np = NP_TYPES.get(self.outputs.get("generation_logits") or self.outputs.get("context_logits")
                                      or "TYPE_FP32", np.float32)
        self.cancel_period_s = int(_param(cfg, "cancellation_check_period_ms", "100")) / 1000.0
        self.grammars = self._guided_decoding(cfg, args)
        self.jobs = set()
        self.lock = threading.Lock()
        self.running = True
        self.watcher = threading.Thread(target=watch_cancellation, args=(self,), daemon=True)
        self.watcher.start()

    def _guided_decoding(self, cfg, args):
        """XGrammar for the model, as the C++ backend builds its GuidedDecodingConfig: none while
        ``guided_decoding_backend`` or ``xgrammar_tokenizer_info_path`` is empty; ``xgrammar`` only; the tokenizer info
        file must exist."""
        import reference_guided as guided

        backend, path = _param(cfg, "guided_decoding_backend"), _param(cfg, "xgrammar_tokenizer_info_path")
        if not backend or not path:
            return None
        if backend != "xgrammar":
            raise pb_utils.TritonModelException("Guided decoding is currently supported with 'xgrammar' backend. "
                                                "Invalid guided_decoding_backend parameter provided.")
        found = repo_path(args, path)
        if not os.path.isfile(found):
            raise pb_utils.TritonModelException(f"Xgrammar's tokenizer info path at {path} does not exist.")
        return guided.Grammars(guided.read_tokenizer_info(found), vocab_size=self.engine.vocab_size)

    def _grammar(self, request, b, batch):
        """The prompt's grammar state (a new one per sequence), or None without a guide."""
        import reference_guided as guided

        kind = _text(request, "guided_decoding_guide_type", b, batch)
        if kind is None:
            return None
        if self.grammars is None:
            raise RequestError("guided decoding (guided_decoding_guide_type) needs the model's guided_decoding_backend "
                               "and xgrammar_tokenizer_info_path parameters, which are empty")
        try:
            return self.grammars.matcher(kind, _text(request, "guided_decoding_guide", b, batch))
        except guided.GuideError as exc:
            raise RequestError(f"guided decoding: {exc}") from None

    # --- requests ----------------------------------------------------------------------------------------------
    def execute(self, requests):
        now = time.time_ns()
        for request in requests:
            sender = _Sender(request.get_response_sender())
            user_id = request.request_id()
            try:
                stop = _array(request, "stop")
                if stop is not None and bool(stop.reshape(-1)[0]):
                    self._stop(user_id, sender)
                    continue
                job = _Job(request, sender, user_id, *self._convert(request), now)
            except Exception as exc:  # this request alone fails, with the reason
                self._fail(sender, exc)
                continue
            self._start(job)
        return None

    def _convert(self, request):
        ids = _array(request, "input_ids")
        if ids is None:
            raise RequestError("input_ids is required")
        if ids.ndim == 1:
            ids = ids[None]
        batch = ids.shape[0]
        for name, feature in UNSUPPORTED.items():
            if _array(request, name) is not None:
                raise RequestError(f"{feature} is not supported by the reference runtime")
        prompts = []
        streaming = False
        for b in range(batch):
            beam = int(_scalar(request, "beam_width", b, batch, 1))
            if beam > 1:
                raise RequestError(f"beam search (beam_width={beam}) is not supported by the reference runtime")
            decay = float(_scalar(request, "runtime_top_p_decay", b, batch, 1.0))
            if decay != 1.0 or _array(request, "runtime_top_p_reset_ids") is not None:
                raise RequestError("top-p decay (runtime_top_p_decay / runtime_top_p_reset_ids) is not supported "
                                   "by the reference runtime")
            if _array(request, "request_output_len") is None:
                raise RequestError("request_output_len is required")
            length = int(_scalar(request, "input_lengths", b, batch, ids.shape[1]))
            if not 0 < length <= ids.shape[1]:
                raise RequestError(f"input_lengths {length} does not fit input_ids of width {ids.shape[1]}")
            streaming = bool(_scalar(request, "streaming", b, batch, False))
            if streaming and not self.decoupled:
                raise RequestError("streaming needs a decoupled model (model_transaction_policy.decoupled: true)")
            end_id = _scalar(request, "end_id", b, batch, None)
            pad_id = _scalar(request, "pad_id", b, batch, None)
            exclude = _scalar(request, "exclude_input_in_output", b, batch, None)
            bias = _array(request, "embedding_bias")
            if bias is not None:
                bias = (bias.reshape(batch, -1)[b] if bias.size % batch == 0 and bias.ndim > 1 else bias.reshape(-1))
            temperature, top_k, top_p = _sampling(float(_scalar(request, "temperature", b, batch, 1.0)),
                                                  int(_scalar(request, "runtime_top_k", b, batch, 0)),
                                                  float(_scalar(request, "runtime_top_p", b, batch, 0.0)))
            n_seq = int(_scalar(request, "num_return_sequences", b, batch, 1))
            if n_seq < 1:
                raise RequestError(f"num_return_sequences must be >= 1, got {n_seq}")
            seed = int(_scalar(request, "seed", b, batch, 0))
            common = dict(
                input_ids=ids[b, :length].astype(np.int64).tolist(),
                max_new_tokens=int(_scalar(request, "request_output_len", b, batch, 0)),
                end_ids=frozenset([int(end_id)]) if end_id is not None else self.model_eos,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                stop_words=_words(request, "stop_words_list", b, batch),
                bad_words=_words(request, "bad_words_list", b, batch),
                min_tokens=int(_scalar(request, "min_tokens", b, batch, 0)),
                repetition_penalty=float(_scalar(request, "repetition_penalty", b, batch, 1.0)),
                presence_penalty=float(_scalar(request, "presence_penalty", b, batch, 0.0)),
                frequency_penalty=float(_scalar(request, "frequency_penalty", b, batch, 0.0)),
                embedding_bias=None if bias is None else bias.astype(np.float32).tolist(),
                return_log_probs=bool(_scalar(request, "return_log_probs", b, batch, False)),
                return_context_logits=bool(_scalar(request, "return_context_logits", b, batch, False)),
                return_generation_logits=bool(_scalar(request, "return_generation_logits", b, batch, False)),
            )
            for s in range(n_seq):
                prompts.append({
                    "batch_index": b, "sequence_index": s,
                    "request": self.decode_engine.GenerationRequest(**common, seed=seed + s,
                                                                    grammar=self._grammar(request, b, batch)),
                    "end_ids": common["end_ids"], "pad_id": pad_id if pad_id is not None else end_id,
                    "exclude": self.exclude_default if exclude is None else bool(exclude),
                    "perf": bool(_scalar(request, "return_perf_metrics", b, batch, False)),
                    "num_in": bool(_scalar(request, "return_num_input_tokens", b, batch, False)),
                    "num_out": bool(_scalar(request, "return_num_output_tokens", b, batch, False)),
                    "tokens": [], "log_probs": [], "gen_logits": [], "done": False, "first_ns": 0, "last_ns": 0,
                })
        return prompts, streaming

    def _start(self, job):
        try:
            for i, p in enumerate(job.prompts):
                p["handle"] = self.engine.submit(p["request"], on_event=lambda ev, i=i: job.events.put((i, ev)))
                job.handles.append(p["handle"])
        except Exception as exc:
            job.cancel()
            self._fail(job.sender, exc)
            return
        with self.lock:
            self.jobs.add(job)
        threading.Thread(target=self._serve, args=(job,), daemon=True).start()

    def _stop(self, user_id, sender):
        if not user_id:
            self._fail(sender, RequestError("a stop request needs the request id of the request to stop"))
            return
        with self.lock:
            for job in self.jobs:
                if job.user_id == user_id:
                    job.cancel()
        sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    @staticmethod
    def _fail(sender, exc):
        """Answer with the error. A refused request gets its reason; anything else is the runtime's own fault: its
        traceback goes to the server's log and the client reads ``internal error`` (the front end answers 500)."""
        if isinstance(exc, RequestError):
            msg = str(exc)
        else:
            msg = f"internal error in the reference runtime: {type(exc).__name__}: {exc}"
            print(f"tensorrt_llm (reference): {msg}", file=sys.stderr)
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
            sys.stderr.flush()
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(msg)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            pass

    # --- responses ---------------------------------------------------------------------------------------------
    def _serve(self, job):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        remaining = len(job.prompts)
        try:
            while remaining:
                i, ev = job.events.get()
                p = job.prompts[i]
                now = time.time_ns()
                if ev.error is not None:
                    job.cancel()
                    self._fail(job.sender, ev.error)
                    return
                keep = ev.token is not None and not (ev.finish_reason == "end_id" and ev.token in p["end_ids"])
                if ev.token is not None:
                    p["first_ns"] = p["first_ns"] or now
                    p["last_ns"] = now
                if keep:
                    p["tokens"].append(ev.token)
                    if ev.log_prob is not None:
                        p["log_probs"].append(ev.log_prob)
                    if ev.logits is not None:
                        p["gen_logits"].append(ev.logits.numpy())
                if ev.finish_reason is not None:
                    p["done"] = True
                    remaining -= 1
                if job.streaming:
                    if keep or ev.finish_reason is not None:
                        new = slice(-1, None) if keep else slice(0, 0)
                        job.sender.send(self._response(job, [p], new), flags=final if not remaining else 0)
                elif self.decoupled and ev.finish_reason is not None:
                    job.sender.send(self._response(job, [p], None), flags=final if not remaining else 0)
            if not self.decoupled:
                job.sender.send(self._response(job, job.prompts, None), flags=final)
        except Exception as exc:
            job.cancel()
            self._fail(job.sender, exc)
        finally:
            with self.lock:
                self.jobs.discard(job)

    def _wanted(self, job, name):
        return name in self.outputs and (job.requested is None or name in job.requested)

    def _response(self, job, prompts, new):
        """Tensors for ``prompts`` (rows; one row when answering one sequence). ``new``: the slice of each row's
        tokens to send (streaming), or None for the whole output (with the prompt unless excluded). As TensorRT-LLM
        fills each response (cpp/include/tensorrt_llm/batch_manager/llmRequest.h ``createResponse``): the log probs
        of every token generated so far and the context logits in each response, the generation logits of the
        tokens it carries."""
        rows, lengths, lps, cums = [], [], [], []
        for p in prompts:
            toks = p["tokens"][new] if new is not None else p["tokens"]
            lp = p["log_probs"]
            if new is None and not p["exclude"]:
                toks = list(p["request"].input_ids) + toks
            rows.append(toks)
            lengths.append(len(toks))
            lps.append(lp)
            cums.append(float(sum(p["log_probs"])))
        width = max(lengths) if lengths else 0
        pad = prompts[0]["pad_id"]
        ids = np.full((len(rows), 1, width), -1 if pad is None else pad, dtype=np.int32)
        for r, toks in enumerate(rows):
            ids[r, 0, :len(toks)] = toks
        out = {"output_ids": ids, "sequence_length": _i32(lengths)[:, None]}
        p0 = prompts[0]
        if p0["request"].return_log_probs:
            lp_width = max(len(x) for x in lps)
            arr = np.zeros((len(rows), 1, lp_width), dtype=np.float32)
            for r, x in enumerate(lps):
                arr[r, 0, :len(x)] = x
            out["output_log_probs"] = arr
            out["cum_log_probs"] = np.array(cums, dtype=np.float32)[:, None]
        if p0["request"].return_context_logits:
            ctx = [p["handle"].context_logits for p in prompts]
            if all(c is not None for c in ctx):
                arr = np.zeros((len(ctx), max(c.shape[0] for c in ctx), self.engine.vocab_size), self.logits_np)
                for r, c in enumerate(ctx):
                    arr[r, :c.shape[0]] = c.numpy()
                out["context_logits"] = arr
        if p0["request"].return_generation_logits:
            rows_l = [(p["gen_logits"][new] if new is not None else p["gen_logits"]) for p in prompts]
            n = max(len(x) for x in rows_l)
            vocab = self.engine.vocab_size
            arr = np.zeros((len(rows), 1, n, vocab), dtype=self.logits_np)
            for r, x in enumerate(rows_l):
                if x:
                    arr[r, 0, :len(x)] = np.stack(x)
            out["generation_logits"] = arr
        if job.batch_size > 1:
            out["batch_index"] = _i32([p["batch_index"] for p in prompts])[:, None]
        if job.num_sequences > 1:
            out["sequence_index"] = _i32([p["sequence_index"] for p in prompts])[:, None]
        if p0["num_in"]:
            out["num_input_tokens"] = _i32([len(p["request"].input_ids) for p in prompts])[:, None]
        if p0["num_out"]:
            out["num_output_tokens"] = _i32([len(p["tokens"]) for p in prompts])[:, None]
        if p0["perf"]:
            zeros = _i32([0] * len(prompts))[:, None]
            out.update({
                "kv_cache_alloc_new_blocks": zeros, "kv_cache_reused_blocks": zeros,
                "kv_cache_alloc_total_blocks": zeros, "total_accepted_draft_tokens": zeros,
                "total_draft_tokens": zeros, "acceptance_rate": np.zeros((len(prompts), 1), np.float32),
                "arrival_time_ns": np.full((len(prompts), 1), job.arrival_ns, np.int64),
                "first_scheduled_time_ns": np.array([[p["handle"].admitted_ns] for p in prompts], np.int64),
                "first_token_time_ns": np.array([[p["first_ns"]] for p in prompts], np.int64),
                "last_token_time_ns": np.array([[p["last_ns"]] for p in prompts], np.int64),
            })
        tensors = [pb_utils.Tensor(k, v) for k, v in out.items() if self._wanted(job, k)]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        self.running = False
        self.load.close()
        self.engine.close()
