"""The rank side: what runs inside the training and evaluation processes, under torchrun or accelerate.

``entry.py`` (``python -m launcher.entry RUN_DIR``, through the stable alias ``launcher/entry.py``) applies the
patches, then hands over to LLaMA-Factory with the callbacks of ``stopsave.py`` (the save on stop),
``oomtrack.py`` (where a rank was when it ran out of memory) and ``profiling.py`` (``launcher profile``);
``evaluate.py`` is the child process of ``launcher evaluate``, with ``evaluate_decode.py`` for its batched
greedy answers.

May import the base layer, ``state``, ``data``, ``results``, ``patches`` and ``checks`` (the evaluation child
reads the kernel checks' cases); never ``run``, ``monitor`` or ``cli``. Torch and the training stack are
imported inside functions, so a host-side caller of a helper (``oomtrack.looks_like_oom``) loads none of it.
"""
