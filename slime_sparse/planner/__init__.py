"""The memory planner: what a run holds on its devices, sized before any GPU is touched (`tools/plan_memory.py`).
`memory.py`: a rollout server's KV pool and a learner's state; `step_memory.py`: one colocated RL step, phase by
phase; `learner_layouts.py`: the Megatron layouts a model allows and which fit; `known_models.py`: model names the
tool takes instead of a config.json. The embedded engine's own count lives with the engine's KV code
(slime_sparse/kv/engine_memory.py), which this planner reads.
"""
