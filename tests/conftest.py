import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter. The variable is read when a
# kernel is decorated, so it must be set before any test module imports kernels/ (or model).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
