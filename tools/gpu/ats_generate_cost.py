"""Experiment (ATS generation): what does calibrated generation cost with ATSCalibrator.generate (the base's KV cache
kept) against the recomputing processor and the base alone? SmolLM2-135M-Instruct (the installed checkpoint), fp32
on the CPU, two left-padded prompts, 48 greedy tokens, a random head of each kind; wall seconds of one call each.

    python tools/gpu/ats_generate_cost.py
"""
import time, torch
from hf_lsce.checkpoints import load_model_and_tokenizer
from hf_lsce import ATSCalibrator
model, tok = load_model_and_tokenizer("smollm2-135m-instruct")
tok.padding_side = "left"
model = model.float().eval()
for ht in ("transformer", "mlp"):
    cal = ATSCalibrator.from_base(model, head_type=ht)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in cal.head.parameters(): p.normal_(0, 0.02)
    ids = tok(["The capital of France is", "Calibration of language models means"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    t0 = time.perf_counter(); a = cal.generate(ids.input_ids, attention_mask=ids.attention_mask, **kw); t1 = time.perf_counter()
    b = model.generate(ids.input_ids, attention_mask=ids.attention_mask, logits_processor=[cal.logits_processor(ids.attention_mask)], **kw); t2 = time.perf_counter()
    c = model.generate(ids.input_ids, attention_mask=ids.attention_mask, **kw); t3 = time.perf_counter()
    print(ht, f"cal.generate {t1-t0:.2f}s, recomputing processor {t2-t1:.2f}s, base alone {t3-t2:.2f}s, same tokens: {torch.equal(a, b)} {torch.equal(a, c)}", flush=True)
