import os

# Tiny tensors: one thread avoids oversubscription when the suite shares the 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass

import sys
from pathlib import Path

# Shared builders and the processes tests launch (workers, the MLflow server and UI) live in
# tests/helpers, the benchmarks tests run at toy size in benchmarks/: importable by name from every
# test area.
sys.path.insert(0, str(Path(__file__).parent / "helpers"))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "benchmarks"))
