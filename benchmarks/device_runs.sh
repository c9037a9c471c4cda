#!/bin/sh
# The device's benchmark runs, by name, so that a session's timing needs no script of its own (a new
# checkout has none of the last session's gitignored files). Run on the device machine from the repo
# root, through `make bench-gpu RUNS="..." COMMIT=<sha>` (which installs the carried wheels first):
#
#   delta   GDN and KDA, ours against FLA 0.6.0, B4 T4096 and B1 T32768, two rounds  (issue 20); DELTA_OPS
#           (kda-gate: the gate in the kernel), DELTA_SHAPES (B2T2048H8D128: issue 5's third shape) and
#           DELTA_IMPLS replace the defaults
#   host    host time per compiled fwd+bwd, with and without the static launcher      (issue 24)
#   cp      context parallel GDN and KDA on every GPU of the machine, ours and FLA's    (issue 22)
#   cp-quick  GDN at 64K and 256K tokens and KDA at 64K (or CP_CASES="gdn:65536 ..."), one sequence (or
#           CP_LAYOUTS="one,several"), one op a step (or CP_LAYERS=4 chained), ours
#           (all_gather) and FLA's, one GPU and CP, with every rank's kernel profile and chrome trace (a .tgz
#           beside the rows)                                                          (issue 22)
#   lightning  lightning attention, ours against FLA; LIGHTNING_SHAPES (say B8-T2048-H32-D64) picks shapes, LIGHTNING_ARGS
#               adds options (say --no-switches --skip-plain --rounds 2: the rows targets.py reads, in less time,
#               in two alternating rounds of ours and FLA) (issue 20)
#   mhc     the mHC step's target rows: n1-inductor and n4-hc-block at C1024 L4 B4 and C4096 L2 B2
#           (step, peak memory, compile time with hc's stages, floor), and n4-hc-block-cg at C1024
#           (the host target: without / with CUDA graphs)                            (issue 18, 24)
#   lightning-b1  per-kernel GPU time of lightning at B1 T32768, then ours against FLA at B1 T32768 and
#               B4 T4096 (the target rows)                                               (issue 20)
#   lightning-tune  the lightning defaults (flat loop, 64 columns, 4 warps) and their neighbours (paired
#               reverse, 8 warps, 128 columns, nested loops), sequential states on and off, D 128 and
#               D 64, into diag_ rows                                                   (issue 20)
#   host-eager  host time per eager fwd+bwd (lightning, GDN, the pointwise floor): the ops' calls without
#               the dispatcher (lowering/_launch.py call_op) and through it, in one process (issue 24, 20)
#   mhc-compile  the C1024 mHC step's compile under cProfile (n1-inductor, n4-hc-block) and hc's dumps of
#               the compiled graphs, with the kernels and ops each generated code calls, counted (issue 18)
#   mhc-profile  per-kernel GPU time of the C1024 mHC step (n1-inductor, n4-hc-block), as
#               diag_mhc-profile_2026-11-29_h200x1_7999b35.txt was taken                  (issue 18)
#   mhc-host  the C1024 mHC step's host time: enqueue ms per step and a cProfile of warm steps
#               (n1-inductor, n4-hc-block, n4-hc-block-cg)                             (issue 18, 24)
#   mhc-before  the C1024 n4-hc-block step of the .before tree (make before-tree REF=<commit>, carried)
#               and of this one, one after the other (benchmarks/before_after.py)        (issue 18)
#   mhc-stream-grad-proto  the stream's whole gradient from one kernel (prototype) against the op's
#               backward kernel + Inductor's sum, checked against float64, then timed       (issue 18)
#   mhc-dx-proto  the stream gradient's dx alone (per-token work; spread tiles and plain 2-D tiles) with dφ by
#               cuBLAS beside it, against the op's backward kernel + Inductor's sum
#               (mhc_stream_grad_proto.py --dx-only)                                       (issue 18)
#   bwd-thread-profile  bwd-thread's split for lightning at B1 T32768, then our backward under cProfile on the
#               engine's device thread and on the calling thread (backward_thread.py --profile)  (issues 20, 24)
#   local-du-b4  GDN B4 T4096 H16 D128 per-kernel profiles with dU's local part forced on and off (issue 20)
#   mhc-memory  the blocks alive at the C1024 step's memory peak, by the line that allocated them
#               (n1-inductor, n4-hc-block with and without hc_project)                  (issue 18)
#   mhc-static-compile  the C1024 n1-inductor and n4-hc-block rows (hc's default: our kernels through
#               Inductor's static launcher), then n4-hc-block with static_launch_user_defined_triton_kernels=false,
#               each on Triton's cache as this call left it (run it before any other mHC run)  (issue 18)
#   lightning-states  the lightning segment summary's and prefix's launch options against the
#               defaults, at B1 T32768 H16 D128 (benchmarks/analysis/lightning_states_tune.py) (issue 20)
#   mhc-noproject  the C1024 n4-hc-block step without hc_project (--hc-option disable_passes=hc_project),
#               to set beside the mhc run's row with it                                  (issue 18)
#   mhc-kernels  each fused mHC op (post, aggregate, mapping, project) beside its plain form under
#               Inductor, fwd and fwd+bwd, at C1024 B4 S2048 n4 (mhc.py --kernels)        (issue 18)
#   mhc-caller  the C1024 n1-inductor and n4-hc-block steps with each backward on the calling thread
#               (--backward-on-caller), not on autograd's device thread                  (issue 18, 24)
#   mhc-static  the C1024 n4-hc-block step with Inductor's static launcher for our kernels, and its host
#               profile                                                                  (issue 24)
#   mhc-options  the C1024 n4-hc-block step under each set of hc options in MHC_OPTION_SETS (sets separated by
#               ';', a set's KEY=VALUE options by spaces, 'default' for none), each profiled per kernel, with the
#               stream-sized buffers its backward allocates counted by dtype from hc's dumps; then n1-inductor
#               (issue 18: Inductor's realize thresholds against emulate_precision_casts' extra casts)
#   mhc-project-proto  the projection kernels' launch configurations (kernels/mhc/project.py, swept by
#               benchmarks/analysis/mhc_project_proto.py) and a two-launch backward (dv streamed, then dφ):
#               checked against float64, then timed beside cuBLAS + Inductor at C1024 n4    (issue 18)
#   sweep-step  GDN's backward state sweep with its off-chain products taken out (P^T dO, Q^T dO): what moving them
#               to chunk-parallel kernels could save a chunk step, B1 and B4 (SWEEP_STEP_VARIANTS, _OPS gdn,kda, _SHAPES pick) (issue 20)
#   m-form  the delta rule's backward state sweep with one off-chain product a step (M = e^G Q - P W and dU's local part
#               from a chunk-parallel kernel before it), GDN and KDA at B1 and B4 against the default, then checked (issue 20)
#   host-split  an eager fwd+bwd's host time split into its parts (lightning, GDN): the op, the kernels'
#               functions, the engine, Triton's launches                               (issue 24, 20)
#   lightning-quick  lightning at B4 T4096 beside FLA, the defaults only, then the kernel profile at
#               B1 T32768 (ours and FLA's), into diag_ rows                              (issue 20)
#   lightning-order  the B1 T32768 rows beside FLA with the no-decay setting first (it ran second and slower in
#               two runs of three, with the same kernels and GPU time)                    (issue 20)
#   lightning-caller  lightning-quick's B4 T4096 rows with every backward on the calling thread
#               (--backward-on-caller), ours and FLA's, into diag_ rows                 (issue 20)
#   lightning-profile  per-kernel GPU time of our lightning at B4 T4096 H16 D128, fwd+bwd and forward
#               alone (no FLA: its first call autotunes for minutes)                  (issue 20)
#   lightning-stages  the lightning defaults at the sweeps' stage budget of 96 KiB (2 stages for the flat
#               forward at D 128) and 128 KiB (3 stages: fewer spills, one program per SM), every shape,
#               and the backward from the forward's saved states, into diag_ rows         (issue 20)
#   delta-tune  GDN's launch options one kernel at a time (l2norm rows and warps, dqkw, wy_bwd) against
#               the defaults in one process, fwd+bwd at B4 T4096, into diag_ rows          (issue 20)
#   delta-profile  per-kernel GPU time of our GDN and KDA at B4 T4096 and B1 T32768 H16 D128 (no FLA: its
#               first call autotunes for minutes)                                        (issue 20)
#   gdn-tune  GDN's launch options one kernel at a time against the defaults, fwd+bwd at B1 T32768 H16 D128
#               (GDN_TUNE_SHAPE, GDN_TUNE_KERNELS pick): dqkw's key-tile order (DQKW_KEY_TILES_FASTEST=False,
#               the default since session 48), and the options of wy_solve, output, both sweeps, wy_bwd and dqkw
#               (session 45 took wy_bwd 1 stage, dqkw 3)                                             (issue 20)
#   bwd-thread  one eager backward's host time split at autograd's hand-off (benchmarks/analysis/backward_thread.py):
#               backward() -> our backward's start -> its end -> backward() returns, on the engine's device thread
#               and on the calling thread, lightning and GDN at B4 T4096 and B1 T32768               (issues 20, 24)
#   local-du  GDN with dU's local part as its own launch (plan.LOCAL_DU_KERNEL) against the default, fwd+bwd at B1
#               T32768 and B4 T4096, then that kernel's warps with it on, and the B1 kernel profile with it on  (issue 20)
#   kda-solve KDA at B4 and B1: decayed_scores with one program per chunk (scores_chunk.py) against one per
#               sub-chunk (the default), wy_solve's substitution with L's diagonal blocks in registers (the default)
#               against a row load per step, and its warps and stages (session 45 on the H200: 2 warps, 1 stage
#               best), and the output kernel's 64-wide value tile (128 the default since session 45)     (issue 20)
#   kda-tune  KDA's launch options one kernel at a time against the defaults (tuned on the H100), fwd+bwd at
#               B4 T4096 (every KDA kernel) and B1 T32768 (the sweeps), into diag_ rows     (issue 20)
#   mhc-dx-form  stream-sized float32 buffers in the compiled mHC step's code (analysis/mhc_stream_grad_buffers.py)
#               for this tree and the .before tree (make before-tree REF=<commit>, carried), the post's dx
#               test on the GPU, then the C1024 n4-hc-block step before / after, twice      (issue 18)
#   delta-segments  whether GDN's and KDA's sweeps pay to run segment-parallel on one GPU at B1 T32768: the op over
#               the sequence cut in 2-16 pieces plus CP's summary walks over them, against the whole
#               sequence, per kernel (analysis/delta_segment_parallel_proto.py)           (issue 20, 22)
#   step-timeline  one eager lightning fwd+bwd at B1 T32768 (decay, no decay, FLA's) kernel by kernel: when the
#               host launched it, when the GPU started it, the GPU's gaps spent waiting on the host
#               (analysis/step_timeline.py; the B1 rows' host share)                  (issue 20, 24)
#   lightning-segments  lightning's segment length (segments.SWEEP_WAVES, MIN_SEGMENT; never tuned) at B1
#               T32768 and B4 T4096: fwd, fwd+bwd and per-kernel time (analysis/lightning_segments_tune.py) (issue 20)
#   l2norm-bw   the delta rule's l2norm kernel alone against the copy bandwidth and Inductor's l2norm, over
#               rows per program and warps (analysis/l2norm_bandwidth.py; 1.1 TB/s in the step)   (issue 20)
#   accuracy    GDN and KDA against the float64 recurrence (random and aligned keys, T 1000 D 128): ours, ours
#               with fp32 key gradients (fp32-keys; fp32-dl: wy_bwd's dL from the fp32 A), fp32 intermediates, FLA
#               (ACCURACY_IMPLS and ACCURACY_OPS pick)                                                      (issue 20)
#   kda-prepared  KDA's backward sweep on decayed queries and keys formed before it (plan.PREPARED_CHANNEL_SWEEP,
#               decayed_keys.py) against the defaults, fwd+bwd at B4 T4096 and B1 T32768; then, with it on, the
#               sweep's launch options (4 / 8 warps, 1 / 3 stages) at B1 (tune_delta_rule.py)        (issue 20)
#   kda-gate-tune  KDA with the gate in the kernel: gate_backward's key tile and warps, and the score kernels'
#               FACTOR_SPAN_LIMIT at 60 and inf (what the split diagonal blocks cost), fwd+bwd at B1 T32768 and B4 T4096
#               (tune_delta_rule.py; KDA_GATE_KERNELS and KDA_GATE_SHAPES pick)                                 (issue 20)
#   gate-bwd    KDA's in-kernel gate backward in a fwd+bwd at B1 T32768: its GPU time over key tiles and warps,
#               the gradients against the defaults' (analysis/gate_backward_variants.py) (issue 20)
#   split-cost  KDA's score kernels' GPU time with the gate in the kernel and with logsigmoid gates, one program per
#               chunk or per sub-chunk, FACTOR_SPAN_LIMIT 40 / 60 / 0 (analysis/split_cost.py)           (issue 20)
#   split-apart KDA's backward score kernel with the split diagonal blocks apart from the key loop and / or the chunk
#               program's sub-chunks in a loop, kda-gate and kda, limits 40 and 0 (analysis/split_apart_proto.py;
#               SPLIT_SHAPES, SPLIT_OPS pick: kda-strong is the in-kernel gate at four times FLA's A)      (issue 20)
#   kda-gate-profile  KDA's per-kernel GPU time with the gate computed in the kernel against the precomputed
#               gate and FLA's in-kernel gate, B1 T32768 H16 D128 (profile_ops.py)                  (issue 20)
#   sweep-overlap  how much chunk-parallel work could hide under the state sweeps: one GDN and one KDA fwd+bwd's
#               launches recorded, then the sweep and its consumers (output; dqkw + wy_bwd, or wy_backward +
#               decayed_scores_backward) replayed alone, in order and side by side on two streams, B1 T32768 and
#               B4 T4096 (analysis/sweep_overlap.py)                                     (issue 20)
#   narrow-tile whether the delta rule's backward state sweep can run 16-wide value tiles (state.py's
#               MIN_BACKWARD_SWEEP_TILE): the kernel tests' cases per variant (options, dh0's store), and the
#               B1 T32768 GDN/KDA fwd+bwd with state_backward's time for those that pass (issue 20)
#   sync-check  host synchronisations in warm eager fwd+bwd steps of lightning, GDN and KDA, fixed-length and
#               varlen (torch.cuda.set_sync_debug_mode, analysis/sync_check.py)          (issue 22, 24)
#   mhc-dump-pair  hc's dumps of the C1024 n4-hc-block step for this tree and the .before tree (make before-tree
#               REF=<commit>, carried), and in each backward's code the float32 stream-sized buffers
#               ([4, 2048, 4, 1024]) with the kernels that write and read them            (issue 18)
#   kernel-profile  per-kernel GPU time of lightning, GDN and KDA beside FLA's at B4 T4096 H16 D128   (issue 20)
#   htree   htree (the defaults, and the atomics backward) against SDPA, T 32K and 128K; the public
#           regime (--config seed) at 128K                                               (issue 19)
#   htree-profile  per-kernel GPU time of htree (both backward versions) and SDPA at B1 T32K     (issue 19)
#   htree-tune  htree's launch knobs at T 32K (tile, warps, programs per SM, node warps and rows;
#               the public regime's tile and warps) into diag_ rows, which targets.py does not read (issue 19)
#
# Each run is cut at RUN_LIMIT_S seconds (default 240) so that one slow run leaves time to the next;
# rows are appended as measured, so a cut run keeps what it finished.
#
# Raw rows go to $OUT (or benchmarks/results when OUT is unset), named <bench>_<date>_<device>_<commit>.jsonl;
# copy them under benchmarks/results and commit them so that benchmarks/targets.py reads them.
set -eu
commit=${COMMIT:?pass COMMIT=<the sha of this tree>}
out=${OUT:-benchmarks/results}
day=$(date +%F)
# CUDA_VISIBLE_DEVICES (make bench-gpu-split: one run list per card) limits the GPUs a run sees and names.
if test -n "${CUDA_VISIBLE_DEVICES:-}"; then
    gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
else
    gpus=$(nvidia-smi -L | grep -c '^GPU')
fi
device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed 's/NVIDIA //; s/ .*//' | tr 'A-Z' 'a-z')
tag="${day}_${device}x${gpus}_$(echo "$commit" | cut -c1-7)"
export HCCOMPILE_COMMIT="$commit"
limit=${RUN_LIMIT_S:-240}
cut_at() { timeout "$limit" "$@" || echo "=== exit $? (124: cut at $limit s): $*" | cut -c1-200; }
# FLA's first calls autotune for minutes on a fresh machine (KDA, and its CP path), every device call
# again: Triton's autotune results are kept on disk (TRITON_CACHE_AUTOTUNING), seeded from
# benchmarks/autotune/autotune_<device>_<versions>.tgz when one is committed, and all of them written back to
# $out under the same name at the end (copy it into benchmarks/autotune/ and commit it to keep the new
# ones). The timings are Triton's own from an earlier call on the same GPU model, torch, Triton and FLA
# (its cache key holds the kernel's source, the target and the tuning key); an FLA first_call_s after a
# seeded cache is its compile, not its autotuning. Our kernels do not autotune.
export TRITON_CACHE_AUTOTUNING=1
triton_cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
versions=$(python3 -c "import torch, triton; print('torch%s_triton%s' % (torch.__version__.split('+')[0], triton.__version__))")
autotune_seed="benchmarks/autotune/autotune_${device}_$versions.tgz"
mkdir -p "$triton_cache"
if test -f "$autotune_seed"; then
    tar xzf "$autotune_seed" -C "$triton_cache" && echo "autotune results seeded from $autotune_seed"
fi
save_autotune() {
    list=$(mktemp)
    (cd "$triton_cache" && find . -name '*.autotune.json' | sort) > "$list"
    if test -s "$list"; then
        tar czf "$out/autotune_${device}_$versions.tgz" -C "$triton_cache" -T "$list"
        echo "autotune results: $(wc -l < "$list") files in $out/autotune_${device}_$versions.tgz"
    fi
    rm -f "$list"
}
for run in ${RUNS:-delta host}; do
    echo "=== $run ($(date +%T), at most $limit s)"
    case $run in
    delta) cut_at python3 benchmarks/delta_rule.py --what kernels --ops "${DELTA_OPS:-gdn,kda}" \
               --impls "${DELTA_IMPLS:-ours,fla}" --rounds 2 \
               --shapes "${DELTA_SHAPES:-B4T4096H16D128,B1T32768H16D128}" --out "$out/delta_rule_$tag.jsonl" ;;
    host) cut_at python3 benchmarks/host_overhead.py --ops floor,gdn,kda --compiled --static-launch --top 12 \
              --jsonl "$out/host_$tag.jsonl" --commit "$commit" ;;
    cp) test "$gpus" -ge 2 || { echo "cp: needs two GPUs, this machine has $gpus"; continue; }
        cut_at env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
            torchrun --standalone --nproc-per-node "$gpus" benchmarks/cp.py --ops gdn,kda --layouts one \
            --strategies all_gather --out "$out/cp_$tag.jsonl" ;;
    cp-quick) test "$gpus" -ge 2 || { echo "cp-quick: needs two GPUs, this machine has $gpus"; continue; }
        # FLA's autotuning results kept in the Triton cache: its 256K run and its CP path reuse the 64K's.
        # CP_CASES (op:tokens ...) picks the cases: FLA's first CP call autotunes for minutes, so a short
        # call may give one case all of RUN_LIMIT_S; CP_IMPLS=hc leaves FLA out; CP_STRATEGIES adds variants
        # (all_gather,all_gather:summary16: the summary sweeps at 16-wide tiles, with their errors against one GPU).
        for case in ${CP_CASES:-gdn:65536 gdn:262144 kda:65536}; do
            cut_at env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
                TRITON_CACHE_AUTOTUNING=1 torchrun --standalone --nproc-per-node "$gpus" benchmarks/cp.py \
                --ops "${case%%:*}" --tokens "${case##*:}" --layouts "${CP_LAYOUTS:-one}" --layers "${CP_LAYERS:-1}" --impls "${CP_IMPLS:-hc,fla}" --strategies "${CP_STRATEGIES:-all_gather}" --iters 10 \
                --warmup 3 --profile "$out/cp_profiles" --out "$out/cp_$tag.jsonl"
        done
        tar czf "$out/cp_profiles_$tag.tgz" -C "$out" cp_profiles && rm -rf "$out/cp_profiles" ;;
    mhc) cut_at python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
             --variants n1-inductor,n4-hc-block,n4-hc-block-cg --out "$out/mhc_$tag.jsonl"
         cut_at python3 benchmarks/mhc.py --layers 2 --dim 4096 --heads 32 --batch 2 --seq 2048 \
             --variants n1-inductor,n4-hc-block --out "$out/mhc_$tag.jsonl" ;;
    mhc-compile) cut_at python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
                     --variants n1-inductor,n4-hc-block --compile-profile 45 --dump-dir "$out/mhc_dump" \
                     --out "$out/diag_mhc-compile_$tag.jsonl" > "$out/diag_mhc-compile_$tag.txt" 2>&1
                 # what the compiled backward launches, per kernel or op (post_fwd calls: 8 forward + the recomputed)
                 for code in "$out"/mhc_dump/*/graph_*/inductor_*_code.py; do
                     echo "== $code"; grep -o "_mhc_[a-z_]*_kernel[_0-9]*\.run(\|ops\.hccompile\.[a-z_]*" "$code" | sort | uniq -c
                 done >> "$out/diag_mhc-compile_$tag.txt" 2>&1
                 tar czf "$out/diag_mhc-dump_$tag.tgz" -C "$out" mhc_dump && rm -rf "$out/mhc_dump" ;;
    mhc-profile) cut_at python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
                     --variants n1-inductor,n4-hc-block --profile \
                     --out "$out/diag_mhc_$tag.jsonl" > "$out/diag_mhc-profile_$tag.txt" 2>&1 ;;
    mhc-host) cut_at python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
                  --variants n1-inductor,n4-hc-block,n4-hc-block-cg --host-profile 40 \
                  --out "$out/diag_mhc_$tag.jsonl" > "$out/diag_mhc-host_$tag.txt" 2>&1 ;;
    mhc-before) test -f .before/COMMIT || { echo "mhc-before: no .before tree (make before-tree REF=<commit>; carry .before)"; continue; }
                cut_at python3 benchmarks/before_after.py --family mhc --out "$out/diag_mhc-before_$tag.jsonl" \
                    -- --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 --variants n4-hc-block ;;
    mhc-static-compile) cut_at python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
                            --variants n1-inductor,n4-hc-block --out "$out/mhc_$tag.jsonl"
                        cut_at python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
                            --variants n4-hc-block --hc-option static_launch_user_defined_triton_kernels=false \
                            --out "$out/diag_mhc-nostatic_$tag.jsonl" ;;
    lightning-states) cut_at python3 benchmarks/analysis/lightning_states_tune.py \
                          > "$out/diag_lightning-states_$tag.txt" 2>&1 ;;
    mhc-noproject) cut_at python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
                       --variants n4-hc-block --hc-option disable_passes=hc_project \
                       --out "$out/diag_mhc-noproject_$tag.jsonl" > "$out/diag_mhc-noproject_$tag.txt" 2>&1 ;;
    mhc-memory) cut_at python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
                    --variants n1-inductor,n4-hc-block --memory-peak 30 \
                    --out "$out/diag_mhc-memory_$tag.jsonl" > "$out/diag_mhc-memory_$tag.txt" 2>&1
                cut_at python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
                    --variants n4-hc-block --memory-peak 30 --hc-option disable_passes=hc_project \
                    --out "$out/diag_mhc-memory_$tag.jsonl" >> "$out/diag_mhc-memory_$tag.txt" 2>&1 ;;
    mhc-kernels) cut_at python3 benchmarks/mhc.py --kernels --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
                     > "$out/diag_mhc-kernels_$tag.txt" 2>&1 ;;
    mhc-caller) cut_at python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
                    --variants n1-inductor,n4-hc-block --backward-on-caller \
                    --out "$out/diag_mhc-caller_$tag.jsonl" > "$out/diag_mhc-caller_$tag.txt" 2>&1 ;;
    mhc-static) cut_at python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
                    --variants n4-hc-block --host-profile 25 --hc-option static_launch_user_defined_triton_kernels=true \
                    --out "$out/diag_mhc-static_$tag.jsonl" > "$out/diag_mhc-static_$tag.txt" 2>&1 ;;
    mhc-options) sets=${MHC_OPTION_SETS:-"default;hc_realize_kernel_inputs=0"}
                 old_ifs=$IFS; IFS=';'; set -- $sets; IFS=$old_ifs; i=0
                 for set in "$@"; do
                     i=$((i + 1)); opts=""
                     test "$set" = default || for o in $set; do opts="$opts --hc-option $o"; done
                     echo "== option set $i: $set" >> "$out/diag_mhc-options_$tag.txt"
                     cut_at python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
                         --variants n4-hc-block --profile $opts --dump-dir "$out/mhc_opt_dump_$i" \
                         --out "$out/diag_mhc-options_$tag.jsonl" >> "$out/diag_mhc-options_$tag.txt" 2>&1
                     for code in "$out"/mhc_opt_dump_$i/*/graph_*/inductor_*_code.py; do
                         echo "-- $code: stream-sized buffers, by dtype"
                         grep -o "empty_strided_cuda((4, 2048, 4, 1024)[^)]*), torch.[a-z0-9]*)" "$code" | sort | uniq -c
                     done >> "$out/diag_mhc-options_$tag.txt" 2>&1
                 done
                 tar czf "$out/diag_mhc-options-dumps_$tag.tgz" -C "$out" $(cd "$out" && ls -d mhc_opt_dump_*) \
                     && rm -rf "$out"/mhc_opt_dump_*
                 cut_at python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 \
                     --variants n1-inductor --out "$out/diag_mhc-options_$tag.jsonl" >> "$out/diag_mhc-options_$tag.txt" 2>&1 ;;
    mhc-stream-grad-proto) cut_at python3 benchmarks/analysis/mhc_stream_grad_proto.py \
                               > "$out/diag_mhc-stream-grad-proto_$tag.txt" 2>&1 ;;
    bwd-thread-profile) cut_at python3 benchmarks/analysis/backward_thread.py --ops lightning --shape B1T32768H16D128 \
                            --steps 30 --profile > "$out/diag_bwd-thread-profile_$tag.txt" 2>&1 ;;
    mhc-dx-proto) cut_at python3 benchmarks/analysis/mhc_stream_grad_proto.py --dx-only \
                      > "$out/diag_mhc-dx-proto_$tag.txt" 2>&1 ;;
    local-du-b4) for setting in 1 0; do
                     cut_at env HCCOMPILE_DELTA_RULE_LOCAL_DU_KERNEL=$setting python3 benchmarks/profile_ops.py --ops gdn \
                         --shape B4T4096H16D128 >> "$out/diag_local-du-b4-profile_$tag.txt" 2>&1
                 done ;;
    mhc-project-proto) cut_at python3 benchmarks/analysis/mhc_project_proto.py \
                           > "$out/diag_mhc-project-proto_$tag.txt" 2>&1 ;;
    sweep-step) cut_at python3 benchmarks/analysis/sweep_step_work.py ${SWEEP_STEP_VARIANTS:+--variants $SWEEP_STEP_VARIANTS} \
                    ${SWEEP_STEP_OPS:+--ops $SWEEP_STEP_OPS} ${SWEEP_STEP_SHAPES:+--shapes $SWEEP_STEP_SHAPES} \
                    > "$out/diag_sweep-step_$tag.txt" 2>&1 ;;
    m-form) cut_at python3 benchmarks/analysis/m_form_sweep.py > "$out/diag_m-form_$tag.txt" 2>&1 ;;
    host-split) cut_at python3 benchmarks/analysis/host_split.py --ops lightning,lightning-nodecay,gdn > "$out/diag_host-split_$tag.txt" 2>&1 ;;
    host-eager) cut_at python3 benchmarks/host_overhead.py --ops floor,lightning,gdn --through-op --top 12 \
                    --jsonl "$out/host_$tag.jsonl" --commit "$commit" ;;
    lightning-quick) cut_at python3 benchmarks/lightning.py --shapes B4-T4096-H16-D128 --skip-plain --no-switches \
                         --out "$out/lightning_$tag.jsonl"
                     cut_at python3 benchmarks/profile_ops.py --ops lightning,fla-lightning --shape B1T32768H16D128 \
                         > "$out/diag_lightning-profile_$tag.txt" 2>&1 ;;
    lightning-b1) cut_at python3 benchmarks/profile_ops.py --ops lightning --shape B1T32768H16D128 \
                      > "$out/diag_lightning-b1_$tag.txt" 2>&1
                  cut_at python3 benchmarks/lightning.py --shapes B1-T32768-H16-D128,B4-T4096-H16-D128 --skip-plain \
                      --no-switches --out "$out/lightning_$tag.jsonl" ;;
    lightning-order) cut_at python3 benchmarks/lightning.py --shapes B1-T32768-H16-D128 --skip-plain --no-switches \
                         --decays none,decay --out "$out/lightning_$tag.jsonl" ;;
    lightning-caller) cut_at python3 benchmarks/lightning.py --shapes B4-T4096-H16-D128 --skip-plain --no-switches \
                          --backward-on-caller --out "$out/diag_lightning-caller_$tag.jsonl" ;;
    lightning-profile) cut_at python3 benchmarks/profile_ops.py --ops lightning --shape B4T4096H16D128 \
                           > "$out/diag_lightning-profile_$tag.txt" 2>&1
                       cut_at python3 benchmarks/profile_ops.py --ops lightning --shape B4T4096H16D128 --fwd-only \
                           >> "$out/diag_lightning-profile_$tag.txt" 2>&1 ;;
    lightning-stages) cut_at python3 benchmarks/lightning_tune.py --around-defaults --defaults-only \
                          --stage-budgets 98304,131072 --saved-states --out "$out/diag_lightning-tune_$tag.jsonl" ;;
    lightning) cut_at python3 benchmarks/lightning.py ${LIGHTNING_SHAPES:+--shapes $LIGHTNING_SHAPES} ${LIGHTNING_ARGS:-} \
                   --out "$out/lightning_$tag.jsonl" ;;
    lightning-tune) cut_at python3 benchmarks/lightning_tune.py --around-defaults --out "$out/diag_lightning-tune_$tag.jsonl" ;;
    delta-tune) cut_at python3 benchmarks/tune_delta_rule.py --ops gdn --modes default --shape B4T4096H16D128 \
                    --kernels L2NORM_BLOCK_ROWS,L2NORM_WARPS,_dqkw_kernel,DQKW_BLOCK_K,_wy_bwd_kernel \
                    --out "$out/diag_delta-tune_$tag.jsonl" ;;
    delta-profile) for shape in B4T4096H16D128 B1T32768H16D128; do
                       cut_at python3 benchmarks/profile_ops.py --ops gdn,kda --shape "$shape" \
                           >> "$out/diag_delta-profile_$tag.txt" 2>&1
                   done ;;
    kda-tune) cut_at python3 benchmarks/tune_delta_rule.py --ops kda --modes default --shape B4T4096H16D128 \
                  --kernels _wy_backward_kernel,_decayed_scores_backward_kernel,_decayed_scores_kernel,_state_backward_kernel,_state_forward_kernel,_wy_solve_kernel,_output_kernel,SWEEP_MIN_PROGRAMS \
                  --out "$out/diag_kda-tune_$tag.jsonl"
              cut_at python3 benchmarks/tune_delta_rule.py --ops kda --modes default --shape B1T32768H16D128 \
                  --kernels SWEEP_MIN_PROGRAMS,_state_backward_kernel,_state_forward_kernel,_decayed_scores_backward_kernel \
                  --out "$out/diag_kda-tune_$tag.jsonl" ;;
    gdn-tune) cut_at python3 benchmarks/tune_delta_rule.py --ops gdn --modes default --shape "${GDN_TUNE_SHAPE:-B1T32768H16D128}" \
                  --kernels "${GDN_TUNE_KERNELS:-DQKW_KEY_TILES_FASTEST,_wy_solve_kernel,_output_kernel,_state_forward_kernel,_state_backward_kernel,_wy_bwd_kernel,_dqkw_kernel}" \
                  --out "$out/diag_gdn-tune_$tag.jsonl" ;;
    bwd-thread) for shape in B4T4096H16D128 B1T32768H16D128; do
                    cut_at python3 benchmarks/analysis/backward_thread.py --ops lightning,gdn --shape "$shape" \
                        >> "$out/diag_bwd-thread_$tag.txt" 2>&1
                done ;;
    local-du) for shape in B1T32768H16D128 B4T4096H16D128; do
                  cut_at python3 benchmarks/tune_delta_rule.py --ops gdn --modes default --shape "$shape" \
                      --kernels LOCAL_DU_KERNEL --out "$out/diag_local-du_$tag.jsonl"
              done
              cut_at env HCCOMPILE_DELTA_RULE_LOCAL_DU_KERNEL=1 python3 benchmarks/tune_delta_rule.py --ops gdn \
                  --modes default --shape B1T32768H16D128 --kernels LOCAL_DU_WARPS --out "$out/diag_local-du_$tag.jsonl"
              cut_at env HCCOMPILE_DELTA_RULE_LOCAL_DU_KERNEL=1 python3 benchmarks/profile_ops.py --ops gdn \
                  --shape B1T32768H16D128 >> "$out/diag_local-du-profile_$tag.txt" 2>&1 ;;
    kda-solve) for shape in B4T4096H16D128 B1T32768H16D128; do
                   cut_at python3 benchmarks/tune_delta_rule.py --ops kda --modes default --shape "$shape" \
                       --kernels CHUNK_SCORE_PROGRAMS,REGISTER_DIAGONAL_BLOCKS,OUTPUT_BLOCK_V,_wy_solve_kernel --out "$out/diag_kda-solve_$tag.jsonl"
               done ;;
    mhc-dx-form) test -f .before/COMMIT || { echo "mhc-dx-form: no .before tree (make before-tree REF=<commit>; carry .before)"; continue; }
                 log="$out/diag_mhc-dx-form_$tag.txt"
                 echo "== this tree ($commit)" >> "$log"
                 cut_at python3 benchmarks/analysis/mhc_stream_grad_buffers.py >> "$log" 2>&1
                 echo "== .before ($(cat .before/COMMIT))" >> "$log"
                 cut_at env PYTHONPATH=.before${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/analysis/mhc_stream_grad_buffers.py >> "$log" 2>&1
                 cut_at python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mhc_kernels.py -k half_gradient >> "$log" 2>&1
                 for round in 1 2; do
                     cut_at python3 benchmarks/before_after.py --family mhc --out "$out/diag_mhc-before_$tag.jsonl" \
                         -- --layers 4 --dim 1024 --heads 16 --batch 4 --seq 2048 --variants n4-hc-block >> "$log" 2>&1
                 done ;;
    delta-segments) cut_at python3 benchmarks/analysis/delta_segment_parallel_proto.py \
                        > "$out/diag_delta-segments_$tag.txt" 2>&1 ;;
    step-timeline) cut_at python3 benchmarks/analysis/step_timeline.py --ops lightning,lightning-nodecay,fla-lightning \
                       --shape B1T32768H16D128 > "$out/diag_step-timeline_$tag.txt" 2>&1 ;;
    lightning-segments) cut_at python3 benchmarks/analysis/lightning_segments_tune.py \
                            > "$out/diag_lightning-segments_$tag.txt" 2>&1 ;;
    l2norm-bw) cut_at python3 benchmarks/analysis/l2norm_bandwidth.py > "$out/diag_l2norm-bw_$tag.txt" 2>&1 ;;
    narrow-tile) cut_at python3 benchmarks/analysis/narrow_backward_tile.py ${NARROW_VARIANTS:+--variants $NARROW_VARIANTS} \
                     > "$out/diag_narrow-tile_$tag.txt" 2>&1 ;;
    kda-prepared) for shape in B4T4096H16D128 B1T32768H16D128; do
                      cut_at python3 benchmarks/tune_delta_rule.py --ops kda --modes default --shape "$shape" \
                          --kernels PREPARED_CHANNEL_SWEEP --out "$out/diag_kda-prepared_$tag.jsonl"
                  done
                  cut_at env HCCOMPILE_DELTA_RULE_PREPARED_CHANNEL_SWEEP=1 python3 benchmarks/tune_delta_rule.py --ops kda \
                      --modes default --shape B1T32768H16D128 --kernels _state_backward_kernel \
                      --out "$out/diag_kda-prepared-options_$tag.jsonl" ;;
    kda-gate-tune) for shape in ${KDA_GATE_SHAPES:-B1T32768H16D128 B4T4096H16D128}; do
                       cut_at python3 benchmarks/tune_delta_rule.py --ops kda-gate --modes default --shape "$shape" \
                           --kernels "${KDA_GATE_KERNELS:-GATE_BACKWARD_BLOCK_K,GATE_BACKWARD_WARPS,FACTOR_SPAN_LIMIT}" \
                           --out "$out/diag_kda-gate-tune_$tag.jsonl"
                   done ;;
    gate-bwd) cut_at python3 benchmarks/analysis/gate_backward_variants.py > "$out/diag_gate-bwd_$tag.txt" 2>&1 ;;
    split-cost) cut_at python3 benchmarks/analysis/split_cost.py > "$out/diag_split-cost_$tag.txt" 2>&1 ;;
    split-apart) cut_at python3 benchmarks/analysis/split_apart_proto.py --shapes "${SPLIT_SHAPES:-B1T32768H16D128}" \
                     --ops "${SPLIT_OPS:-kda-gate,kda}" > "$out/diag_split-apart_$tag.txt" 2>&1 ;;
    kda-gate-profile) cut_at python3 benchmarks/profile_ops.py --ops kda,kda-gate,fla-kda-gate --shape B1T32768H16D128 \
                          > "$out/diag_kda-gate-profile_$tag.txt" 2>&1 ;;
    sweep-overlap) cut_at python3 benchmarks/analysis/sweep_overlap.py > "$out/diag_sweep-overlap_$tag.txt" 2>&1 ;;
    accuracy) cut_at python3 benchmarks/delta_rule_accuracy.py --impls "${ACCURACY_IMPLS:-ours,fp32-keys,fp32,fla}" --ops "${ACCURACY_OPS:-gdn,kda}" \
                  --out "$out/accuracy_$tag.jsonl" > "$out/diag_accuracy_$tag.txt" 2>&1 ;;
    sync-check) cut_at python3 benchmarks/analysis/sync_check.py > "$out/diag_sync-check_$tag.txt" 2>&1 ;;
    mhc-dump-pair) test -f .before/COMMIT || { echo "mhc-dump-pair: no .before tree (make before-tree REF=<commit>; carry .before)"; continue; }
                   log="$out/diag_mhc-dump-pair_$tag.txt"
                   for tree in this before; do
                       path=; test $tree = before && path=.before
                       cut_at env PYTHONPATH=$path${path:+:}${PYTHONPATH:-} python3 benchmarks/mhc.py --layers 4 --dim 1024 --heads 16 \
                           --batch 4 --seq 2048 --variants n4-hc-block --dump-dir "$out/mhc_dump_$tree" \
                           --out "$out/diag_mhc-dump-pair_$tag.jsonl" >> "$log" 2>&1
                       for code in "$out"/mhc_dump_$tree/*/graph_*/inductor_backward_code.py; do
                           echo "== $tree ($(test $tree = before && cat .before/COMMIT || echo "$commit")): $code" >> "$log"
                           for buf in $(grep -o "buf[0-9]* = empty_strided_cuda((4, 2048, 4, 1024), ([^)]*), torch.float32)" "$code" | cut -d' ' -f1); do
                               grep -n "\b$buf\b" "$code" | cut -c1-260 >> "$log"
                           done
                       done
                   done
                   tar czf "$out/diag_mhc-dump-pair_$tag.tgz" -C "$out" mhc_dump_this mhc_dump_before && rm -rf "$out"/mhc_dump_this "$out"/mhc_dump_before ;;
    kernel-profile) cut_at python3 benchmarks/profile_ops.py --ops lightning,fla-lightning,gdn,fla-gdn,kda,fla-kda \
                        --shape B4T4096H16D128 > "$out/diag_kernel-profile_$tag.txt" 2>&1 ;;
    htree) cut_at python3 benchmarks/htree.py --seq 32768,131072 --impls htree,htree-atomics,sdpa --rep 100 \
               --out "$out/htree_$tag.jsonl"
           cut_at python3 benchmarks/htree.py --config seed --seq 131072 --impls htree,sdpa --rep 50 \
               --out "$out/htree_$tag.jsonl" ;;
    htree-profile) cut_at python3 benchmarks/profile_ops.py --ops htree,htree-atomics,sdpa --shape B1T32768H32D128 \
                       --kv-heads 4 > "$out/diag_htree-profile_$tag.txt" 2>&1 ;;
    htree-tune)
        # BLOCK_C, warps, programs per SM of the walks (forward, dq); the node-gradient programs' warps
        # and rows. A walk is latency-bound: what pays is walks in flight (tiles.py).
        for setting in "64 4 4 8 64" "64 4 8 8 64" "128 4 4 8 64" "64 4 2 8 64" "64 8 2 8 64" "32 4 8 8 64" \
                       "64 4 4 4 64" "64 4 4 8 128"; do
            set -- $setting
            cut_at python3 benchmarks/htree.py --seq 32768 --impls htree --rep 50 --block-c "$1" \
                --num-warps "$2" --programs-per-sm "$3" --node-warps "$4" --node-rows "$5" \
                --out "$out/diag_htree-tune_$tag.jsonl"
        done
        # The public regime at 128K (an 8192-wide top layer), forward only (the backward reads its
        # selections): 32 / 8 / 2 (the defaults until 779e58a) against 4 warps.
        for setting in "32 8 2" "32 4 4" "64 4 4"; do
            set -- $setting
            cut_at python3 benchmarks/htree.py --config seed --seq 131072 --modes fwd --impls htree --rep 30 --block-c "$1" \
                --num-warps "$2" --programs-per-sm "$3" --out "$out/diag_htree-tune_$tag.jsonl"
        done
        cut_at python3 benchmarks/htree.py --seq 32768 --impls sdpa --rep 50 \
            --out "$out/diag_htree-tune_$tag.jsonl" ;;
    *) echo "unknown run $run"; exit 2 ;;
    esac
done
save_autotune
