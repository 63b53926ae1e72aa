"""Running the plan: a step's lifecycle (runner), Snakemake's and DVC's records (bridge), MLflow
tracking (tracking) and the step functions (steps)."""
