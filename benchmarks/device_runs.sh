#!/bin/sh
# The device's benchmark runs, by name, so that a session's timing needs no script of its own (a new
# checkout has none of the last session's gitignored files). Run on the device machine from the repo
# root, through `make bench-gpu RUNS="..." COMMIT=<sha>` (which installs the carried wheels first):
#
#   delta   GDN and KDA, ours against FLA 0.6.0, B4 T4096 and B1 T32768, two rounds  (issue 20)
#   host    host time per compiled fwd+bwd, with and without the static launcher      (issue 24)
#   cp      context parallel GDN and KDA on every GPU of the machine, ours and FLA's    (issue 22)
#   lightning  lightning attention, ours against FLA                                    (issue 20)
#
# Raw rows go to $OUT (or benchmarks/results when OUT is unset), named <bench>_<date>_<device>_<commit>.jsonl;
# copy them under benchmarks/results and commit them so that benchmarks/targets.py reads them.
set -eu
commit=${COMMIT:?pass COMMIT=<the sha of this tree>}
out=${OUT:-benchmarks/results}
day=$(date +%F)
gpus=$(nvidia-smi -L | grep -c '^GPU')
device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed 's/NVIDIA //; s/ .*//' | tr 'A-Z' 'a-z')
tag="${day}_${device}x${gpus}_$(echo "$commit" | cut -c1-7)"
export HCCOMPILE_COMMIT="$commit"
for run in ${RUNS:-delta host}; do
    echo "=== $run ($(date +%T))"
    case $run in
    delta) python3 benchmarks/delta_rule.py --what kernels --ops gdn,kda --impls ours,half-keys,fla --rounds 2 \
               --shapes B4T4096H16D128,B1T32768H16D128 --out "$out/delta_rule_$tag.jsonl" ;;
    host) python3 benchmarks/host_overhead.py --ops floor,gdn,kda --compiled --static-launch --top 12 \
              --jsonl "$out/host_$tag.jsonl" --commit "$commit" ;;
    cp) test "$gpus" -ge 2 || { echo "cp: needs two GPUs, this machine has $gpus"; continue; }
        NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
            torchrun --nproc-per-node "$gpus" benchmarks/cp.py --ops gdn,kda --layouts one \
            --strategies all_gather --out "$out/cp_$tag.jsonl" ;;
    lightning) python3 benchmarks/lightning.py --out "$out/lightning_$tag.jsonl" ;;
    *) echo "unknown run $run"; exit 2 ;;
    esac
done
