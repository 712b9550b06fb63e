"""Mosaic GPU kernels (the ``"mosaic_gpu"`` implementations): Pallas' Mosaic GPU backend, for Hopper
and newer (sm_90, sm_100).

Here TMA copies, wgmma and warpgroup roles are explicit: a memory warpgroup streams operand tiles
into shared memory while compute warpgroups run the tensor cores (warp specialisation), which the
Triton kernels one folder up cannot express. On the CPU the kernels run in Mosaic GPU's interpret
mode (`mtjax.config` ``pallas_interpret``), which simulates shared memory, TMA and barriers.
"""
