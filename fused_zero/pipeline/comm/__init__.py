"""The pipeline's ground floor, what every stage talks through: every collective, per backend
(collectives.py), the side stream, its events and pinned uploads (streams.py), the profiler's named ranges
(profiling.py) and the small device tensors a step writes besides the state (scratch.py).

Imports no other room of pipeline/ (of the package: kernels, options, update only, as all of pipeline/)."""
