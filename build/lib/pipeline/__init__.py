"""Hugging Face checkpoint -> quantized, packaged, benchmarked, checksummed Triton/TensorRT-LLM bundles."""

__version__ = "0.1.0"
