"""``ssdtrain plan`` and ``ssdtrain lifespan``: the analytic model from the command line.

Entry: ``cli.add_plan_parser`` and ``cli.add_lifespan_parser``; ``cli`` also reads a preset's
model and offload sections (``read_preset``, ``load_preset``, used by ``soak`` too).
``job_size`` sizes the job (--gpus or --nodes, --global-batch-size, or the preset's);
``engine`` decides the engine, policy and recompute fallback planned (an engine the preset
does not name follows the node); ``build`` plans the preset on a node across keep, host, SSD
and recompute, within the activation budget (the library's ``plan.memory``); ``search`` runs
``plan --search`` over parallel layouts; ``report`` prints the table.

This folder is the command; the model and the planner it calls are the library's
``ssdtrain_megatron.plan``, which never imports it.
"""
