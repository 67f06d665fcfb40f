"""fused_zero: a ZeRO-style sharded optimizer for DDP whose update is one fused Triton kernel per
bucket, run as the bucket's gradients are reduced, with the parameters all-gathered behind the
backward and the next forward."""

from importlib import metadata as _metadata
from pathlib import Path as _Path

from . import versions as _versions

_versions.check_installed()  # torch and Triton inside the tested range, or an error / a warning naming it

from .optimizer import OPTIMIZERS  # noqa: E402
from .optimizer.twins import NO_TWIN  # noqa: E402

globals().update(OPTIMIZERS)  # every optimizer update/registry.py declares, by its name

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
    pyproject = _Path(__file__).resolve().parents[1] / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == "fused-zero":
            return project["version"]
    return "0+unknown"


__version__ = _version()
