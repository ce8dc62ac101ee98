#!/usr/bin/env bash
# Real third-party clients against `jaxserve serve` on 127.0.0.1, unchanged:
#   guidellm  - `guidellm run` with the OpenAI HTTP backend, streaming, a constant request rate,
#               once on /v1/completions and once on /v1/chat/completions; it must report 0 errors;
#   lm-eval   - `lm_eval --model local-completions` given only base_url and model: it finds the
#               tokenizer through the server (/tokenizer_info, /tokenize), scores a small
#               multiple-choice task by loglikelihood (echo + logprobs) and runs a generate_until task.
# The clients go into their own virtual environment (CLIENT_VENV, default .venv-clients; built on
# first use, a few minutes) so their dependencies never touch .venv. The tasks' data is written
# here, so nothing is fetched from a hub. Not part of `make test`: run it by hand.
#   bash scripts/client_compat.sh            # SECONDS_PER_RUN=30 RATE=2 PORT=8123 by default
set -euo pipefail
cd "$(dirname "$0")/.."

CLIENT_VENV=${CLIENT_VENV:-.venv-clients}
PORT=${PORT:-8123}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-30}
RATE=${RATE:-2}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/jaxserve-clients.XXXXXX")
SERVER_PID=""

cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
}
trap cleanup EXIT

if [ ! -x "$CLIENT_VENV/bin/guidellm" ] || [ ! -x "$CLIENT_VENV/bin/lm_eval" ]; then
  echo "== installing guidellm and lm-eval into $CLIENT_VENV"
  python3 -m venv "$CLIENT_VENV"
  "$CLIENT_VENV/bin/pip" install --quiet --upgrade pip
  # torch is a guidellm requirement; the pin matches the test extras', whose CPU wheel is cached here
  "$CLIENT_VENV/bin/pip" install --quiet "torch==2.13.0" "guidellm==0.8.1" "lm-eval[api]==0.4.13"
fi
make setup >/dev/null

DEMO=$(.venv/bin/python -c "from jaxserve.models.demo import demo_model_path; print(demo_model_path())")
URL="http://127.0.0.1:$PORT"
echo "== jaxserve serve (demo model) at $URL; logs in $WORK/server.log"
.venv/bin/jaxserve serve --host 127.0.0.1 --port "$PORT" --enable-tokenizer-info-endpoint \
  --max-model-len 256 --max-num-seqs 32 --max-num-batched-tokens 128 --num-gpu-blocks-override 512 \
  --uvicorn-log-level warning >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 300); do
  curl -sf "$URL/health" >/dev/null 2>&1 && break
  kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$WORK/server.log"; exit 1; }
  sleep 1
done
MODEL=$(curl -sf "$URL/v1/models" | python3 -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

guidellm_run() {  # $1: request format (an endpoint path), $2: output name
  "$CLIENT_VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=$URL,model=$MODEL,request_format=$1" \
    --profile "kind=constant,rate=$RATE" \
    --constraint "kind=max_duration,seconds=$SECONDS_PER_RUN" \
    --data "kind=synthetic_text,prompt_tokens=64,output_tokens=32" \
    --tokenizer "kind=hf_auto,model=$DEMO" \
    --output "kind=json,path=$WORK/$2.json" --disable-console-interactive >"$WORK/$2.log" 2>&1
  "$CLIENT_VENV/bin/python" - "$WORK/$2.json" "$1" <<'EOF'
import json, sys
bench = json.load(open(sys.argv[1]))["benchmarks"][0]
counts = {kind: len(bench["requests"][kind]) for kind in ("successful", "errored", "incomplete")}
tokens = [r["output_metrics"]["total_tokens"] for r in bench["requests"]["successful"]]
ttft = bench["metrics"]["time_to_first_token_ms"]["successful"]["median"]
print(f"guidellm {sys.argv[2]}: {counts['successful']} successful, {counts['errored']} errored, "
      f"{counts['incomplete']} incomplete (cut by the time limit); output tokens per request "
      f"{min(tokens)}-{max(tokens)}; median TTFT {ttft:.1f} ms")
sys.exit(1 if counts["errored"] or not counts["successful"] else 0)
EOF
}
echo "== guidellm: constant $RATE requests/s for ${SECONDS_PER_RUN}s, streaming"
guidellm_run /v1/completions guidellm-completions
guidellm_run /v1/chat/completions guidellm-chat

echo "== lm-eval local-completions (base_url and model only)"
mkdir -p "$WORK/tasks"
"$CLIENT_VENV/bin/python" - "$WORK/tasks" <<'EOF'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
colours = ["red", "green", "blue", "yellow"]
mc = [{"question": f"The sky on a clear day is {c}. Question: what colour is the sky? Answer:",
       "choices": [f" {x}" for x in colours], "answer": colours.index(c)} for c in colours]
gen = [{"question": f"Count: {' '.join(map(str, range(n, n + 3)))}", "answer": f" {n + 3}"} for n in range(1, 9)]
for name, rows in (("mc", mc), ("gen", gen)):
    (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
common = f"dataset_path: json\ntest_split: test\n"
(root / "jaxserve_mc.yaml").write_text(
    f"task: jaxserve_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
    "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
    "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
(root / "jaxserve_gen.yaml").write_text(
    f"task: jaxserve_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
    "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
    "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\nmetric_list:\n  - metric: exact_match\n")
EOF
"$CLIENT_VENV/bin/lm_eval" --model local-completions \
  --model_args "base_url=$URL/v1/completions,model=$MODEL" \
  --tasks jaxserve_mc,jaxserve_gen --include_path "$WORK/tasks" \
  --output_path "$WORK/lm-eval" --log_samples >"$WORK/lm-eval.log" 2>&1 || { tail -30 "$WORK/lm-eval.log"; exit 1; }
grep -q "Using remote tokenizer" "$WORK/lm-eval.log" || { echo "lm-eval did not use the server's tokenizer"; exit 1; }
grep -E "^\|" "$WORK/lm-eval.log"
echo "lm-eval: tokenizer through the server (remote backend); samples in $WORK/lm-eval"
echo "== all clients ran without errors; outputs in $WORK"
