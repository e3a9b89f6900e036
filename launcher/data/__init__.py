"""Data tools: SoulChat-R1 conversion (``prepare``, ``soulchat``), token statistics (``stats``,
``lfdata``, ``statsview``) and keeping training text out of logs (``privacy``).

``launcher data prepare`` needs no torch; ``stats`` loads the training stack when called. Nothing here
prints conversation text unless asked (``--show-samples``). May import the base modules only.
"""
