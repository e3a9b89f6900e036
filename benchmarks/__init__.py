"""Benchmarks and measuring scripts; not part of the installed ``launcher``/``patches`` packages.

``patch_bench`` (patches on/off through ``launcher run``), ``bench_entry`` (the rank entry it uses),
``bench_assets`` (config-only model folder and 4096-token data), ``fla_guard`` (lifts FLA's Hopper guard in a
measuring process only), ``status_bench`` (``launcher status`` on a huge trainer log), ``decode_bench`` (greedy
decoding speed, routed DeltaNet kernels vs the torch fallback), ``fsdp_bench`` (FSDP2 on one and two devices:
scaling and per-device memory) with ``fsdp_init`` (random weights built per rank, each rank only its shards).
"""
