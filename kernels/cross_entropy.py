"""Linear + cross-entropy: loss from the last hidden states and the output weight."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """hidden: [N, D], weight: [V, D], labels: [N]. Materializes the [N, V] logits.

    reduction "mean" divides by the number of non-ignored labels (0 when there are none,
    rather than NaN); "sum" returns the plain sum, for averaging over micro-batches and ranks.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    logits = F.linear(hidden, weight).float()
    total = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum().clamp(min=1)
