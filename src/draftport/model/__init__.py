"""The EAGLE-3 drafter: its architecture (config), the readable reference module (drafter), its
vocab maps (vocab, draftmap), its folders on disk (formats, fixtures) and its binding to a target
(bind). The fused and compiled training paths live in model.fast."""
