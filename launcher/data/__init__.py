"""Data tools: SoulChat-R1 conversion (``prepare``, ``soulchat``), token statistics (``stats``,
``lfdata``, ``statsview``), keeping training text out of logs (``privacy``) and the tiny demo model and dataset
(``demo``: ``launcher demo-assets``).

``launcher data prepare`` needs no torch; ``stats`` loads the training stack when called. Nothing here
prints conversation text unless asked (``--show-samples``). May import the base modules only.
"""
