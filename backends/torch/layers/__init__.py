"""The layer ops of the forward: each a reference `forward_native` plus per-device kernels.

`custom_op.CustomOp` picks one implementation per op when the model loads; the model's
forward calls the ops and never asks which kernels run. Compiled kernels come only from
backends/torch/kernels.py.
"""
