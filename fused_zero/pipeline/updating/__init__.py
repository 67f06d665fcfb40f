"""The update of this rank's region, which then starts the bucket's gather (gathering/): updates.py
drives the stage; the overflow / norm pass (norm_check.py), the fused launches (launches.py) with their
coefficient tables (tables.py) and device step counts (step_counts.py), the whole-matrix and
whole-parameter phases (whole_matrix.py, whole_params.py) and the kernels' compilation before the first
backward (warmup.py).

May import comm/, gathering/, buckets/ and reducing/; not step_end/ nor the engine's modules above it."""
