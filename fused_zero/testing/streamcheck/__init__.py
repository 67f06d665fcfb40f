"""The CUDA stream ordering of the pipeline, checked on a CPU: ``StreamChecker`` runs the real engine on
CPU tensors with stand-ins for the stream, event and Work calls, and reports every stream-order hazard
(checker.py; the model in clocks.py, the stand-ins in device.py, the operation tracing in trace.py)."""

from .checker import StreamChecker

__all__ = ["StreamChecker"]
