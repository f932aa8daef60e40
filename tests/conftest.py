"""Test-wide settings: the repo root is importable, W&B stays off unless a test turns it on, and hilo's cache
(the trained default tokenizer) is shared by the whole session so it is trained once."""
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch

# Under pytest-xdist each worker shares the machine's cores with the others: one intra-op thread each keeps the
# workers from oversubscribing the CPU (tests/models with 2 workers on 2 cores: 132 s, against 272 s with torch's
# default of a thread per core). The train.py processes tests start keep the default: one thread there was slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Triton reads TRITON_INTERPRET when @triton.jit decorates (at import), so it must be set before kernels is imported:
# without a GPU the Triton backends run on CPU tensors through the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
