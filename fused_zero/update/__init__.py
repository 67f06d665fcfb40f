"""The update maths beside the kernels: what differs between Adam(W) and SGD (state, checks, the
per-parameter coefficients) and the same update written with torch's own CPU ops."""
