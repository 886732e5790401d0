"""train.py on a preset cut to its first N blocks, every other argument train.py's: the memory
estimate against the measured peak at a full run's sequence length, in a fraction of the
run's time. The estimator counts per block and per sequence, so its errors at the full depth
show here too (with the layer-count terms scaled down), and `--memory-snapshot` records a
trace small enough to read.

    python3 bench/few_blocks.py 6 --model llama3.1-70b --seq-len 98304 --lora-rank 16 \\
        --quantize-base nf4 --ac full --mlp-tile 16384 --activation-offload --offload-blocks 3
"""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import options  # noqa: E402
import train  # noqa: E402


def first_blocks(args, blocks: int):
    """`args` cut to its first `blocks` blocks, with the layers that skip RoPE, slide a window
    or hold experts among them."""
    kept = lambda layers: tuple(i for i in layers if i < blocks)  # noqa: E731
    return dataclasses.replace(
        args, n_layers=blocks, nope_layers=kept(args.nope_layers),
        window_layers=kept(args.window_layers), moe_layers=kept(args.moe_layers),
    )  # fmt: skip


def main() -> None:
    blocks, argv = int(sys.argv[1]), sys.argv[2:]
    whole_model = options.model_args
    options.model_args = lambda opts: first_blocks(whole_model(opts), blocks)
    train.main(argv)


if __name__ == "__main__":
    main()
