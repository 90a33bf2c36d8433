"""Quantization checks that do not need ModelOpt: the export proof (``proof``)."""
