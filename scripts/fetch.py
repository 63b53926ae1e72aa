"""Step fetch: the source drafter at its pinned revision, through the hub cache (offline for the
embedded world, whose hub is artifacts/world/hub), into artifacts/fetch/source/; a target given
as a hub id (the kimi profile) into artifacts/fetch/target_new/."""

import os

from draftport import fetch as F
from draftport.config import read_config
from draftport.pipeline import is_hub_id, run_step, write_json


def fetch(s):
    src, t = s.p["source"], s.p["targets"]
    if src["offline"]:
        os.environ["HF_HUB_OFFLINE"] = "1"
    lock = F.fetch(src["repo_id"], s.path("source"), revision=src["revision"], cache_dir=src["cache_dir"],
                   offline=src["offline"], lock_file=src["lock_file"])
    out = {"source": {"files": len(lock["files"])}}
    if is_hub_id(t["new"]):
        tl = F.fetch(t["new"], s.path("target_new"), revision=None, patterns=F.TARGET_PATTERNS,
                     offline=src["offline"])
        lock["target_new"] = {"source": t["new"], "commit": tl["commit"]}
    write_json(s.path("revision.json"), {"repo_id": src["repo_id"], "requested": src["revision"],
                                         "commit": lock["commit"], **({"target_new": lock["target_new"]}
                                                                      if "target_new" in lock else {})})
    cfg, _ = read_config(s.path("source"))
    out["source"].update(draft_vocab_size=cfg.draft_vocab_size, vocab_size=cfg.vocab_size,
                         hidden_size=cfg.hidden_size,
                         bytes=sum(p.stat().st_size for p in s.path("source").iterdir()))
    print(f"fetch: {src['repo_id']}@{src['revision']} -> commit {lock['commit']}")
    return out


if __name__ == "__main__":
    raise SystemExit(run_step("fetch", fetch))
