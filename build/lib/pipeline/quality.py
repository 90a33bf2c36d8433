"""Logit-level comparison metrics between two models on the same token rows."""
from __future__ import annotations

from typing import Callable

import torch


@torch.inference_mode()
def logits(model, rows: torch.Tensor, batch_size: int = 4, on_batch: Callable[[], None] | None = None) -> torch.Tensor:
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(rows), batch_size):
        out.append(model(input_ids=rows[i:i + batch_size].to(device)).logits.float().cpu())
        if on_batch:
            on_batch()
    return torch.cat(out)


def compare(ref: torch.Tensor, test: torch.Tensor, rows: torch.Tensor) -> dict[str, float]:
    """KL(ref ‖ test) per token (mean, nats), top-1 agreement, and the perplexity ratio test/ref on ``rows``."""
    lp, lq = ref.log_softmax(-1), test.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (ref.argmax(-1) == test.argmax(-1)).float()
    targets = rows[:, 1:].reshape(-1)

    def ppl(lo: torch.Tensor) -> float:
        return float(torch.nn.functional.cross_entropy(lo[:, :-1].reshape(-1, lo.shape[-1]), targets).exp())

    p_ref, p_test = ppl(ref), ppl(test)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1_agreement": float(top1.mean()),
            "ppl_ref": p_ref, "ppl_test": p_test, "ppl_ratio": p_test / p_ref, "tokens": int(kl.numel())}
