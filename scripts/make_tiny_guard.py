"""Generate the deterministic tiny guard model: a sequence classifier over OpenAI's 13
moderation categories, for the local engines to serve on vLLM's ``/classify`` endpoint.

No guard model can be downloaded here, and one with random weights would fire at random, so
its weights are set by hand: chosen trigger words fire chosen categories, everything else
scores near zero — a real model on a real engine that tests can reason about.

How (a ``LlamaForSequenceClassification`` of the tiny chat model's shape, its tokenizer):
- Embeddings: channel 0 is 8 for every token; a trigger token also has channel 1 ("a
  trigger") and channel 2 + k (its category k) at 1.
- Layer 0, attention head 0: its query reads channel 0 and its key channel 1, in the
  rotary pair that turns slowest (so position barely matters), so every position attends to
  the trigger tokens before it when there are any; its value copies the category channels,
  and its output writes them to channels 40 + k. Everything else is zero (the MLPs, layer 1,
  head 1): the residual stream carries the result to the last token, which the classifier
  reads (vLLM pools the last token).
- The score row of category k reads 20 x channel 40 + k, less half of channel 0: about +33
  when a trigger of k is in the text (+7 with three categories' triggers at once), about -5.6
  when none is; sigmoid gives ~1.0 and ~0.004.

Triggers (a word after a space — the tokenizer's single tokens " fox", " quick", ...):
see ``TRIGGERS``. "a fox" scores violence ~1.0; "a dog" ~0.0.

Runs inside the engine virtualenv.  Usage: python make_tiny_guard.py OUTPUT_DIR CHAT_MODEL_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

VERSION = "tiny-guard-v1"  # bump when the recipe changes; make uses it as a cache key

CATEGORIES = [
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/intent",
    "self-harm/instructions",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
]

# word (as the tokenizer's single token with a leading space) -> the category it fires
TRIGGERS = {
    "fox": "violence",
    "quick": "harassment",
    "brown": "hate",
    "counter": "self-harm",
    "tokens": "illicit",
}

MARK = 1  # channel: "this token is a trigger"
FIRST_CATEGORY = 2  # channels 2..14: the token's category
READOUT = 40  # channels 40..52: the category carried to the last token
# Channel 0's size: it dominates every token's RMS, so the final norm leaves it (~11) and
# what the attention carried (~2 for one trigger) at sizes that do not depend on each other.
BASE = 8.0
SLOW = 31  # the rotary pair (31, 63) of head_dim 64 turns slowest: ~1e-4 rad per position


def main(out: Path, chat: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(chat)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (chat / name).exists():
            shutil.copy(chat / name, out / name)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        num_labels=len(CATEGORIES),
        id2label=dict(enumerate(CATEGORIES)),
        label2id={c: i for i, c in enumerate(CATEGORIES)},
        problem_type="multi_label_classification",
    )
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for name, parameter in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                parameter.fill_(1.0)
        embed = model.model.embed_tokens.weight
        embed[:, 0] = BASE
        for word, category in TRIGGERS.items():
            ids = tokenizer.encode(" " + word, add_special_tokens=False)
            if len(ids) != 1:
                raise SystemExit(f"trigger {word!r} is not one token: {ids}")
            embed[ids[0], MARK] = 1.0
            embed[ids[0], FIRST_CATEGORY + CATEGORIES.index(category)] = 1.0
        attention = model.model.layers[0].self_attn
        attention.q_proj.weight[SLOW, 0] = 4.0  # head 0, query: "every token asks"
        attention.k_proj.weight[SLOW, MARK] = 4.0  # head 0, key: "a trigger answers"
        for k in range(len(CATEGORIES)):
            attention.v_proj.weight[k, FIRST_CATEGORY + k] = 1.0
            attention.o_proj.weight[READOUT + k, k] = 1.0
            model.score.weight[k, READOUT + k] = 20.0
            model.score.weight[k, 0] = -0.5
    model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "inferplane.json").write_text(
        json.dumps({"version": VERSION, "triggers": TRIGGERS}) + "\n"
    )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: make_tiny_guard.py OUTPUT_DIR CHAT_MODEL_DIR")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
