"""The reduction: the hooks fused_zero registers on the user's modules, DDP's comm hook first (hooks.py),
each bucket's reduce-scatter or all-reduce in place in DDP's bucket (reduction.py), and the watch on
``param.grad`` between the backward and ``step()`` (grad_watch.py).

May import comm/, gathering/ and buckets/; not updating/, step_end/ nor the engine's modules above them."""
