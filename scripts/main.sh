#!/usr/bin/env bash
# Main job: the GSM8K SFT demo of examples/README.md -- a Megatron-Core GPT (4 layers, hidden
# 512, Tekken vocabulary of 131,072) trained with tensor parallelism 2 under torchrun (gloo on
# CPU, NCCL when CUDA is present), with megatron-vocabstats' fused LM head, then compared with
# Megatron's own loss on the same batches. About 3-6 minutes on 2 CPU cores.
#   bash scripts/main.sh [more flags of `python -m examples.gsm8k sft`, e.g. --steps 40]
# Each run writes its report to a directory of its own, outputs/gsm8k/sft-<UTC time>/ (printed
# at the end), unless --out is given; an existing report or --save directory is never replaced
# (the demo refuses it; --overwrite, passed on purpose, allows it).
# NPROC_PER_NODE (default 2) sets the number of ranks (= tp x cp x dp).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/_env.sh
source scripts/_env.sh

ensure_venv .venv 3.12 requirements/py312.txt

out=()
case " $* " in
    *" --out "* | *" --out="*) ;;
    *) out=(--out "outputs/gsm8k/sft-$(date -u +%Y%m%d-%H%M%S)") ;;
esac

# One BLAS thread per rank: the two ranks share the machine's cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m torch.distributed.run --standalone \
    --nproc-per-node "${NPROC_PER_NODE:-2}" -m examples.gsm8k sft \
    --vocab-parallel-stats --lm-head-chunk-size 128 "${out[@]}" "$@"
