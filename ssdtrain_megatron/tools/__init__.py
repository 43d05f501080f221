"""What a training job never imports: the ``ssdtrain`` command and what it runs.

``cli`` builds the command and dispatches to one module per subcommand (``demo``, ``bench``,
``corebench``, ``io_bench``, ``plan_cli`` for plan and lifespan, ``report``, ``clean``,
``doctor``); ``cli_types`` holds their shared argument types and messages. ``demo_model`` and
``minigpt`` are the small models they train, ``megatron_cpu`` the CPU runtime that lets
megatron-core run without CUDA, ``report_render`` the markdown and plots of ``ssdtrain report``.

Imports go one way: tools import the library (config, cache, io, plan, telemetry, megatron);
nothing in the library imports tools (tests/test_structure.py checks it).
"""
