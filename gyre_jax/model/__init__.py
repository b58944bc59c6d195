"""Qwen3-style decoder in Flax NNX, its tokenizer and its logical-axis sharding."""
