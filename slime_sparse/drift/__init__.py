"""The drift guard: does compression change what the policy learns? (stats: the statistics; budget: the budget
that adapts; config: its flags; guard: the probe, run from the training loop.)"""
