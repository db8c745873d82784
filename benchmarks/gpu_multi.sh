#!/usr/bin/env bash
# One device call on 2 GPUs (issue 8): the vocabulary-parallel op over NCCL with the compiled Triton kernels,
# and one Trainer step (label_smoothing_factor 0.1, gradient accumulation, tied embeddings) through the patch:
# 1 GPU unpatched (HF's LabelSmoother) vs 1 GPU patched vs DDP on 2 GPUs vs FSDP2 on 2 GPUs.
#   bash benchmarks/gpu_multi.sh        (results under $OUT or ./gpu_out: multi_gpu.json)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# each run's log goes to $OUT/NAME.log; its errors (if any) are shown
show() { grep -E "Error|error:|Traceback" "$OUT/$1.log" | grep -v Warning | sort -u | head -8; }
run2() { n=$1; shift; python3 -m torch.distributed.run --standalone --nproc_per_node 2 "$@" > "$OUT/$n.log" 2>&1; echo "$n: rc $?"; show "$n"; }
run1() { n=$1; shift; CUDA_VISIBLE_DEVICES=0 python3 "$@" > "$OUT/$n.log" 2>&1; echo "$n: rc $?"; show "$n"; }  # one GPU: no DataParallel
run2 vp_triton tests/scripts/vocab_parallel.py "$OUT/vp_triton" triton cuda
run2 vp_torch tests/scripts/vocab_parallel.py "$OUT/vp_torch" torch cuda
run1 hf tests/scripts/ddp_train.py "$OUT/hf" 0 4 2 cuda
run1 patched tests/scripts/ddp_train.py "$OUT/patched" 1 4 2 cuda
run2 ddp tests/scripts/ddp_train.py "$OUT/ddp" 1 2 2 cuda
run2 fsdp2 tests/scripts/ddp_train.py "$OUT/fsdp2" 1 2 2 fsdp2
python3 - "$OUT" <<'PY'
import json, os, sys, torch
out = sys.argv[1]; res = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}
for k in ("vp_triton", "vp_torch"):
    rows = [r for rank in (0, 1) if os.path.exists(f"{out}/{k}.{rank}") for r in json.load(open(f"{out}/{k}.{rank}"))]
    res[k] = {"cases": len(rows), "max_rel_err": max((max(r["loss"], r["dh"], r["dw"], r["db"]) for r in rows), default=None)}
ref = torch.load(f"{out}/hf/state.pt"); ref_loss = torch.load(f"{out}/hf/log.pt")[0]["loss"]
for k in ("patched", "ddp", "fsdp2"):
    if not os.path.exists(f"{out}/{k}/state.pt"):
        res[k] = "failed (see the log above)"; continue
    s = torch.load(f"{out}/{k}/state.pt")
    res[k] = {"max_rel_weight_diff": max(float((s[n].float() - ref[n].float()).norm() / ref[n].float().norm()) for n in ref),
              "loss": torch.load(f"{out}/{k}/log.pt")[0]["loss"], "hf_loss": ref_loss}
print(json.dumps(res, indent=1)); json.dump(res, open(f"{out}/multi_gpu.json", "w"), indent=1)
PY
