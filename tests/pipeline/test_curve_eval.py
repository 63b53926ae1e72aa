"""eval_curves evaluates its points in worker processes of one thread each: the figures are those
of one process evaluating them in turn, in the points' order."""

import json

import torch
from toys import make_features, toy_drafter

from draftport.model.formats import save_drafter, save_safetensors
from draftport.pipeline.steps.curve_eval_steps import eval_jobs

RUN_KEYS = ("run", "eval_seconds")  # where and how fast it ran: not figures


def test_points_evaluated_two_at_a_time_give_one_process_figures(tmp_path):
    _, head = make_features(tmp_path, n=12)
    drafters = [toy_drafter(seed=s) for s in (1, 2, 3)]
    for i, d in enumerate(drafters):
        save_drafter(tmp_path / f"d{i}", d.cfg, d.export_state())
    d = drafters[0]
    target = tmp_path / "target"
    target.mkdir()
    save_safetensors(
        {"model.embed_tokens.weight": d.embed_tokens.weight.detach().clone(), "lm_head.weight": head},
        target / "model.safetensors",
    )
    (target / "config.json").write_text(json.dumps({"hidden_size": d.cfg.hidden_size, "vocab_size": d.cfg.vocab_size}))
    kw = {"k": 2, "batch_size": 4, "max_samples": None, "device": "cpu", "buckets": [0, 6]}
    jobs = [
        {"drafter": tmp_path / f"d{i}", "target": target, "features": tmp_path / "feats", "kw": kw} for i in range(3)
    ]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = list(eval_jobs(jobs, "cpu"))
        torch.set_num_threads(2)  # the step's threads: two workers
        pooled = list(eval_jobs(jobs, "cpu"))
    finally:
        torch.set_num_threads(threads)
    strip = [{k: v for k, v in r.items() if k not in RUN_KEYS} for r in alone]
    assert strip == [{k: v for k, v in r.items() if k not in RUN_KEYS} for r in pooled]
    assert len({json.dumps(r["per_sample"]) for r in strip}) == 3  # three drafters, three sets of counts
