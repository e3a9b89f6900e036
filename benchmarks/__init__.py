"""Benchmarks and measuring scripts; not part of the installed ``launcher``/``patches`` packages.

At the top, the scripts behind the product's promises (docs/performance.md), each writing one results file in the
schema of ``results_schema.py``: ``patch_bench`` (the 27B step through ``launcher run``, variant by variant),
``fsdp_bench`` (FSDP2 on one and two devices), ``evaluate_bench`` (``launcher evaluate`` end to end),
``status_bench`` (``launcher status`` on a huge trainer log), ``data_stats_bench`` (``launcher data stats`` over
10,000 samples). Their helpers: ``bench_entry`` (the rank entry), ``bench_assets`` (config-only model folder and
data), ``fla_guard`` (lifts FLA's Hopper guard in a measuring process only), ``fsdp_init`` (random weights built per
rank), ``evaluate_entry``.

``lab/`` holds the one-question experiments (attention, collate, LoRA, loss, norm, DeltaNet, decode); their answers
are in docs/lab/.
"""
