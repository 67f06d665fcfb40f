"""The update of this rank's region and the gather that brings it back: updates.py drives the stage; the
overflow / norm pass (norm_check.py), the fused launches (launches.py) with their coefficient tables
(tables.py) and device step counts (step_counts.py), one optimizer's gather of a shared bucket
(packed_gather.py), the whole-matrix and whole-parameter phases (whole_matrix.py, whole_params.py) and
the kernels' compilation before the first backward (warmup.py).

May import comm/, buckets/ and reducing/; not step_end/ nor the engine's modules above it."""
