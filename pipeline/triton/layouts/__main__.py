"""``python -m pipeline.triton.layouts [--write]``: the sampling table as ``docs/serving.md`` shows it (every row of
``sampling.PARAMS`` with each layout record's tensor); ``--write`` replaces it there, between its markers."""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.triton.layouts import LAYOUTS, sampling

if "--write" in sys.argv[1:]:
    path = Path(__file__).resolve().parents[3] / sampling.DOC
    path.write_text(sampling.doc_text(path.read_text(), LAYOUTS))
else:
    print(sampling.markdown(LAYOUTS))
