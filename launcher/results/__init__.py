"""What a finished run produced: the acceptance checklist (``verify``), model selection (``report``),
loss curves, the LoRA adapter and safetensors reader, which modules a LoRA target covers, and the files and
screening signals of ``launcher evaluate`` (``evaluate.py``, ``screening.py``, ``crisis_prompts.json``).

Host side: reads files only, no torch. May import ``state`` and the base modules; never ``run``,
``checks``, ``monitor`` or ``cli``.
"""
