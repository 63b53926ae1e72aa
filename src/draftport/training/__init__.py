"""Training a drafter: the TTT loss (ttt), the loop with its checkpoints and resume (loop), the
optimizer (optim), each phase's initial weights (phases) and online features (spool)."""
