"""Plain-PyTorch helpers shared by both variants of every workload: flags, run directory, data order.

Nothing here imports `core` or `torch.distributed`: the plain scripts use it as much as the wrapped ones.
"""
