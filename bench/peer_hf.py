"""The peer longtune is measured against: Hugging Face transformers' class of the preset's
family (LlamaForCausalLM, Qwen3ForCausalLM, ...: its config.json as longtune exports the
preset) with Liger-Kernel's Triton kernels for that family (RMSNorm, Qwen3's q/k norms
included, RoPE, SwiGLU or GeGLU, fused linear cross-entropy), full
gradient checkpointing, fused AdamW, fp32 master weights with bf16 autocast; with several
GPUs (torchrun), FSDP2 `fully_shard` per decoder layer and on the root, bf16 compute, fp32
reduction. Random weights, random tokens, or with --data the rows longtune's loader gives
(packed documents: `position_ids` restarting at each document, from which transformers
masks attention between documents; --attn flex_attention builds that mask as a block mask).
With --qlora R (one GPU), the usual QLoRA recipe instead: the decoder's linear layers in
bitsandbytes' 4-bit NF4 with double quantization and bf16 compute, `peft.
prepare_model_for_kbit_training` (the other weights in fp32, gradient checkpointing), PEFT
LoRA of rank R (alpha 2R, no dropout) on all seven projections, AdamW on the adapters.
Prints one JSON line of results on rank 0.

    python bench/peer_hf.py --preset llama3.2-1b --seq-len 8192 [--no-liger]
    torchrun --nproc-per-node 4 bench/peer_hf.py --model qwen3-8b --seq-len 131072
    torchrun --nproc-per-node 8 bench/peer_hf.py --preset llama3.1-8b --seq-len 8192
    python bench/peer_hf.py --preset llama3.2-1b --seq-len 131072 --data DIR --attn flex_attention
    python bench/peer_hf.py --preset llama3.1-8b --seq-len 8192 --qlora 16
"""

import argparse
import importlib.metadata
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from config_json import hf_config  # noqa: E402
from data import PackedLoader, TokenDataset  # noqa: E402
from model import PRESETS, ModelArgs, attended_pairs  # noqa: E402

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--preset", "--model", default="llama3.2-1b", choices=sorted(PRESETS),
        help="a longtune preset (--model, as train.py names it, is the same)",
    )  # fmt: skip
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=6, help="timed steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--no-liger", action="store_true")
    parser.add_argument("--data", help="a prepared dataset: train on its packed rows")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "flex_attention"])
    parser.add_argument("--qlora", type=int, default=0, metavar="R", help="QLoRA of rank R")
    opts = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        if opts.qlora:
            raise SystemExit("--qlora runs on one GPU")
        dist.init_process_group("nccl")
    args = PRESETS[opts.preset]
    device = "meta" if world > 1 else "cuda"
    dtype = torch.bfloat16 if opts.qlora else torch.float32
    model = hf_model(args, opts.attn, dtype, device, liger=not opts.no_liger)
    if opts.qlora:
        model = qlora(model, opts.qlora)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        model.to_empty(device="cuda")
        # to_empty leaves every tensor uninitialized, the buffers too (RoPE's inverse
        # frequencies, Gemma's embedding scale): the model's own initialization fills them all.
        with torch.no_grad():
            model.apply(model._init_weights)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5, fused=True)
    if opts.data:
        rows = PackedLoader(TokenDataset(opts.data), opts.seq_len, 1, rank, world)
    else:
        tokens = torch.randint(0, args.vocab_size, (1, opts.seq_len), device="cuda")

    # (query, key) pairs attention computed in the timed steps, for the MFU: as train.py
    # counts them, each document of l tokens l^2/2 (masked apart), a whole row S^2/2, a
    # windowed layer's queries at most its window each.
    attended = [0.0]

    def step():
        if opts.data:
            # HF shifts labels itself; longtune's labels are already the next tokens, and
            # the positions restart at each document (on the host: no wait for the GPU).
            b = next(rows)
            attended[0] += float(attended_pairs(b.positions, True, opts.seq_len, args))
            b = b.to("cuda")
            inputs = dict(input_ids=b.tokens, position_ids=b.positions, labels=b.tokens)
        else:
            attended[0] += opts.seq_len * args.attended_per_token(opts.seq_len)
            inputs = dict(input_ids=tokens, labels=tokens)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=world == 1):
            loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(opts.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    attended[0] = 0.0
    start = time.perf_counter()
    for _ in range(opts.steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / opts.steps
    tokens_per_s = opts.seq_len / seconds
    result = {
        "impl": ("hf" if opts.no_liger else "hf+liger")
        + (f" qlora r={opts.qlora}" if opts.qlora else "")
        + (f" {opts.attn}" if opts.data or opts.attn != "sdpa" else ""),
        "liger": None if opts.no_liger else importlib.metadata.version("liger-kernel"),
        "preset": opts.preset,
        "seq_len": opts.seq_len,
        "world_size": world,
        "step_s": round(seconds, 4),
        "tokens_per_s_per_gpu": round(tokens_per_s, 1),
        "mfu": round(
            args.training_flops(opts.seq_len, attended[0] / opts.steps, frozen=opts.qlora > 0)
            / seconds
            / PEAK_FLOPS,
            4,
        ),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "host_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "loss": round(loss.item(), 4),
    }
    if rank == 0:
        print(json.dumps(result), flush=True)
    if world > 1:
        dist.destroy_process_group()


def hf_model(args: ModelArgs, attn: str, dtype: torch.dtype, device: str, liger: bool):
    """transformers' class of `args.family`, built from the config.json longtune would export
    (one copy of the preset's numbers), with Liger's kernels for that family patched in first:
    they replace the classes the model is built from."""
    import transformers

    if liger:
        import liger_kernel.transformers

        # Each family's defaults in Liger 0.8.5 (the result names the release): RoPE, RMSNorm,
        # the gated activation (Gemma's GeGLU; not gpt-oss's clamped experts), the fused loss.
        getattr(liger_kernel.transformers, f"apply_liger_kernel_to_{args.family}")()
    config = transformers.AutoConfig.for_model(**hf_config(args, torch.float32))
    config.use_cache = False
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=attn, dtype=dtype
        )


def qlora(model, rank: int):
    """The bf16 model's decoder linears replaced by bitsandbytes' Linear4bit (quantized as
    they move to the GPU, one at a time), then prepared and wrapped as PEFT's QLoRA recipe."""
    import bitsandbytes as bnb
    import peft

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if not isinstance(linear, torch.nn.Linear):
                    continue
                quantized = bnb.nn.Linear4bit(
                    linear.in_features, linear.out_features, bias=linear.bias is not None,
                    compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                    device="meta",
                )  # fmt: skip
                quantized.weight = bnb.nn.Params4bit(
                    linear.weight.data.cpu(), requires_grad=False, compress_statistics=True,
                    quant_type="nf4",
                )  # fmt: skip
                if linear.bias is not None:  # Qwen2's q/k/v biases, frozen as the base
                    quantized.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
                setattr(parent, name, quantized.to("cuda"))
        torch.cuda.empty_cache()
    model.is_loaded_in_4bit = True  # what from_pretrained(quantization_config=...) sets
    model = peft.prepare_model_for_kbit_training(
        model, gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"],
    )  # fmt: skip
    return peft.get_peft_model(model, config)


if __name__ == "__main__":
    main()
