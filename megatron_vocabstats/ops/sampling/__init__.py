"""Log-probs under vLLM's v1 sampler (temperature, top-k, top-p, min-p) over a vocabulary-parallel
shard: ``from_logits`` takes the logits, ``from_hidden`` the hidden states and the output layer's
weight; ``search`` finds the sampler's kept set across the shards."""
