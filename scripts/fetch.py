"""Step fetch: the source drafter at its pinned revision, through the hub cache (offline for the
embedded world, whose hub is artifacts/world/hub), into artifacts/fetch/source/; a target given
as a hub id (the kimi profile) into artifacts/fetch/target_new/ (target_old/ likewise); the reference drafter, when
the profile names one, into artifacts/fetch/reference/."""

import os

from draftport import fetch as F
from draftport.config import read_config
from draftport.pipeline import is_hub_id, run_step, write_json


def fetch(s):
    src, t = s.p["source"], s.p["targets"]
    if src["offline"]:
        os.environ["HF_HUB_OFFLINE"] = "1"
    pickle = src["allow_pickle"]  # off by default: .bin/.pt weights are refused
    lock = F.fetch(src["repo_id"], s.path("source"), revision=src["revision"], cache_dir=src["cache_dir"],
                   offline=src["offline"], lock_file=src["lock_file"], allow_pickle=pickle)
    out = {"source": {"files": len(lock["files"])}}
    ref = s.p["reference"]
    if ref:  # the upper bound Phase 0 evaluates next to the source, fetched the same way
        rl = F.fetch(ref["repo_id"], s.path("reference"), revision=ref["revision"], cache_dir=src["cache_dir"],
                     offline=src["offline"], allow_pickle=pickle)
        lock["reference"] = {"repo_id": ref["repo_id"], "requested": ref["revision"], "commit": rl["commit"]}
        out["reference"] = {"files": len(rl["files"])}
    for which in ("new", "old"):  # a target given as a hub id (the old one: the source's own reference)
        if t[which] and is_hub_id(t[which]):
            tl = F.fetch(t[which], s.path(f"target_{which}"), revision=None, patterns=F.TARGET_PATTERNS,
                         offline=src["offline"], allow_pickle=pickle,
                         trust_remote_code=t[which] in t["trust_remote_code"])  # its *.py only when named
            lock[f"target_{which}"] = {"source": t[which], "commit": tl["commit"]}
    write_json(s.path("revision.json"), {"repo_id": src["repo_id"], "requested": src["revision"],
                                         "commit": lock["commit"],
                                         **{k: lock[k] for k in ("target_new", "target_old", "reference")
                                            if k in lock}})
    cfg, _ = read_config(s.path("source"))
    out["source"].update(draft_vocab_size=cfg.draft_vocab_size, vocab_size=cfg.vocab_size,
                         hidden_size=cfg.hidden_size,
                         bytes=sum(p.stat().st_size for p in s.path("source").iterdir()))
    print(f"fetch: {src['repo_id']}@{src['revision']} -> commit {lock['commit']}")
    return out


if __name__ == "__main__":
    raise SystemExit(run_step("fetch", fetch))
