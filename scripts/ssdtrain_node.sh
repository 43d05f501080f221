#!/usr/bin/env bash
# One node of an ssdtrain-megatron training job. Runs Megatron-LM's pretrain_gpt.py through the
# ssdtrain launcher under torchrun (one process per GPU) with the preset's model, layout and
# offload settings, and removes this job's offload directories on this node when torchrun
# ends: normal exit, failure, scancel or the time limit (SIGTERM), Ctrl-C (SIGINT).
#
# Called once per node by scripts/slurm_pretrain_gpt.sbatch (through srun) and by
# scripts/pretrain_gpt_single_node.sh; not edited by users. Settings come from the environment:
#   MEGATRON_LM    Megatron-LM checkout whose pretrain_gpt.py runs
#   PRESET         YAML preset (configs/*.yaml): --ssd-offload-config, and its model: and
#                  parallel: sections become Megatron flags (a missing or bad preset stops
#                  here, exit 2, before torchrun starts)
#   SSD_DIRS       offload roots, comma-separated path templates ({local_rank}, {rank},
#                  {hostname}, {job}, {user}); each must contain {job}, the directory removed at the end;
#                  the part above {job} must exist (the offloader refuses a missing root)
#   JOB_ID         the {job} value (the Slurm job id)
#   NNODES, GPUS_PER_NODE, MASTER_ADDR, MASTER_PORT, NODE_RANK (default: $SLURM_NODEID or 0)
#   PYTHON         python of the training environment (default: python)
# Arguments: more Megatron flags (data, tokenizer, schedule, ...), passed through.
#   ssdtrain_node.sh --cleanup   only remove this node's job directories
#   ssdtrain_node.sh --preflight [Megatron flags]   only check this node, as the launcher will
#                  in each worker (ssdtrain doctor --preflight, for every local rank, with the
#                  arguments the workers would get): nothing when it passes, one line on stderr
#                  and exit 2 when it fails
set -euo pipefail

preflight=0
if [[ "${1:-}" == "--preflight" ]]; then
    preflight=1
    shift
fi

: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout}"
: "${PRESET:?set PRESET to a preset, e.g. configs/llama2-13b.yaml}"
: "${SSD_DIRS:?set SSD_DIRS to the offload roots, e.g. /mnt/nvme{local_rank}/ssdtrain/{job}}"
: "${JOB_ID:?set JOB_ID (the Slurm job id)}"
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
PYTHON="${PYTHON:-python}"
host="$(hostname)"
user="$(id -un 2>/dev/null || id -u)"  # {user}: the login name (the uid where it has none), as the offloader

# The job directory of one root template for one local rank: the template up to and
# including its {job} component, with every placeholder filled in.
job_dir() {
    local template="$1" local_rank="$2"
    local rest="${template#*\{job\}}"              # what follows the first {job}
    local dir="${template%"$rest"}${rest%%/*}"     # ... up to the end of that component
    dir="${dir//\{job\}/$JOB_ID}"
    dir="${dir//\{local_rank\}/$local_rank}"
    dir="${dir//\{rank\}/$((NODE_RANK * GPUS_PER_NODE + local_rank))}"
    dir="${dir//\{hostname\}/$host}"
    dir="${dir//\{user\}/$user}"
    printf '%s\n' "$dir"
}

IFS=, read -r -a templates <<< "$SSD_DIRS"
job_dirs=()
for template in "${templates[@]}"; do
    if [[ "$template" != *"{job}"* || "$template" != /* ]]; then
        echo "ssdtrain_node: SSD_DIRS entry '$template' must be an absolute path containing" \
             "{job}: the job's directory is removed at the end, never a shared root" >&2
        exit 2
    fi
    for ((lr = 0; lr < GPUS_PER_NODE; lr++)); do
        job_dirs+=("$(job_dir "$template" "$lr")")
    done
done

cleanup() {
    local d
    for d in "${job_dirs[@]}"; do
        # Only the job's own directory: its path ends in the job id component.
        [[ "$d" == *"$JOB_ID"* && "$d" != "/" ]] && rm -rf -- "$d"
    done
    return 0
}

if [[ "${1:-}" == "--cleanup" ]]; then
    cleanup
    exit 0
fi

# Stop here, in one line, on what would only fail later inside every worker.
if [[ ! -f "$PRESET" ]]; then
    echo "ssdtrain_node: PRESET=$PRESET: no such file (a preset: configs/*.yaml)" >&2
    exit 2
fi
if [[ ! -f "$MEGATRON_LM/pretrain_gpt.py" ]]; then
    echo "ssdtrain_node: MEGATRON_LM=$MEGATRON_LM has no pretrain_gpt.py (a Megatron-LM checkout," \
         "tag core_v0.16.1)" >&2
    exit 2
fi
# The preset's shape, micro-batch, dtype and TP/PP layout as Megatron flags.
if ! preset_flags="$("$PYTHON" -m ssdtrain_megatron.megatron.args "$PRESET")"; then
    echo "ssdtrain_node: cannot turn PRESET=$PRESET into Megatron flags (the error is above)" >&2
    exit 2
fi
read -r -a model_args <<< "$preset_flags"
# What each worker's launcher gets: the preset's model, the caller's flags, then offload.
launcher_args=("${model_args[@]}" "$@" --ssd-offload --ssd-offload-config "$PRESET"
               --ssd-offload-dir "$SSD_DIRS" --ssd-offload-job "$JOB_ID")
if (( preflight )); then
    exec "$PYTHON" -m ssdtrain_megatron.tools doctor --preflight --nproc-per-node "$GPUS_PER_NODE" \
        --node-rank "$NODE_RANK" -- "${launcher_args[@]}"
fi

if (( NNODES == 1 )); then
    rendezvous=(--standalone)
else
    rendezvous=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-id "$JOB_ID"
                --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT")
fi

trap cleanup EXIT
# torchrun runs in the background so that SIGTERM (scancel, time limit) reaches this shell at
# once: pass it on and wait for the workers (with Megatron's --exit-signal-handler they finish
# the iteration and save a checkpoint first), then the EXIT trap cleans up.
trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 143' TERM
trap 'kill -INT "$child" 2>/dev/null; wait "$child"; exit 130' INT

"$PYTHON" -m torch.distributed.run "${rendezvous[@]}" --nproc-per-node "$GPUS_PER_NODE" \
    -m ssdtrain_megatron.launch "$MEGATRON_LM/pretrain_gpt.py" "${launcher_args[@]}" &
child=$!
wait "$child"
