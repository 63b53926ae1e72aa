"""A target's training data: fetching drafters and targets (fetch), the target's own answers and
hidden states (features, capture), the feature shards on disk (shards), their disk budget
(storage) and how a batch lays samples out (packing)."""
