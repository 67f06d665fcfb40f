"""fused_zero: a ZeRO-style sharded optimizer for DDP whose update is one fused Triton kernel per
bucket, run as the bucket's gradients are reduced, with the parameters all-gathered behind the
backward and the next forward."""

from importlib import metadata as _metadata

from . import checkout as _checkout
from . import versions as _versions

_versions.check_installed()  # torch and Triton inside the tested range, or an error / a warning naming it
_checkout.mount_package_dirs(__name__)  # in a source checkout: the kernels, as pyproject maps them

from .optimizer import OPTIMIZERS  # noqa: E402
from .optimizer.twins import NO_TWIN  # noqa: E402

globals().update(OPTIMIZERS)  # every optimizer algorithms/registry.py declares, by its name

__all__ = [*OPTIMIZERS, "__version__"]


def __getattr__(name: str):
    if name in NO_TWIN:  # torch.optim's optimizers without a twin, and why
        raise AttributeError(f"fused_zero has no {name}: {NO_TWIN[name]}")
    raise AttributeError(f"module 'fused_zero' has no attribute {name!r}")


def _version() -> str:
    """The installed distribution's version; in a source checkout that was never installed, the version
    its pyproject.toml declares."""
    try:
        return _metadata.version("fused-zero")
    except _metadata.PackageNotFoundError:
        pass
    pyproject = _checkout.pyproject()
    return pyproject["project"]["version"] if pyproject else "0+unknown"


__version__ = _version()
