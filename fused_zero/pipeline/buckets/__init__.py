"""Where every element of a bucket lives, which every stage stands on: the engine's parameter table, the
face the stages read the parameters through (param_table.py), the pure layout (layout.py), this
rank's shard of a bucket and its state parts (shard.py), the arenas of one launch per step (arena.py),
memory-order views (strides.py), which shard holds what and resharding (registry.py), DDP's one bucket
rebuild (rebuild.py) and which ranks shard together (topology.py).

May import comm/ and gathering/ (each shard's gather, which a reshard finishes first); not reducing/,
updating/, step_end/ nor the engine's modules above them."""
