"""What ``step()`` does and how it ends the iteration: each optimizer's ``step()`` and the iteration's start
and end (stepping.py, an object the engine owns; the iteration's record: iteration.py), what it
does with ``.grad`` edits, param group changes and a second backward (step_policy.py), its refusals,
raised on every rank (refusals.py), GradScaler's side of the contract (amp.py) and the CUDA graph of
a step (step_graph.py).

May import comm/, gathering/, buckets/, reducing/ and updating/; not the engine's modules above it
(engine.py, members.py, local.py)."""
