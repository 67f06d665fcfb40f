"""One iteration's pipeline: DDP's comm hook starts each bucket's reduction, the fused update runs on
this rank's region, the all-gather brings the updated slices back, and ``step()`` ends the iteration.
engine.py drives it, over its rooms from the bottom up: comm/ (collectives, streams), gathering/ (the
all-gather, started after an update and finished where the parameters are read next), buckets/ (the
layout every stage stands on), reducing/ (the comm hook's reduction), updating/ (the update, which
starts the gather), step_end/ (what ``step()`` ends); a room imports only the rooms below it, and each
stage is built with what it uses (the parameter table of buckets/param_table.py, the options, the objects it
calls), never with the engine. members.py, local.py and added_groups.py sit beside the engine. Nothing
here knows about checkpoints, frameworks or the demo."""
