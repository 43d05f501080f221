"""ssdtrain-megatron: SSD activation offloading for Megatron training."""

import glob

from setuptools import find_packages, setup

setup(
    name="ssdtrain-megatron",
    version="0.1.0",
    description="Offload Megatron activations to local NVMe SSDs while forward runs, "
                "prefetch them back before backward",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ssdtrain_megatron", "ssdtrain_megatron.*"]),
    # torch: an open lower bound, so users keep their own CUDA build. On a CPU machine the
    # Makefile installs torch==2.13.0 first, so nothing here pulls a multi-GB CUDA wheel.
    # tqdm: progress of the long commands; crc32c: the hardware CRC32C of `checksum: true`
    # (without it, zlib's CRC32 and a warning). Both small, pure wheels on every platform.
    install_requires=["torch>=2.3", "pyyaml>=6", "numpy", "tqdm>=4.60", "crc32c>=2.3"],
    extras_require={
        "test": ["pytest>=7", "matplotlib"],
        # 0.16-0.20 (ssdtrain_megatron/megatron/compat.py; 0.20: Megatron-LM main, no wheel
        # yet). The 0.17+ wheels declare
        # Requires-Python >=3.12: on 3.11 pip picks 0.16.1 here; a newer one installs with
        # `pip install --ignore-requires-python --no-deps megatron-core==X` (docs/install.md).
        "megatron": ["megatron-core>=0.16,<0.21"],
        "aio": ["deepspeed>=0.19.8,<0.20"],
        # Megatron-DeepSpeed (master 4efb479d) imports deepspeed.compression.compress, which
        # DeepSpeed 0.19.8 removed; 0.19.0 still has it.
        "megatron-deepspeed": ["deepspeed==0.19.0"],
        # kvikio ships one wheel per CUDA major: pick the one matching torch's CUDA
        # (`python -c "import torch; print(torch.version.cuda)"`).
        "gds": ["kvikio-cu12"],
        "gds-cu13": ["kvikio-cu13"],
        "te": ["transformer-engine[pytorch]"],
        "plot": ["matplotlib"],
    },
    # The presets, so that an installed package finds `--config llama3-70b` too
    # (ssdtrain_megatron/presets.py looks in <prefix>/share/ssdtrain-megatron/configs).
    data_files=[("share/ssdtrain-megatron/configs", sorted(glob.glob("configs/*.yaml")))],
    entry_points={
        "console_scripts": [
            "ssdtrain=ssdtrain_megatron.tools.cli:main",
            "ssdtrain-pretrain=ssdtrain_megatron.launch:main",
        ],
    },
)
