"""Sharded checkpoints: the checkpointer (DCP), its chunk planners, the manifest of published steps, and Hugging
Face export and import (hf/)."""
