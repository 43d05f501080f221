#!/usr/bin/env bash
# Add the --ssd-offload flags and the install() call to the pretrain_gpt.py of a Megatron-LM or
# Megatron-DeepSpeed checkout, for users who keep a fork. Tries every patch in patches/ with
# `git apply --check`, applies the first that fits, and says clearly when none does.
#
#   scripts/apply_patches.sh CHECKOUT           apply the patch that fits
#   scripts/apply_patches.sh --check CHECKOUT   only say which one fits (changes nothing)
#
# Exit status: 0 applied (or already applied, or fits with --check), 1 no patch fits,
# 2 bad usage or no pretrain_gpt.py in CHECKOUT.
# Without a fork, nothing needs patching: python -m ssdtrain_megatron.launch pretrain_gpt.py ...
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
patches_dir="${SSDTRAIN_PATCHES_DIR:-$here/../patches}"
# Most specific first: a release patch before main's, Megatron-LM before Megatron-DeepSpeed.
# core_v0.16: Megatron-LM core_v0.16.1 and core_v0.17.1; core_v0.18: core_v0.18.2; main: main
# and core_v0.19.0.
patches=(megatron-lm-core_v0.16.patch megatron-lm-core_v0.18.patch megatron-lm-main.patch
         megatron-deepspeed.patch)

usage() { echo "usage: $0 [--check] CHECKOUT" >&2; exit 2; }

check_only=0
if [[ "${1:-}" == "--check" ]]; then check_only=1; shift; fi
[[ $# -eq 1 ]] || usage
checkout="$1"
if [[ ! -f "$checkout/pretrain_gpt.py" ]]; then
    echo "apply_patches: $checkout/pretrain_gpt.py not found: give the top folder of a" \
         "Megatron-LM or Megatron-DeepSpeed checkout" >&2
    exit 2
fi
checkout="$(cd "$checkout" && pwd)"

# git apply takes paths relative to the repository's top folder; a checkout may sit inside a
# bigger repository (or in none, where the current folder is the top).
apply_in="$checkout"
apply_args=()
if top="$(git -C "$checkout" rev-parse --show-toplevel 2>/dev/null)" && [[ "$top" != "$checkout" ]]; then
    apply_in="$top"
    apply_args=(--directory="$(git -C "$checkout" rev-parse --show-prefix)")
fi
git_apply() { (cd "$apply_in" && git apply "${apply_args[@]}" "$@"); }

reasons=()
for name in "${patches[@]}"; do
    patch="$patches_dir/$name"
    [[ -f "$patch" ]] || { echo "apply_patches: missing $patch" >&2; exit 2; }
    if git_apply --reverse --check "$patch" 2>/dev/null; then
        echo "apply_patches: $name is already applied to $checkout/pretrain_gpt.py"
        exit 0
    fi
    if why="$(git_apply --check "$patch" 2>&1)"; then
        if (( check_only )); then
            echo "apply_patches: $name fits $checkout/pretrain_gpt.py (--check: nothing changed)"
            exit 0
        fi
        git_apply "$patch"
        echo "apply_patches: applied $name to $checkout/pretrain_gpt.py"
        echo "apply_patches: run it with --ssd-offload [--ssd-offload-config configs/PRESET.yaml]"
        exit 0
    fi
    reasons+=("  $name: $(echo "$why" | tr '\n' ' ' | sed 's/ *$//')")
done

{
    echo "apply_patches: no patch fits $checkout/pretrain_gpt.py; tried:"
    printf '%s\n' "${reasons[@]}"
    echo "apply_patches: the patches were written against Megatron-LM core_v0.16.1, core_v0.17.1,"
    echo "  core_v0.18.2, core_v0.19.0, main (2026-08) and Megatron-DeepSpeed master (2025-07)."
    echo "  For other versions use the launcher, which needs no patch:"
    echo "  torchrun ... -m ssdtrain_megatron.launch $checkout/pretrain_gpt.py [args] --ssd-offload"
} >&2
exit 1
