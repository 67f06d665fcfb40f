"""The classes users import: drop-in torch.optim optimizers whose step runs inside DDP's backward.

Each takes torch.optim's arguments and hyperparameter names for its algorithm, checked by
torch.optim.<Name>'s own constructor first (``_torch_checked``: its errors, word for word, as the twins'
are, optimizer/twins.py), then by fused_zero's checks of its own options, plus the keyword-only
options shared by all, described once, in ``options.OPTIONS`` (ShardingOptions' docstring and
``fused-zero options`` print them): ``ddp`` is the DistributedDataParallel module whose buckets are
sharded (in one process without DDP, the plain module: pipeline/local.py), or left out for
``opt.attach(ddp)`` once the DDP exists (build first, attach later); the others are ShardingOptions'
fields. Several may share one DDP module, each with parameters of its own (sharing.py).

Which optimizers there are is algorithms/registry.py's list: ``OPTIMIZERS`` (and ``__all__``, and the
package's own) maps each declared name to its class, written out here, or made from torch's signature
(twins.py).
"""

from __future__ import annotations

import torch

from ..algorithms import adam, muon, registry, sgd
from . import twins
from .base import ShardedOptimizer
from .twins import NO_TWIN, TWINS

# torch.optim keeps these in every param group; keeping them too makes state dicts interchangeable
_TORCH_FLAGS = dict(foreach=None, capturable=False, differentiable=False, fused=None)


def _torch_checked(cls: type, stand_in: tuple[int, ...] = (), **kwargs) -> dict:
    """torch.optim ``cls``'s constructor run on ``kwargs`` over one stand-in parameter of shape ``stand_in``
    (Muon's: 2-D), before anything of fused_zero's: its checks are the user's, its errors word for word;
    returns its ``defaults`` (a 1-element tensor beta as torch keeps it: 0-dim)."""
    return dict(cls([torch.zeros(stand_in, requires_grad=True)], **kwargs).defaults)


class AdamW(ShardedOptimizer):
    """torch.optim.AdamW, sharded across DDP ranks and run inside the backward."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 ddp=None, **options):
        checked = _torch_checked(adam.ADAMW.torch_class, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                                 differentiable=differentiable, fused=fused)
        defaults = dict(lr=lr, betas=checked["betas"], eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, decoupled_weight_decay=True, **{**_TORCH_FLAGS, "capturable": capturable})
        super().__init__(params, defaults)
        self._start(ddp, adam.ADAMW.algorithm(self.param_groups, self.defaults), options,
                    capturable=capturable, differentiable=differentiable)


class Adam(ShardedOptimizer):
    """torch.optim.Adam (L2 weight decay, or decoupled with ``decoupled_weight_decay=True``)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, ddp=None, **options):
        checked = _torch_checked(adam.ADAM.torch_class, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 amsgrad=amsgrad, foreach=foreach, maximize=maximize, capturable=capturable,
                                 differentiable=differentiable, fused=fused,
                                 decoupled_weight_decay=decoupled_weight_decay)
        defaults = dict(lr=lr, betas=checked["betas"], eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
                        **{**_TORCH_FLAGS, "capturable": capturable})
        super().__init__(params, defaults)
        self._start(ddp, adam.ADAM.algorithm(self.param_groups, self.defaults), options,
                    capturable=capturable, differentiable=differentiable)


class SGD(ShardedOptimizer):
    """torch.optim.SGD (momentum, dampening, nesterov, weight decay, maximize)."""

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, ddp=None, **options):
        _torch_checked(sgd.SGD.torch_class, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                       nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
                       fused=fused)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=None, differentiable=False, fused=None)
        super().__init__(params, defaults)
        self._start(ddp, sgd.SGD.algorithm(self.param_groups, self.defaults), options, differentiable=differentiable)


class Muon(ShardedOptimizer):
    """torch.optim.Muon over 2-D parameters (the hidden matrices; give the embeddings, head, norms and
    biases to an AdamW over the same DDP module). Each matrix is orthogonalized once per step, on the
    rank of its shard group that owns it (pipeline/updating/whole_matrix.py); the momentum stays sharded."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 ddp=None, **options):
        _torch_checked(muon.MUON.torch_class, (1, 1), lr=lr, weight_decay=weight_decay, momentum=momentum,
                       nesterov=nesterov, ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                       adjust_lr_fn=adjust_lr_fn)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        muon.MuonAlgorithm.check_options(options)
        self._start(ddp, muon.MUON.algorithm(self.param_groups, self.defaults), options)


_WRITTEN = {cls.__name__: cls for cls in (AdamW, Adam, SGD, Muon)}

OPTIMIZERS: dict[str, type[ShardedOptimizer]] = {
    d.name: twins.CLASSES[d.name] if d.generic else _WRITTEN[d.name] for d in registry.DECLARATIONS}
"""Every fused_zero optimizer class, by name, in the registry's order (algorithms/registry.py)."""

globals().update(OPTIMIZERS)

__all__ = [*OPTIMIZERS, "NO_TWIN", "OPTIMIZERS", "TWINS", "ShardedOptimizer"]
