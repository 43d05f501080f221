"""``ssdtrain bench`` and ``ssdtrain core-bench``: what offloading costs and saves, measured.

``bench`` (entry: ``cli.add_bench_parser``) trains megatron-core GPT under keep, offload,
adaptive and recompute, side by side, and prints their step times, peak memory and ratios:
``measure`` runs the strategies, ``render`` prints the table, ``budget``, ``compare``,
``spread`` and ``predict`` add the memory budget, the bitwise loss comparison, the ratios'
spread and the planner's prediction; ``node`` emulates a GPU node on a CPU
(``--node-emulation``), ``background_load`` competes for the CPU (``--background-load``).

``core-bench`` (entry: ``corebench.add_core_bench_parser``) measures the offloader's own cost
on the training thread, on a small model in plain torch.
"""
