"""Run at start-up by the python stub of the bundled Triton 2.51 server, from its own environment
(:mod:`pipeline.triton.stubenv`: numpy<2 beside an environment built for numpy 2; a ``.pth`` line imports it).

That stub passes tensors to Python through numpy's C API as numpy 1 laid it out, so it needs numpy 1 at run time;
the environment's other packages may be builds for numpy 2 that read names numpy 1 lacks at import (scipy's sparse
module reads ``numpy.long`` and ``numpy.ulong``, and transformers' generation code imports it). Those names are given
their numpy 1 equivalents here; nothing else changes.
"""
try:
    import numpy as _np
except ImportError:  # the stub environment always holds numpy
    _np = None
if _np is not None and _np.__version__.startswith("1."):
    for _new, _old in (("long", "int_"), ("ulong", "uint")):
        if _new not in vars(_np):
            setattr(_np, _new, getattr(_np, _old))
