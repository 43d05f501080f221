"""A GPT pretraining script on the ``megatron.training`` that megatron-core 0.17+ wheels ship.

Written for the tests after the shape of Megatron-LM's ``pretrain_gpt.py`` (no code taken from
it): a GPT model provider (local layer spec), mock data through
``BlendedMegatronDatasetBuilder`` + ``MockGPTDataset``, a forward step whose loss function
reports ``lm loss``, and a call of ``megatron.training.pretrain``. Like ``pretrain_gpt.py`` at
each release, it calls ``pretrain`` the way that release wants it:

* 0.17: ``pretrain(datasets_provider, model_provider, model_type, forward_step, ...)``, which
  parses the arguments itself;
* 0.18+: ``parse_and_validate_args()`` first, then ``pretrain(cfg_container, ...)``.

Run it as ``pretrain_gpt.py`` is run, under torchrun, directly or through
``python -m ssdtrain_megatron.launch``. With ``SSDTRAIN_TEST_RECORD`` set to a folder, each rank
appends one JSON line per micro-batch to ``rank<R>.jsonl`` there: the exact loss of every
micro-batch on the last pipeline stage (``float.hex``), and, at the first micro-batch of each
iteration, a SHA-256 of this rank's parameters (the weights the previous step produced).
With ``SSDTRAIN_TEST_SETTLE_WRITES=1``, every queued write finishes before a backward is
announced (as tests/megatron_harness.py's ``Phase.settle_writes``), so what a step writes and
wastes does not depend on how far the IO threads got. With ``SSDTRAIN_TEST_READ_EIO_AT=N``,
from iteration N on every read the installed offloader's engine makes fails with EIO (the
FaultyEngine of tools/faults.py around it), as a drive that died would.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import arguments, get_args, get_tokenizer, pretrain
from megatron.training.arguments import core_transformer_config_from_args

from preempt_points import Preemption
from settle_writes import settle_writes_before_backward

_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
_forward_calls = 0
_PREEMPTION = Preemption.from_environment()  # SSDTRAIN_TEST_PREEMPT: see preempt_points.py


def _settle_writes() -> None:
    """SSDTRAIN_TEST_SETTLE_WRITES=1: the installed offloader waits for its queued writes
    before each backward it is told of (once per process)."""
    from ssdtrain_megatron.megatron import installed

    inst = installed()
    if os.environ.get("SSDTRAIN_TEST_SETTLE_WRITES") != "1" or inst is None:
        return
    offloader = inst.offloader
    if getattr(offloader, "_settled_by_test", False):
        return
    settle_writes_before_backward(offloader)
    offloader._settled_by_test = True


def _fail_reads(iteration: int) -> None:
    """SSDTRAIN_TEST_READ_EIO_AT=N: at iteration N, make every later read of the installed
    offloader's engine fail with EIO (once per process)."""
    from ssdtrain_megatron.megatron import installed

    at = int(os.environ.get("SSDTRAIN_TEST_READ_EIO_AT", "0"))
    inst = installed()
    if not at or iteration < at or inst is None or getattr(inst.offloader, "_reads_fail", False):
        return
    import errno

    from faulty import FaultyEngine

    eio = OSError(errno.EIO, os.strerror(errno.EIO))
    FaultyEngine(inst.offloader.engine, lambda op, path, offset, nbytes: eio if op == "read" else None)
    inst.offloader._reads_fail = True


def _record(entry: dict) -> None:
    folder = os.environ.get("SSDTRAIN_TEST_RECORD")
    if not folder:
        return
    rank = torch.distributed.get_rank()
    with open(os.path.join(folder, f"rank{rank}.jsonl"), "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None):
    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    # --num-experts: MoE layers with SequentialMLP experts (the local spec; grouped GEMM is TE's).
    layer_spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=layer_spec,
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, position_embedding_type="rope",
                    vp_stage=vp_stage)


def _first_or_last_stage() -> bool:
    return (parallel_state.is_pipeline_first_stage(ignore_virtual=True)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=True))


def get_batch(data_iterator):
    """Tensor-parallel rank 0 reads the batch, the others receive it (as Megatron does)."""
    if not _first_or_last_stage():
        return None, None, None, None
    args = get_args()
    shape = (args.micro_batch_size, args.seq_length)
    dtypes = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32,
              "position_ids": torch.int64}
    if _PREEMPTION is not None and _PREEMPTION.armed("batch", 0):
        _PREEMPTION.send()
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        sample = next(data_iterator)
        batch = {k: sample[k].to(dtypes[k]).contiguous() for k in _KEYS}
    else:
        batch = {k: torch.empty(shape, dtype=dtypes[k]) for k in _KEYS}
    for key in _KEYS:
        torch.distributed.broadcast(batch[key],
                                    parallel_state.get_tensor_model_parallel_src_rank(),
                                    group=parallel_state.get_tensor_model_parallel_group())
    return tuple(batch[k] for k in _KEYS)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    _record({"loss": float(loss.detach()).hex(), "tokens": int(num_tokens)})
    if _PREEMPTION is not None and _PREEMPTION.armed("loss", 1):
        _PREEMPTION.send()
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1),
                                                    num_tokens.view(1)])}


def _parameter_hash(model) -> str:
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def forward_step(data_iterator, model):
    global _forward_calls
    args = get_args()
    per_iteration = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    if _forward_calls % per_iteration == 0:
        _record({"iteration": _forward_calls // per_iteration, "params": _parameter_hash(model),
                 "expert_params": sum(".experts." in n for n, _ in model.named_parameters())})
    if _PREEMPTION is not None:
        if _forward_calls == 0:
            _PREEMPTION.hook_model(model)
        _PREEMPTION.at(_forward_calls // per_iteration + 1, _forward_calls % per_iteration,
                       per_iteration)
    _fail_reads(_forward_calls // per_iteration + 1)
    _forward_calls += 1
    _settle_writes()
    tokens, labels, loss_mask, position_ids = get_batch(data_iterator)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(loss_func, loss_mask)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None,
        blend_per_split=None, split=args.split, path_to_cache=None, tokenizer=get_tokenizer(),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False)

    def built_here() -> bool:
        return parallel_state.get_tensor_model_parallel_rank() == 0 and _first_or_last_stage()

    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples, built_here,
                                         config).build()


def main() -> None:
    datasets_provider.is_distributed = True
    if _PREEMPTION is not None:
        _PREEMPTION.hook_optimizer()
        _PREEMPTION.hook_engine()
    common = dict(train_valid_test_dataset_provider=datasets_provider,
                  model_provider=model_provider, model_type=ModelType.encoder_or_decoder,
                  forward_step_func=forward_step)
    defaults = {"tokenizer_type": "NullTokenizer"}
    if hasattr(arguments, "parse_and_validate_args"):  # 0.18+
        from megatron.training.argument_utils import pretrain_cfg_container_from_args

        args = arguments.parse_and_validate_args(args_defaults=defaults)
        pretrain(pretrain_cfg_container_from_args(args), **common)
    else:  # 0.17
        pretrain(args_defaults=defaults, **common)


if __name__ == "__main__":
    main()
