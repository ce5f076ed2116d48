#!/usr/bin/env bash
# Model-specific constants of the vLLM tests -> this model's (vocab 2048,
# context 256, our tokenizer).  Applied only by `ADJUST=1 run.sh`, in the work tree.
set -euo pipefail
T=tests/entrypoints/openai
sed -i 's/prompt_tokens == 6$/prompt_tokens == 9/; s/total_tokens == 11$/total_tokens == 14/; s/5000/1500/g' $T/completion/test_completion.py
sed -i 's/5000/1500/g' $T/chat_completion/test_logprob_token_ids.py
sed -i 's/prompt_tokens=37, total_tokens=42/prompt_tokens=31, total_tokens=36/' $T/chat_completion/test_chat.py
sed -i 's/== 8192/== 256/' tests/entrypoints/serve/tokenize/test_tokenization.py
