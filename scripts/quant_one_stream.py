"""One stream on a checkpoint: a 144-token prompt, 80 tokens out, greedy; JSON out (docs/benchmarks.md).

    python scripts/quant_one_stream.py MODEL_FOLDER none|int8|fp8
"""

import json
import sys
import time

from jaxserve import LLM, SamplingParams


def main() -> None:
    path, q = sys.argv[1], (None if sys.argv[2] == "none" else sys.argv[2])
    llm = LLM(path, quantization=q, max_num_seqs=1, max_model_len=512, show_progress=False)
    prompt = [(i * 37) % 4000 + 100 for i in range(144)]
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)  # warm
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        llm.generate([prompt], params)
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"quantization": q, "seconds": seconds, "tok_per_s_best": 80 / min(seconds),
                      "weight_bytes": llm.stats()["weight_bytes"]}))


if __name__ == "__main__":
    main()
