"""The EAGLE-3 drafter: its architecture (config), the readable reference module (drafter), its
vocab maps (vocab), its folders on disk (formats, fixtures), the target's tensors it reads
(target), its binding to a target (bind), the device it computes on (device) and its training
FLOPs (flops). The fused and compiled training paths live in model.fast."""
