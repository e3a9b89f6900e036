"""What a finished run produced: the acceptance checklist (``verify``), model selection (``report``),
loss curves, the LoRA adapter and safetensors reader, and which modules a LoRA target covers.

Host side: reads files only, no torch. May import ``state`` and the base modules; never ``run``,
``checks``, ``monitor`` or ``cli``.
"""
