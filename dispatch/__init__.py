"""Token movement for expert parallelism: topology, layout, permutation, all-to-all backends."""
