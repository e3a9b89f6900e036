"""The backends (``backend``: their names, device counts and the child environment) and the run config: its
schema and loading (``run_config``: the ``launcher:`` section with pydantic, the LLaMA-Factory part as given,
``key=value`` overrides, and the rules a config must pass to load, ``file_problems``) and the job's environment
levers (``tuning``). The lowest package that knows a config: ``checks/`` and ``run/`` both build on it, and it
imports neither. Nothing is re-exported here: ``launcher status`` imports no pydantic.
"""
