"""Where a port's plan is made, before any step runs: `draftport init` writes a profile (init), and
`draftport estimate` prices it in device-hours and disk (estimate; outputs.render lays it out) from the measured
training and capture rates (rates, shipped as rates.json)."""
