"""Imported first by the python stub of the bundled Triton 2.51 server when its import path starts with the stub site
(``pipeline.triton.server.stub_site``: numpy<2 beside an environment built for numpy 2).

That stub passes tensors to Python through numpy's C API as numpy 1 laid it out, so it needs numpy 1 at run time;
the environment's other packages may be builds for numpy 2 that read names numpy 1 lacks at import (scipy's sparse
module reads ``numpy.long`` and ``numpy.ulong``, and transformers' generation code imports it). Those names are given
their numpy 1 equivalents here; nothing else changes. Any other ``sitecustomize`` on the path still runs.
"""
import importlib.util as _util
import os as _os
import sys as _sys

try:
    import numpy as _np
except ImportError:  # pragma: no cover - the stub site always holds numpy
    _np = None
if _np is not None and _np.__version__.startswith("1."):
    for _new, _old in (("long", "int_"), ("ulong", "uint")):
        if _new not in vars(_np):
            setattr(_np, _new, getattr(_np, _old))


def _chain() -> None:
    """Run the next ``sitecustomize`` on the path (this one shadows it)."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    for entry in _sys.path:
        if not entry or _os.path.abspath(entry) == here:
            continue
        path = _os.path.join(entry, "sitecustomize.py")
        if _os.path.isfile(path):
            spec = _util.spec_from_file_location("_next_sitecustomize", path)
            if spec and spec.loader:
                spec.loader.exec_module(_util.module_from_spec(spec))
            return


_chain()
