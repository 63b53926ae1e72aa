"""What the plan hands a user: the compare report, the report's plots and tables, terminal
renderings and the published drafter."""
