"""The drafter's fast training path: the same functions as the reference in model.drafter and
training.ttt, computed with fused attention, custom-autograd linears and compiled regions.

path (FastPath: how a step is computed, passed down), attention (fused TTT attention), linear
(custom-autograd linears, row and slice views), unroll (the drafter's unroll over its weights),
loss (the TTT loss's terms)."""
