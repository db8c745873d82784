"""Question: what does the statistics' move to the fused kernel (234ea53) give an evaluation loop end to end? A
patched model's no-grad forward with labels (what the Trainer's prediction step runs, with ``fused_eval_loss=True``), plain and with TRL's token
statistics (``return_stats``: entropy and accuracy), at the Gemma-3-270m and Llama-3.2-1B configurations (random
weights, bf16, 8 x 1,024 tokens); the package given by PYTHONPATH (run once with the package before, once after);
the stock model's own loss beside. Median of 10 timed calls after 3, ms. Writes $OUT/eval_e2e_TAG.json.

    PYTHONPATH=<package root> python tools/gpu/eval_e2e.py TAG
"""
import json
import os
import statistics
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

CONFIGS = {  # as benchmarks/bench_trainer.py's
    "gemma3-270m-config": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                               num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                               sliding_window=512, query_pre_attn_scalar=256, rope_theta=1000000.0,
                               tie_word_embeddings=True, max_position_embeddings=32768),
    "llama3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=8192),
}


def timed(fn, reps=10, warm=3):
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t))
    return statistics.median(out)


@torch.no_grad()
def main():
    tag = sys.argv[1]
    import hf_lsce
    from hf_lsce import apply_lsce_patch

    print(tag, os.path.dirname(hf_lsce.__file__), flush=True)
    rows = []
    for name, spec in CONFIGS.items():
        spec = dict(spec)
        cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        ids = torch.randint(0, cfg.vocab_size, (8, 1024), device="cuda")
        stock = timed(lambda: model(input_ids=ids, labels=ids).loss)
        apply_lsce_patch(model, label_smoothing=0.1, fused_eval_loss=True)
        plain = timed(lambda: model(input_ids=ids, labels=ids).loss)
        model.__dict__["_lsce_token_stats"] = "logits"  # as TRL's compute_loss sets it (patching/trainer.py)
        stats = timed(lambda: model(input_ids=ids, labels=ids).loss)
        model.__dict__.pop("_lsce_token_stats")
        rows.append(dict(model=name, tag=tag, stock_ms=stock, patched_ms=plain, patched_token_stats_ms=stats))
        print(rows[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), f"eval_e2e_{tag}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
