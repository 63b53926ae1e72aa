"""What the plan hands a user: the compare report, the estimate, the report's plots and tables,
terminal renderings, the export checks and the published drafter."""
