"""A rank of a PP=2 gloo job that trains megatron-core's GPT with ``install()`` and then leaves
the way a careless user script would: without ``uninstall()``, optionally through an
exception. The test (test_exit.py) checks each process's exit status.

Run as ``python -c "import exit_harness as h; h._worker_main()" MODE WORKDIR`` with the
torch.distributed variables set; MODE is "forget_uninstall", "raise" or "uninstall".
"""

from __future__ import annotations

import os
import sys

import torch

EXIT_BY_EXCEPTION = "deliberate failure at the end of training"


def _worker_main() -> None:
    import torch.distributed as dist

    import megatron_cpu_compat
    from megatron.core import parallel_state
    from megatron_harness import LayoutSpec, build_model, make_batches, make_config, _causal_mask

    mode, workdir = sys.argv[1], sys.argv[2]
    spec = LayoutSpec(pp=2, iterations=3, hidden_size=64, ffn_hidden_size=256, seq_length=64)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    megatron_cpu_compat.enable()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=spec.pp)

    from ssdtrain_megatron import OffloadConfig
    from ssdtrain_megatron.megatron import install, uninstall

    offloader = install(OffloadConfig(dirs=[os.path.join(workdir, "offload")], min_tensor_bytes=4096))
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(spec.seed)
    model_parallel_cuda_manual_seed(spec.seed, force_reset_rng=True)
    model = build_model(spec, make_config(spec))[0]
    offloader.register_parameters(model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
    mask = _causal_mask(spec.seq_length)

    def forward_step_func(data_iterator, model):
        batch = next(data_iterator)
        out = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
        return out, lambda o: (o.float().mean(), {})

    for it in range(spec.iterations):
        opt.zero_grad(set_to_none=True)
        get_forward_backward_func()(
            forward_step_func=forward_step_func, data_iterator=iter(make_batches(spec, it)),
            model=model, num_microbatches=spec.num_microbatches, seq_length=spec.seq_length,
            micro_batch_size=spec.micro_batch_size, forward_only=False)
        opt.step()
    read = offloader.last_step_stats.bytes_read
    print(f"rank {rank}: trained {spec.iterations} iterations, bytes_read={read}", flush=True)
    dist.barrier()
    if mode == "uninstall":
        uninstall()
    elif mode == "raise":
        raise RuntimeError(EXIT_BY_EXCEPTION)
    # "forget_uninstall": leave with the offloader installed, its threads and files alive.
