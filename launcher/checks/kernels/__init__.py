"""The kernel checks: the cases and their one runner (``cases``), the ``validate-kernels`` suite and the chunk
kernel's check (``validate``), the decoding and glue kernels' checks (``decode``, ``glue``), preflight's kernel
choice on NPU (``choice``) and the ``_kernel-check`` child preflight starts (``check``).

May import ``launcher.config``, the base modules and ``patches``; never ``run``, ``monitor`` or ``cli``. Nothing is
re-exported here: ``launcher status`` reads ``choice`` without torch.
"""
