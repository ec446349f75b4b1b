"""Model side: config, router, experts, MoE layer and the transformer."""
