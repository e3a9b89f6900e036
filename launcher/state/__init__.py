"""Run state: the map of a run folder (``runs.py``: every name in it, declared once), the states and their
transitions, the typed run record and its one writer, reconcile, the trainer log, the checkpoint scan, run
listing, reading a run's own files (``runfiles.py``) and the stop protocol (``stop.py``: stop and save
requests, whether a job can save, the checkpoint saved on a stop) and process identity (``procs.py``: boot id,
pid namespace, a process's identity and its tree).

May import only ``launcher.errors``, ``launcher.files`` and its own modules (and the standard
library, psutil and, lazily, the docker SDK): never ``run``, ``checks``, ``results``, ``monitor`` or
``cli``. Nothing here needs torch.
"""
