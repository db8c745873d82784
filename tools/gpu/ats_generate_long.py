"""Experiment (ATS generation, long outputs): the transformer head with its own KV cache against the head on every
position at each step, and the base alone. SmolLM2-135M-Instruct, fp32, CPU, two left-padded prompts, 256 greedy
tokens, one call each.

    python tools/gpu/ats_generate_long.py
"""
import time, torch
from hf_lsce.checkpoints import load_model_and_tokenizer
from hf_lsce import ATSCalibrator
model, tok = load_model_and_tokenizer("smollm2-135m-instruct")
tok.padding_side = "left"
model = model.float().eval()
cal = ATSCalibrator.from_base(model, head_type="transformer")
torch.manual_seed(1)
with torch.no_grad():
    for p in cal.head.parameters(): p.normal_(0, 0.02)
ids = tok(["The capital of France is", "Calibration of language models means"], return_tensors="pt", padding=True)
kw = dict(max_new_tokens=256, min_new_tokens=256, do_sample=False, pad_token_id=tok.pad_token_id or 0)
t0 = time.perf_counter(); a = cal.generate(ids.input_ids, attention_mask=ids.attention_mask, **kw); t1 = time.perf_counter()
cal.head.cache_argument = lambda: None
b = cal.generate(ids.input_ids, attention_mask=ids.attention_mask, **kw); t2 = time.perf_counter()
c = model.generate(ids.input_ids, attention_mask=ids.attention_mask, **kw); t3 = time.perf_counter()
print(f"256 tokens: head with its KV cache {t1-t0:.2f}s, head on every position {t2-t1:.2f}s, base alone {t3-t2:.2f}s; same tokens {torch.equal(a, b)} {torch.equal(a, c)}")
