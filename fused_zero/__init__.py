"""fused_zero: a ZeRO-style sharded optimizer for DDP whose update is one fused Triton kernel."""
