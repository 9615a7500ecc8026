"""Post-load fusion (stage ``post_load_fusion``): canonical ops -> backend kernels.

gemms.py             fuse_gemms (Q/K/V and gate/up into one GEMM)
kernels.py           fuse_rmsnorm, fuse_rope, fuse_swiglu (torch / triton / flashinfer / cpu backends)
linear_layout.py     linear_weight_layout (the CPU kernels' weight layouts)
linear_rewrites.py   the rewrites linear_weight_layout chooses between (wxt, C++ kernels, dequantize once)
"""
