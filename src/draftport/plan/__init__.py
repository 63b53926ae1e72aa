"""The plan, torch-free: params.yaml's schema (params), the step table (registry) and what each
rule asks of the machine (cluster). The Snakefile imports only this package and pipeline.bridge."""
