"""The mixture-of-experts feed-forward of Qwen3-MoE and Mixtral: a router picks k of E experts
for each token, each expert a SwiGLU of its own, and the layer adds the chosen experts' outputs
weighted by the router. model.py's block takes it in place of its dense FeedForward on the
layers ModelArgs.moe_layers names.

In order: the experts' computation (plain PyTorch, a loop over experts), the layer, and the
load-balancing loss transformers adds to an MoE model's loss.
"""

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


def experts_reference(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    swiglu: Callable,
) -> torch.Tensor:
    """y[t] = sum over j of weights[t, j] * w2[e] @ swiglu(w1[e] @ x[t], w3[e] @ x[t]), e =
    experts[t, j]. x [T, D]; experts and weights [T, k]; w1, w3 [E, F, D]; w2 [E, D, F]. The
    (token, choice) pairs sorted by expert, each expert's rows multiplied at once. It reads the
    experts' counts on the host, a wait for the GPU per layer."""
    n_tokens, k = experts.shape
    order = experts.flatten().argsort(stable=True)
    token = order // k
    counts = torch.bincount(experts.flatten(), minlength=w1.shape[0]).tolist()
    outputs = []
    for e, rows in enumerate(x[token].split(counts)):
        gate, up = rows @ w1[e].t(), rows @ w3[e].t()
        outputs.append(swiglu(gate, up) @ w2[e].t())
    weighted = torch.cat(outputs) * weights.flatten()[order, None]
    # In expert order per token, as transformers adds them: the same sums in fp32.
    return torch.zeros_like(x).index_add_(0, token, weighted.to(x.dtype))


class MoE(nn.Module):
    """The router (a linear layer to E logits), softmax in fp32, the top k, renormalized to sum
    to 1 when `norm_topk_prob` (Mixtral always; Qwen3-MoE as its config says), then the experts.
    Each expert's projections are stored together as [E, out, in] tensors, named as the dense
    FeedForward's: w1 (gate), w3 (up), w2 (down)."""

    def __init__(
        self, dim: int, ffn_dim: int, n_experts: int, top_k: int, norm_topk_prob: bool, ops
    ):
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.top_k, self.norm_topk_prob, self.ops = top_k, norm_topk_prob, ops
        # The last forward's router probabilities [T, E] and choices [T, k], which the
        # model's loss reads (load_balancing_loss): kept here, the block returns one tensor.
        self.routed: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self.routed = probs, experts
        y = experts_reference(
            x, experts, weights.to(x.dtype), self.w1, self.w3, self.w2, self.ops.swiglu
        )
        return y.view(shape)


def load_balancing_loss(routed: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """transformers' load_balancing_loss_func (Switch Transformer's), over all MoE layers
    together: E * sum over experts e of f_e * P_e, f_e the share of the tokens' k choices that
    went to e and P_e its mean router probability, both counted over every layer's tokens. Only
    P_e carries a gradient. The counts stay on the device (scatter_add, not bincount)."""
    n_experts = routed[0][0].shape[-1]
    chosen = torch.zeros(n_experts, device=routed[0][0].device)
    probs_sum = torch.zeros_like(chosen)
    rows = 0
    for probs, experts in routed:
        ones = torch.ones(experts.numel(), device=chosen.device)
        chosen = chosen.scatter_add(0, experts.flatten(), ones)
        probs_sum = probs_sum + probs.sum(dim=0)
        rows += probs.shape[0]
    return n_experts * torch.sum((chosen / rows) * (probs_sum / rows))
