"""Native Triton kernels (the ``"triton"`` implementations), launched through jax-triton.

The kernels here port the algorithms of the Pallas kernels one folder up (same tiles, same masks,
same custom_vjp glue) to the Triton language, so they do not depend on Pallas' Triton lowering.
`runtime.launch` calls them: `jax_triton.triton_call` on CUDA and ROCm, Triton's interpreter on
the CPU in interpret mode. Importing a kernel module needs the ``triton`` package (the ``gpu``
extra); the ops in `mtjax.ops` import them only when a ``"triton"`` implementation runs.
"""
