# One rule per row of the step registry (src/draftport/plan/registry.py): its inputs are its
# upstream steps' metrics.json and its code (script + the library modules it runs), its command
# the registry's (the DVC stage runs the same; a param, so it changes with the step), its params
# the keys it reads (Snakemake's params trigger), its resources from params `resources` (draftport.plan.cluster).
for _row in R.active(CFG):
    _res = cluster.rule_resources(CFG, _row.name)

    rule:
        name:
            _row.name
        input:
            bridge.smk_inputs(_row.name, CFG),
        output:
            outputs(_row.name),
        params:
            values=R.step_params(CFG, _row.name),
            # the command as a param: `shell:` is evaluated when the job runs, after the loop ends
            cmd=bridge.shell_command(_row.name, CFG, BASE, cluster.launcher(CFG, _row.name)),
        conda:
            ENV
        log:
            f"logs/{_row.name}.log",
        threads: _res["threads"]
        resources:
            gpu=_res["gpu"],
            mem_mb=_res["mem_mb"],
            runtime=_res["runtime"],
        shell:
            "{params.cmd}"
