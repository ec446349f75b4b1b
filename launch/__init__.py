"""Command lines, configs, data, the training loop and metrics."""
