"""What a training job never imports: the ``ssdtrain`` command and what it runs.

``cli`` builds the command and dispatches to its subcommands. ``gpucheck/`` is the GPU check
(`make gpu-check`, `make gpu-perf`, `make gpu-bundle`; scripts/gpu_check.sh launches it), not a
subcommand. Those with several modules have
a folder each, whose ``__init__`` says what is in it and which module is the entry: ``bench/``
(bench and core-bench), ``iobench/`` (io-bench), ``plan/`` (plan and lifespan). The others are
one module each here: ``demo``, ``report``, ``clean``, ``doctor`` and ``soak``, with the
helpers only they use (``demo_report``, ``report_render``, ``preflight_cli``, and soak's
``faults``, ``fault_kinds`` and ``forwarding``).

What several commands share stays at this level: ``cli_types`` (argument types, errors and
messages), ``quiet`` (each warning once), ``demo_model`` and ``minigpt`` (the small models they
train, the tests too), ``megatron_cpu`` (the CPU runtime that lets megatron-core run without
CUDA) and ``node_profile`` (a node measured, for doctor and bench; it measures each drive with
``iobench/measure.py``, as ``soak`` reads presets with ``plan/cli.py``).

Imports go one way: a folder imports the modules of this level and the library, never another
folder (but ``gpucheck/``, which reuses ``bench/predict.py`` for the planner's prediction); tools import the library (config, cache, io, plan, telemetry, megatron); nothing in the
library imports tools (tests/test_structure.py checks it).
"""
