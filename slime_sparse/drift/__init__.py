"""The drift guard: does compression change what the policy learns? (stats: the statistics; budget: the budget
that adapts; guard: the probe, run from the training loop; its flags: slime_sparse/drift_config.py.)"""
