#!/bin/bash
# Single-node Megatron-LM pretraining with SSD activation offload, on a workstation or under
# Slurm. Megatron flags go after the script, and win over the defaults below (Megatron keeps a
# flag's last value):
#   bash scripts/pretrain_gpt_single_node.sh --data-path /data/corpus_text_document \
#       --tokenizer-model /models/llama2/tokenizer.model --save /ckpt/run1 --load /ckpt/run1
#   PRESET=configs/gpt3-1.3b.yaml GPUS_PER_NODE=1 bash scripts/pretrain_gpt_single_node.sh ...
#   sbatch scripts/pretrain_gpt_single_node.sh ...
# torchrun starts one process per GPU on Megatron-LM's pretrain_gpt.py through the ssdtrain
# launcher, with the preset passed as --ssd-offload-config and its model/parallel sections as
# Megatron flags; the job's offload directories are removed when it ends, fails, or is
# interrupted (Ctrl-C, scancel). Running the same command again resumes from --load and
# appends to the same stats/trace files.
#
# Lines marked EDIT are the ones to change. The #SBATCH lines (read by sbatch only) are
# cluster-specific: adapt them, or override them on the sbatch command line (it wins):
#   --gpus-per-node  a cluster without GPU gres refuses the job
#                    ("Invalid generic resource (gres) specification"):
#                    use its own form (--gres=gpu:a100:8) or --gpus-per-node=0 there
#   --cpus-per-task  at most the cores of one node; more leaves the job pending for ever
#                    (reason PartitionConfig): see `sinfo -o '%n %c'`
#   --time           the run; most clusters also want --partition and --account
#SBATCH --job-name=ssdtrain-pretrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8          # EDIT: GPUs (= GPUS_PER_NODE below), see above
#SBATCH --cpus-per-task=96         # EDIT: CPU cores (at most a node's), see above
#SBATCH --time=24:00:00            # EDIT: time limit
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail

# This repository: $SSDTRAIN, else the folder above this script. sbatch runs a copy of the
# script from its spool folder: then the path it was submitted as comes from the job.
if [[ -z "${SSDTRAIN:-}" ]]; then
    SSDTRAIN="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if [[ ! -f "$SSDTRAIN/scripts/ssdtrain_node.sh" && -n "${SLURM_JOB_ID:-}" ]] \
            && command -v scontrol >/dev/null; then
        submitted="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')"
        if [[ -f "$submitted" ]]; then
            SSDTRAIN="$(cd "$(dirname "$submitted")/.." && pwd)"
        fi
    fi
fi
if [[ ! -f "$SSDTRAIN/scripts/ssdtrain_node.sh" ]]; then
    echo "pretrain_gpt_single_node: no scripts/ssdtrain_node.sh in SSDTRAIN=$SSDTRAIN; set" \
         "SSDTRAIN to the ssdtrain-megatron checkout" >&2
    exit 2
fi
MEGATRON_LM="${MEGATRON_LM:-$HOME/Megatron-LM}"       # EDIT: Megatron-LM checkout (tag core_v0.16.1)
PRESET="${PRESET:-$SSDTRAIN/configs/llama2-7b.yaml}"  # EDIT: model x parallel layout x SSD set
# The part above {job} (/mnt/nvme0/ssdtrain) must exist: a missing one is refused, not created.
# EDIT: local NVMe roots, one drive per local rank; must contain {job} (removed at the end)
[[ -n "${SSD_DIRS:-}" ]] || SSD_DIRS='/mnt/nvme{local_rank}/ssdtrain/{job}'
PYTHON="${PYTHON:-python}"                            # EDIT: python of the training environment
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"                   # EDIT: GPUs on this node
JOB_ID="${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)-$$}"

# EDIT: the Megatron flags of this run that the preset does not set. One string, split on
# whitespace (no quoting): set MEGATRON_ARGS in the environment to replace it, or pass flags
# after the script to add or override some (paths with spaces go there). Data, tokenizer
# model, checkpoints (--save/--load) and anything else of the run: after the script.
# EDIT: the defaults (see the comment above)
MEGATRON_ARGS="${MEGATRON_ARGS-\
--position-embedding-type rope --normalization RMSNorm \
--disable-bias-linear --untie-embeddings-and-output-weights --tokenizer-type Llama2Tokenizer \
--global-batch-size 256 --train-iters 10000 --lr 3e-4 --min-lr 3e-5 \
--lr-decay-style cosine --lr-warmup-iters 500 --weight-decay 0.1 --clip-grad 1.0 \
--save-interval 1000 --log-interval 10 --eval-interval 1000 --eval-iters 10}"
read -r -a megatron_args <<< "$MEGATRON_ARGS"

export SSDTRAIN MEGATRON_LM PRESET SSD_DIRS PYTHON GPUS_PER_NODE JOB_ID
export NNODES=1 NODE_RANK=0
export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron asks for it with TP or sequence parallelism

# Pre-flight: what the launcher would check in each worker (ssdtrain doctor --preflight: the
# flags and the preset, every local rank's roots, free space against the preset's model, the
# engine), before torchrun starts; a problem stops here in one line naming the node, the local
# ranks, the path and the fix. SSDTRAIN_SKIP_PREFLIGHT=1 skips it here and in the workers.
if [[ "${SSDTRAIN_SKIP_PREFLIGHT:-0}" == 0 ]]; then
    bash "$SSDTRAIN/scripts/ssdtrain_node.sh" --preflight "${megatron_args[@]}" "$@" || exit $?
fi
exec bash "$SSDTRAIN/scripts/ssdtrain_node.sh" "${megatron_args[@]}" "$@"
