"""One iteration's pipeline: DDP's comm hook starts each bucket's reduction, the fused update runs on
this rank's region, the all-gather brings the updated slices back, and ``step()`` ends the iteration.
engine.py drives it; the layout of a bucket, its shards, the side stream and the hooks live beside it.
Nothing here knows about checkpoints, frameworks or the demo."""
