"""The mixture-of-experts feed-forward of Qwen3-MoE, Mixtral and gpt-oss: a router picks k of E
experts for each token, each expert a SwiGLU of its own, and the layer adds the chosen experts'
outputs weighted by the router. gpt-oss's router and experts have biases, its experts a clamped
SwiGLU (kernels/swiglu.py's `clamped_swiglu`). model.py's block takes it in place of its dense
FeedForward on the layers ModelArgs.moe_layers names.

The experts' computation is `Ops.moe_experts`: kernels/moe.py's Triton path (sort by expert,
grouped matrix products, combine; no host sync) or its plain-PyTorch reference, with LoRA's
adapters on the experts where lora.apply_lora added them (`LORA_PARAMS`). In order: what
a layer's routing leaves for the loss and the metrics (`Routed`), the layer, then the
load-balancing loss transformers adds to an MoE model's loss and the experts' load the metrics
log shows.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.moe import ExpertLoRA


@dataclass
class Routed:
    """An MoE layer's last forward, summed over its tokens: all that the load-balancing loss and
    the experts' load read, [E] tensors on the device, so that no [T, E] tensor outlives the
    forward (Qwen3-30B-A3B's router probabilities are 64 MiB a layer at 131072 tokens)."""

    chosen: torch.Tensor  # int64 [E]: the (token, choice) pairs each expert was given
    probs: torch.Tensor  # fp32 [E]: the router's probabilities summed over the tokens (with grad)
    tokens: int

    def __add__(self, other: "Routed") -> "Routed":
        return Routed(
            self.chosen + other.chosen, self.probs + other.probs, self.tokens + other.tokens
        )


EXPERT_WEIGHTS = ("w1", "w3", "w2")  # MoE's [E, out, in] expert tensors

# LoRA's adapters on the experts (lora.apply_lora), by target: the A it adds and, for each
# expert tensor it adapts, that tensor's B (w1 and w3 share one A: PEFT's adapter on their
# fused gate_up_proj). LORA_PARAMS: all of them, in kernels.moe.ExpertLoRA's order.
EXPERT_ADAPTERS = {
    "experts_w13": ("w13_lora_A", {"w1": "w1_lora_B", "w3": "w3_lora_B"}),
    "experts_w2": ("w2_lora_A", {"w2": "w2_lora_B"}),
}
LORA_PARAMS = tuple(n for a, bs in EXPERT_ADAPTERS.values() for n in (a, *bs.values()))


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The (token, choice) pairs each expert was given, int64 [E]: scatter_add, as bincount
    would read its output's size on the host; integers, exact and in any order the same."""
    flat = experts.flatten()
    counts = torch.zeros(n_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class MoE(nn.Module):
    """The router (a linear layer to E logits), softmax in fp32, the top k, renormalized to sum
    to 1 when `norm_topk_prob` (Mixtral always; Qwen3-MoE as its config says), cast to the
    activations' dtype when `rounds_weights` (Qwen3-MoE), then the experts (`Ops.moe_experts`).
    Each expert's projections are stored together as [E, out, in] tensors, named as the dense
    FeedForward's: w1 (gate), w3 (up), w2 (down). `gpt_oss`: a bias on the router and on each
    expert's projections ([E, out]: w1_bias ...), and the clamped SwiGLU (Ops.moe_experts'
    activation "clamped_swiglu"). gpt-oss's softmax over the top k logits is the renormalized
    top k of the softmax over all of them (norm_topk_prob)."""

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        n_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        rounds_weights: bool,
        ops,
        gpt_oss: bool = False,
    ):
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=gpt_oss)
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        if gpt_oss:
            self.w1_bias = nn.Parameter(torch.empty(n_experts, ffn_dim))
            self.w3_bias = nn.Parameter(torch.empty(n_experts, ffn_dim))
            self.w2_bias = nn.Parameter(torch.empty(n_experts, dim))
        self.top_k, self.norm_topk_prob, self.ops = top_k, norm_topk_prob, ops
        self.rounds_weights, self.gpt_oss = rounds_weights, gpt_oss
        # The routing of each call in the model's forward, which its loss and the metrics read
        # (MLP tiling calls the layer once per tile): kept here, the block returns one tensor.
        # The model empties it and sets `recording` as its forward starts, and clears
        # `recording` once it has read it (Llama.forward): a checkpoint's recompute in backward
        # then records nothing, where its probabilities' sum would hold the recomputed graph up
        # to the router (the block's attention activations) until the next forward.
        self.routed: list[Routed] = []
        self.recording = True
        self.lora_scale: float | None = None  # alpha / rank where apply_lora adapts the experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route, then `run_experts`. As FeedForward.forward, MLP tiling replaces it on the
        instance (offload._tiled_forward); lora.NF4MoE overrides `run_experts` (4-bit experts
        dequantized for the layer), which calls `apply_experts` -> Ops.moe_experts."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.recording:
            self.routed.append(
                Routed(expert_counts(experts, probs.shape[-1]), probs.sum(dim=0), probs.shape[0])
            )
        if self.rounds_weights:  # Qwen3-MoE's and gpt-oss's; Mixtral's scale in fp32
            weights = weights.to(x.dtype)
        return self.run_experts(x, experts, weights).view(shape)

    def run_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
        """The chosen experts' weighted sum [T, D]; lora.NF4MoE's experts are stored in 4 bits."""
        return self.apply_experts(x, experts, weights, self.w1, self.w3, self.w2)

    def apply_experts(self, x, experts, weights, w1, w3, w2) -> torch.Tensor:
        """Ops.moe_experts with these expert weights, LoRA's adapters on them (those of
        LORA_PARAMS lora.apply_lora added), and gpt-oss's biases and activation."""
        lora = None
        if self.lora_scale is not None:
            adapters = (getattr(self, name, None) for name in LORA_PARAMS)
            lora = ExpertLoRA(self.lora_scale, *adapters)
        if not self.gpt_oss:
            return self.ops.moe_experts(x, experts, weights, w1, w3, w2, lora=lora)
        biases = (self.w1_bias, self.w3_bias, self.w2_bias)
        return self.ops.moe_experts(x, experts, weights, w1, w3, w2, biases, "clamped_swiglu", lora)


def load_balancing_loss(routed: Sequence[Routed]) -> torch.Tensor:
    """transformers' load_balancing_loss_func (Switch Transformer's), over all MoE layers
    together: E * sum over experts e of f_e * P_e, f_e the share of the tokens' k choices that
    went to e and P_e its mean router probability, both counted over every layer's tokens. Only
    P_e carries a gradient."""
    tokens = sum(r.tokens for r in routed)
    f = sum(r.chosen for r in routed) / tokens
    p = sum(r.probs for r in routed) / tokens
    return f.numel() * torch.sum(f * p)


def expert_load(routed: Sequence[Routed]) -> torch.Tensor:
    """Each MoE layer's busiest expert's share of the (token, choice) pairs against the mean
    share 1/E, [L] on the device: 1 when even, E / k when each token's k choices are the same k
    experts. What MoE users watch for a collapsing router."""
    return torch.stack([r.chosen.max() / r.chosen.float().mean() for r in routed])
