"""The update maths beside the kernels: each optimizer's algorithm (its state, checks, per-parameter
coefficients and update) behind one interface (interface.py), declared once and listed in registry.py,
and the same updates written with torch's own ops."""
