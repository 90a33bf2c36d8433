"""Every quantization format on the real SmolLM2-135M-Instruct: the accuracy gate's numbers (the deployed export vs
the unquantized model, which is the shipped Q4_1 GGUF dequantized to bf16) and the export proof's margins.

    python benchmarks/quant_accuracy.py

The same runs as ``benchmarks/export_proof_bounds.py --models smollm2-135m``: one real quantize stage per format,
raw results in ``benchmarks/results/export_proof_bounds.json``, tables in docs/benchmarks.md rendered from it.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import export_proof_bounds  # noqa: E402

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "--models", "smollm2-135m"]
    export_proof_bounds.main()
