"""The machinery every patch uses: the error a patch raises (``errors``), its proof record (``proof``), the
``launcher.patches`` settings (``settings``), the version and symbol checks (``versions``), idempotent wrapping
(``wrapping``) and the callbacks around the first training steps (``trainer_hook``).

May import only the standard library, packaging and pydantic, the launcher's base (``launcher.files``) and the
run-folder map (``launcher.state.runs``); never a patch, ``kernels`` or ``planning``. Nothing is re-exported here.
"""
