"""Training data: tokenizers, prepared token shards, the blend sampler, the per-rank feed, and `moe-data` (cli)."""
