"""Quantization: ModelOpt specifics (``modelopt``) and the export proof (``proof``)."""
