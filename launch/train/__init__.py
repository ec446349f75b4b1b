"""Training: building a rank's model and optimizer (build), one step (step), the loop (loop), materialising
weights (materialize), checks before any process starts (preflight) and the launcher that starts the ranks."""
