"""``ssdtrain io-bench``: each IO engine against the drive's own limit, measured in one run.

Entry: ``cli.add_io_bench_parser``. ``measure`` holds the raw O_DIRECT baseline (what fio
would report; ``node_profile`` measures drives with it too) and the memory both sides share,
``engine_side`` an engine used as a training job uses it, ``rounds`` the schedule that sets
the two side by side, ``layout_compare`` the slab-or-files comparison of ``--compare-layout``.

Named ``iobench``, not ``io``: ``ssdtrain_megatron.io`` is the engines themselves, which this
folder measures.
"""
