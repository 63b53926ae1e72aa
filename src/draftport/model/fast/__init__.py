"""The drafter's fast training paths: the same functions as the reference in model.drafter and
training.ttt, computed with fused attention, custom-autograd linears and compiled regions."""
