"""The flat-tensor collectives under the names this torch provides: 2.13 renamed them
(``reduce_scatter_single``, ``all_gather_single``); 2.4-2.12 have only the old names."""

import torch.distributed as dist

reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
