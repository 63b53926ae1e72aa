"""The game plan's steps: the registry (one row per step), the runner (a step's lifecycle), the
bridge (Snakemake's and DVC's records), and what each step does (data, train, evaluate, compare,
report, online)."""
