"""A target's training data: fetching drafters and targets (fetch), the target's own answers and
hidden states (features, capture; through vLLM: vllm_capture), the feature shards on disk
(shards), their disk budget (storage), how a batch lays samples out (packing) and the draft map
built from the target's answers (draftmap)."""
