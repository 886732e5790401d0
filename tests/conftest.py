import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. The variable is read when a
# kernel is decorated, so it must be set before any test module imports kernels/ (or model).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Past torch.compile's limit of recompilations of one function (8 by default: a new shape or
# any other failed guard), dynamo runs it eagerly with only a logged warning, and the GPU
# tests, which compile FlexAttention for many shapes in one process, would check eager
# FlexAttention where training runs the compiled kernel. A higher limit, and an error past it.
torch._dynamo.config.recompile_limit = 64
torch._dynamo.config.fail_on_recompile_limit_hit = True

REPO = Path(__file__).resolve().parents[1]
# What Python and the tools write beside the code, whoever runs them.
TOOL_CACHES = {".git", "__pycache__", ".pytest_cache", ".ruff_cache"}


def checkout_files() -> dict[str, tuple[int, int]]:
    """Every file of the checkout but the tools' caches: path -> (size, mtime)."""
    files = {}
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in TOOL_CACHES]
        for name in names:
            stat = (Path(root) / name).stat()
            files[os.path.relpath(Path(root) / name, REPO)] = (stat.st_size, stat.st_mtime_ns)
    return files


@pytest.fixture(scope="session", autouse=True)
def checkout_is_left_alone():
    """Tests write under tmp_path only: they add no file to the checkout, remove none, and
    change nothing in a user's runs/ and .cache/ there (README's first run writes them).
    (Edits to the code while the tests run are a developer's own.)"""
    before = checkout_files()
    yield
    after = checkout_files()
    runs = [p for p in before.keys() & after.keys() if p.startswith(("runs", ".cache"))]
    changed = sorted(before.keys() ^ after.keys() | {p for p in runs if before[p] != after[p]})
    assert not changed, f"the tests wrote into the checkout: {changed[:10]}"
