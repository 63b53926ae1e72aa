# GENERATED from the step registry (src/draftport/plan/registry.py) by
# `python -m draftport.pipeline.bridge smk-rules`: do not edit (tests/pipeline/test_pipeline_dvc.py
# fails when this file and the registry drift apart). The helpers are in rules/common.smk.
# world: the embedded K2 -> K2.5 analog (only when world.build)


# world: the embedded K2 -> K2.5 analog: corpus, tokenizer, two targets, the source drafter in a hub cache
# only when world.build
if CFG["world"]["build"]:

    rule world:
        input:
            code=code("world"),
        output:
            "artifacts/world/metrics.json",
        params:
            values=values(
                "world", "source.repo_id", "features.aux_layer_ids", "features.aux_convention",
            ),
            cmd=command("world"),
        conda:
            ENV
        log:
            "logs/world.log",
        threads: RES["world"]["threads"]
        resources:
            gpu=RES["world"]["gpu"],
            mem_mb=RES["world"]["mem_mb"],
            runtime=RES["world"]["runtime"],
        shell:
            "{params.cmd}"
