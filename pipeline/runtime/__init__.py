"""Runtimes behind a Triton layout: the PyTorch reference runtime (self-contained: copied into model repositories)
and the TensorRT-LLM adapters (the only code that touches ``tensorrt_llm``)."""
