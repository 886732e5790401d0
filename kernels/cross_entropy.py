"""Linear + cross-entropy: loss from the last hidden states and the output weight.

The [N, V] logits of a long sequence do not fit in memory (8k tokens x 128k vocab in fp32 is
4 GiB, 128k tokens 64 GiB), so `linear_cross_entropy` walks the tokens in chunks whose logits
stay under a fixed budget. Per chunk, during the forward:
    logits = hidden_c @ weight.T                          (torch matmul)
    loss_c, and logits <- softmax(logits) - onehot(label)  (one Triton kernel, in place)
    grad_hidden_c = grad_logits @ weight                   (torch matmul)
    grad_weight  += grad_logits.T @ hidden_c               (torch matmul)
The backward then only scales the two saved gradients by grad_output (and 1 / count for
"mean"). The gradients are those of the "sum" loss until then.

Read in order: the plain-PyTorch reference, the chunk and launch configuration, the Triton
kernel, the autograd Function, and `linear_cross_entropy`, with the reference's signature.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

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


# Bytes of one chunk's logits buffer. The extra memory of the op is this buffer plus the two
# gradients (grad_weight the size of weight, grad_hidden the size of hidden), whatever N is.
# Every chunk's grad_weight matmul reads and writes all of grad_weight with the chunk's tokens
# as its inner dimension, so small chunks leave it bound by memory: at 131072 tokens the op
# ran 18% faster with 512 MiB (2048 tokens at Llama 3's vocabulary) than with 128 MiB, for
# 0.4 GiB more (bench/RESULTS.md, "The fused loss's chunk").
CHUNK_LOGITS_BYTES = 512 * 2**20

# Summing grad_weight in bf16 over many chunks loses precision as the sum grows (the error
# against fp64 grows with the chunks: bench/RESULTS.md, "Note on the fused loss"). So at
# most this many chunks are summed in bf16; longer inputs add each group of them into an
# fp32 buffer (weight-sized, fp32, during the forward only). 32k tokens at V = 128256 are
# 16 chunks: sequences up to that never take the fp32 path.
BF16_SUM_CHUNKS = 16


def chunk_rows(vocab: int, itemsize: int) -> int:
    """Tokens per chunk: the most whose [rows, V] logits fit in CHUNK_LOGITS_BYTES, rounded
    down to a power of two so the matmul tiles divide it (2048 for V = 128256 in bf16)."""
    rows = max(CHUNK_LOGITS_BYTES // (vocab * itemsize), 1)
    return 1 << (rows.bit_length() - 1)


def _launch_config(vocab: int) -> tuple[int, int]:
    """(block, num_warps): the kernel sweeps a row of `vocab` logits in blocks of this size;
    the largest blocks with the most warps were the fastest at Llama 3's vocabulary
    (bench/RESULTS.md, "Kernels")."""
    block = min(triton.next_power_of_2(vocab), 16384)
    return block, min(max(block // 512, 1), 32)


@triton.jit
def _cross_entropy_kernel(
    logits_ptr, labels_ptr, loss_ptr, vocab, ignore_index, BLOCK: tl.constexpr
):
    """One row of the chunk per program; the row's logits z (any float dtype, read as fp32)
    are overwritten with the gradient of the row's loss. With y the label:
        lse = log(sum_j exp(z_j)), by an online max and rescaled sum over blocks of the row,
        loss = lse - z_y,
        z_j <- exp(z_j - lse) - [j == y]   (softmax minus one-hot).
    A row whose label is ignore_index gets loss 0 and a zero gradient.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * vocab
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK)
    if label == ignore_index:
        for start in range(0, vocab, BLOCK):
            zeros = tl.zeros([BLOCK], dtype=logits_ptr.dtype.element_ty)
            tl.store(row_ptr + start + cols, zeros, mask=start + cols < vocab)
        tl.store(loss_ptr + row, 0.0)
    else:
        # Pass 1: the running max m and sum_j exp(z_j - m), rescaled when m grows.
        m = tl.full([], -float("inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        for start in range(0, vocab, BLOCK):
            mask = start + cols < vocab
            z = tl.load(row_ptr + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            total = total * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(total)
        tl.store(loss_ptr + row, lse - tl.load(row_ptr + label).to(tl.float32))
        # Pass 2: the gradient, written over the logits.
        for start in range(0, vocab, BLOCK):
            mask = start + cols < vocab
            z = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(z - lse) - tl.where(start + cols == label, 1.0, 0.0)
            tl.store(row_ptr + start + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, grad_enabled):
        n_tokens = hidden.shape[0]
        vocab = weight.shape[0]
        hidden, labels = hidden.contiguous(), labels.contiguous()
        # needs_input_grad says what the inputs require, also under torch.no_grad (an
        # evaluation), where no backward will come: then no gradient is computed.
        need_grad_hidden = grad_enabled and ctx.needs_input_grad[0]
        need_grad_weight = grad_enabled and ctx.needs_input_grad[1]
        # Gradients accumulate in the inputs' dtype, grad_weight over at most
        # BF16_SUM_CHUNKS chunks at a time. An fp32 grad_weight throughout (addmm with
        # out_dtype=fp32) measured slower and over twice the memory at the 8B shape for
        # little precision there (bench/RESULTS.md, "Kernels").
        grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None
        grad_weight = torch.zeros_like(weight) if need_grad_weight else None
        loss = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        rows = min(chunk_rows(vocab, hidden.element_size()), max(n_tokens, 1))
        n_chunks = -(-n_tokens // rows)
        grad_weight_fp32 = None
        if need_grad_weight and weight.dtype != torch.float32 and n_chunks > BF16_SUM_CHUNKS:
            grad_weight_fp32 = torch.zeros_like(weight, dtype=torch.float32)
        logits = torch.empty(rows, vocab, dtype=hidden.dtype, device=hidden.device)
        block, num_warps = _launch_config(vocab)
        for chunk, start in enumerate(range(0, n_tokens, rows)):
            end = min(start + rows, n_tokens)
            hidden_c, grad_logits = hidden[start:end], logits[: end - start]
            torch.mm(hidden_c, weight.t(), out=grad_logits)
            _cross_entropy_kernel[(end - start,)](
                grad_logits, labels[start:end], loss[start:end], vocab, ignore_index,
                BLOCK=block, num_warps=num_warps,
            )  # fmt: skip
            if need_grad_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if need_grad_weight:
                grad_weight.addmm_(grad_logits.t(), hidden_c)
                if grad_weight_fp32 is not None and (chunk + 1) % BF16_SUM_CHUNKS == 0:
                    grad_weight_fp32 += grad_weight
                    grad_weight.zero_()
        if grad_weight_fp32 is not None:
            grad_weight_fp32 += grad_weight
            grad_weight.copy_(grad_weight_fp32)
            del grad_weight_fp32  # freed here, not kept until backward
        total = loss.sum()
        if reduction == "mean":
            # A 0-dim tensor, so that no count leaves the GPU (no host sync).
            scale = 1.0 / (labels != ignore_index).sum().clamp(min=1).float()
        else:
            scale = torch.ones((), device=hidden.device)
        ctx.save_for_backward(grad_hidden, grad_weight, scale)
        return total * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, scale = ctx.saved_tensors
        grad_scale = grad_output * scale
        # The buffers are this op's own, freed after this call, so they are scaled in place
        # rather than copied (a copy of grad_weight would be another weight-sized buffer).
        # A second backward through the same graph fails autograd's in-place version check.
        if grad_hidden is not None:
            grad_hidden.mul_(grad_scale)
        if grad_weight is not None:
            grad_weight.mul_(grad_scale)
        return grad_hidden, grad_weight, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """hidden: [N, D], weight: [V, D] (same dtype), labels: [N] int in [0, V) or ignore_index
    (not checked: that would need a host sync). Never builds the [N, V] logits.

    reduction "mean" divides by the number of non-ignored labels (0 when there are none);
    "sum" returns the plain sum. The gradients are computed during this forward and kept
    until the backward (weight-sized plus hidden-sized), as in Liger-Kernel's fused loss.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden and weight must share a dtype, got {hidden.dtype}, {weight.dtype}"
        )
    if hidden.shape[-1] != weight.shape[-1] or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [N, D], weight [V, D], labels [N], got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    grad_enabled = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, reduction, grad_enabled)
