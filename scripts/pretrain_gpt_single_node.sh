#!/bin/bash
# Single-node Megatron-LM pretraining with SSD activation offload, on a workstation or under
# Slurm:
#   bash scripts/pretrain_gpt_single_node.sh [more Megatron flags]
#   PRESET=configs/gpt3-1.3b.yaml GPUS_PER_NODE=1 bash scripts/pretrain_gpt_single_node.sh
#   sbatch scripts/pretrain_gpt_single_node.sh
# torchrun starts one process per GPU on Megatron-LM's pretrain_gpt.py through the ssdtrain
# launcher, with the preset passed as --ssd-offload-config and its model/parallel sections as
# Megatron flags; the job's offload directories are removed when it ends, fails, or is
# interrupted (Ctrl-C, scancel).
# Lines marked EDIT are the ones to change.
#SBATCH --job-name=ssdtrain-pretrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8          # EDIT: GPUs (= GPUS_PER_NODE below)
#SBATCH --cpus-per-task=96         # EDIT: CPU cores
#SBATCH --time=24:00:00            # EDIT: time limit
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail

# This repository: found from the script's own path, or (sbatch runs a copy of the script)
# the folder it was submitted from.
if [[ -z "${SSDTRAIN:-}" ]]; then
    SSDTRAIN="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    [[ -f "$SSDTRAIN/scripts/ssdtrain_node.sh" ]] || SSDTRAIN="${SLURM_SUBMIT_DIR:-$PWD}"
fi
MEGATRON_LM="${MEGATRON_LM:-$HOME/Megatron-LM}"       # EDIT: Megatron-LM checkout (tag core_v0.16.1)
PRESET="${PRESET:-$SSDTRAIN/configs/llama2-7b.yaml}"  # EDIT: model x parallel layout x SSD set
# EDIT: local NVMe roots, one drive per local rank; must contain {job} (removed at the end)
[[ -n "${SSD_DIRS:-}" ]] || SSD_DIRS='/mnt/nvme{local_rank}/ssdtrain/{job}'
PYTHON="${PYTHON:-python}"                            # EDIT: python of the training environment
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"                   # EDIT: GPUs on this node
JOB_ID="${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)-$$}"

# EDIT: data, tokenizer, schedule, checkpoints, and the model flags the preset does not set.
MEGATRON_ARGS=(                     # EDIT (see the comment above)
    --position-embedding-type rope --normalization RMSNorm
    --disable-bias-linear --untie-embeddings-and-output-weights
    --tokenizer-type Llama2Tokenizer --tokenizer-model /path/to/tokenizer.model
    --data-path /path/to/my-corpus_text_document
    --global-batch-size 256 --train-iters 10000 --lr 3e-4 --min-lr 3e-5
    --lr-decay-style cosine --lr-warmup-iters 500 --weight-decay 0.1 --clip-grad 1.0
    --save /path/to/checkpoints --save-interval 1000
    --log-interval 10 --eval-interval 1000 --eval-iters 10
)

export SSDTRAIN MEGATRON_LM PRESET SSD_DIRS PYTHON GPUS_PER_NODE JOB_ID
export NNODES=1 NODE_RANK=0
export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron asks for it with TP or sequence parallelism

exec bash "$SSDTRAIN/scripts/ssdtrain_node.sh" "${MEGATRON_ARGS[@]}" "$@"
