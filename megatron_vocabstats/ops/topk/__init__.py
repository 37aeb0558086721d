"""Top-k log-probs and the top-k distillation statistics over a vocabulary-parallel shard:
``from_logits`` takes the logits, ``from_hidden`` the hidden states and the output layer's weight;
``math`` merges the shards' candidates, ``checks`` checks the top-k arguments."""
