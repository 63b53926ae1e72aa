"""How long `draftport compare` takes on two Kimi-K2-size drafters, next to loading one.

Builds a 2.4 GB flat source (no embed_tokens) and a 4.7 GB destination (with embed_tokens, a map
250 tokens apart) as sparse files, then times, each in a fresh subprocess:
  - `draftport compare SRC DST --json` and the table form: wall time and peak RSS;
  - safetensors.torch.load_file(DST) plus a copy of every tensor: what reading them costs instead.
The big tensors are file holes, so the load figure is a lower bound (no disk reads at all).
Prints figures; asserts nothing about time.

    .venv/bin/python benchmarks/bench_compare.py [--dir DIR] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftport.model.fixtures import frequency_maps, kimi_k2_config, swap_hot_ids, write_header_only_drafter

LOAD = """
import json, resource, sys, time
t0 = time.perf_counter()
from safetensors.torch import load_file
t1 = time.perf_counter()
state = load_file(sys.argv[1])
t2 = time.perf_counter()
# load_file may hand back tensors over the file's mmap; copying them is what a trainer pays.
state = {k: v.clone() for k, v in state.items()}
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "materialize_s": t3 - t2,
                  "bytes": sum(t.numel() * t.element_size() for t in state.values()),
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def draftport_cmd() -> list[str]:
    script = Path(sys.executable).parent / "draftport"
    return [str(script)] if script.exists() else [sys.executable, "-m", "draftport.cli"]


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr}")
    return wall, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="where to build the checkpoints (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench_compare_", dir=args.dir))
    try:
        cfg = kimi_k2_config()
        d2t, t2d = frequency_maps(cfg, seed=0)
        d2t_b, t2d_b = swap_hot_ids(d2t, cfg.vocab_size, 250, seed=1)
        t = time.perf_counter()
        src = write_header_only_drafter(root / "k2", cfg, d2t, t2d, with_embed=False)
        dst = write_header_only_drafter(root / "k25", cfg, d2t_b, t2d_b, with_embed=True)
        build_s = time.perf_counter() - t
        sizes = {p.parent.name: p.stat().st_size / 1e9 for p in (src / "model.safetensors", dst / "model.safetensors")}
        on_disk = sum(p.stat().st_blocks * 512 for p in root.rglob("*.safetensors")) / 1e6
        print(
            f"built in {build_s * 1000:.0f} ms: src {sizes['k2']:.2f} GB, dst {sizes['k25']:.2f} GB "
            f"(sparse: {on_disk:.1f} MB on disk)"
        )

        # Children's peak RSS is a running maximum, so measure compare before anything bigger runs.
        walls = []
        for _ in range(args.repeat):
            wall, res = timed(draftport_cmd() + ["compare", str(src), str(dst), "--json"])
            walls.append(wall)
        rep = json.loads(res.stdout)
        rss_compare = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        table_walls = [timed(draftport_cmd() + ["compare", str(src), str(dst)])[0] for _ in range(args.repeat)]
        print(
            f"draftport compare --json : wall median {statistics.median(walls):.3f} s, "
            f"min {min(walls):.3f} s, max {max(walls):.3f} s over {args.repeat} runs; "
            f"peak RSS {rss_compare:.0f} MB"
        )
        print(
            f"draftport compare (table): wall median {statistics.median(table_walls):.3f} s, "
            f"max {max(table_walls):.3f} s"
        )
        print(
            f"  report: compatible={rep['verdict']['compatible_architecture']}, "
            f"positions_differ={rep['vocab']['positions_differ']}, overlap={rep['vocab']['overlap']}"
        )

        wall, res = timed([sys.executable, "-c", LOAD, str(dst / "model.safetensors")])
        load = json.loads(res.stdout)
        print(
            f"safetensors load_file(dst): import torch+safetensors {load['import_s']:.2f} s, "
            f"load_file {load['load_s']:.2f} s, copy into memory {load['materialize_s']:.2f} s, "
            f"{wall:.2f} s wall; {load['bytes'] / 1e9:.2f} GB of tensors, peak RSS "
            f"{load['maxrss_mb']:.0f} MB (file holes: a lower bound, no disk reads)"
        )
        print(f"compare / load wall: {statistics.median(walls) / wall:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
