"""Triton kernels of fused_zero: one fused optimizer update over a flat shard, and a gradient
norm / non-finite reduction. They know nothing of torch.distributed; the orchestrator in
``fused_zero`` decides what the shard is.

Set ``TRITON_INTERPRET=1`` before importing to run them on CPU tensors through Triton's interpreter.
"""

from .adam import ADAM_COEFS, N_ADAM_COEFS, adam_coefficients, adam_step
from .codecs import BF16, FP32, INT8, sr_key
from .norm import grad_sumsq
from .segments import BLOCK, COLUMNS, PIECE_COLUMNS, SCALAR_BLOCK, VEC, Segments, row_table, vector_elements
from .sgd import N_SGD_COEFS, SGD_COEFS, sgd_coefficients, sgd_step

__all__ = [
    "ADAM_COEFS", "BF16", "BLOCK", "COLUMNS", "FP32", "INT8", "N_ADAM_COEFS", "N_SGD_COEFS", "PIECE_COLUMNS",
    "SCALAR_BLOCK", "SGD_COEFS", "Segments", "VEC",
    "adam_coefficients", "adam_step", "grad_sumsq", "row_table", "sgd_coefficients", "sgd_step", "sr_key",
    "vector_elements",
]
