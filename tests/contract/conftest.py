"""The contract suite: one parity test per pattern that DDP + torch.optim allows.

Each test runs a user's loop twice on the same data, as a user writes it: once under plain DDP with
torch.optim's optimizers (the oracle), once with fused_zero's in their place, and compares every rank's
parameters after every step and every optimizer's state (``state_dict()``, torch.optim's own format)
at the end. A pattern here is a promise: fused_zero gives torch.optim's result, bit for bit on the CPU
where torch's ops run the update.

A test in this folder is never changed to expect a refusal, or a looser tolerance, unless an issue asks
for exactly that behaviour. Where a mode cannot honor a pattern, the test runs the pattern in the modes
that do, and checks that the others refuse on every rank naming the mode that honors it.
"""
