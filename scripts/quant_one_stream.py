"""One stream on a checkpoint: 144-token prompt, 80 tokens out, tok/s of the decode; JSON out."""
import json, sys, time
from jaxserve import LLM, SamplingParams
path, q = sys.argv[1], (None if sys.argv[2] == "none" else sys.argv[2])
llm = LLM(path, quantization=q, max_num_seqs=1, max_model_len=512, show_progress=False)
prompt = [(i * 37) % 4000 + 100 for i in range(144)]
sp = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
llm.generate([prompt], sp)  # warm
ts = []
for _ in range(3):
    t = time.perf_counter(); out = llm.generate([prompt], sp); ts.append(time.perf_counter() - t)
st = llm.stats()
print(json.dumps({"quantization": q, "seconds": ts, "tok_per_s_best": 80 / min(ts),
                  "weight_bytes": st["weight_bytes"]}))
