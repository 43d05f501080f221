"""The tiny GPT that the Megatron-LM and Megatron-DeepSpeed script tests train, as flags.

One place for the shape and the training settings that every such test shares, so that the
runs stay comparable; each test adds its parallel layout and what its script needs.
"""

from typing import List

# Megatron-LM (core) on CPU: mock data, the local (non-TE) layers, no fused kernels, and
# --clip-grad 0: Megatron's gradient clipping asserts that gradients are CUDA tensors.
MEGATRON_LM_CPU = ["--clip-grad", "0", "--mock-data", "--transformer-impl", "local",
                   "--no-rope-fusion", "--no-persist-layer-norm"]


def tiny_gpt(iterations: int, micro_batch: int = 2, global_batch: int = 8) -> List[str]:
    """4 layers, hidden 64, 4 heads, sequence 32, vocabulary 128, constant lr, seed 1234,
    gloo, no eval, a log line per iteration, no fused kernels."""
    return [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", str(micro_batch), "--global-batch-size", str(global_batch),
        "--train-iters", str(iterations), "--lr", "1e-4", "--min-lr", "1e-5",
        "--lr-decay-style", "constant", "--seed", "1234",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--split", "100,0,0", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
        "--distributed-backend", "gloo", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion",
    ]


def needs_megatron_training():
    """The skip mark of the tests that run Megatron-LM's own training loop from the wheel:
    megatron-core 0.17+ ships ``megatron.training``, 0.16 does not."""
    import importlib.util

    import pytest

    from ssdtrain_megatron.megatron import compat

    version = compat.megatron_core_version()
    return pytest.mark.skipif(
        not compat.release_for(version).ships_training
        or importlib.util.find_spec("megatron.training") is None,
        reason=f"megatron-core {version} ships no megatron.training (0.17+ do): run "
               "`make test-mcore-0.17` (or 0.18, 0.19)")

