"""Generate the deterministic tiny chat model the local engines serve.

No model can be downloaded on these machines, so Inferplane makes its own: a 2-layer
Llama with random (seeded) weights and a byte-level BPE tokenizer trained on a few
lines of text. Every machine produces the same files, so token counts and greedy
outputs are reproducible across runs and in CI.

Runs inside the engine virtualenv (it needs torch and transformers); the web app
never imports it.  Usage: python make_tiny_model.py OUTPUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEED = 1234
VERSION = "tiny-chat-v1"  # bump when the recipe changes; make uses it as a cache key

CORPUS = [
    "Inferplane serves many tenants on their own GPUs and bills them for it.",
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How can I help you today? Tell me about your question.",
    "Fair queuing shares the pool between tenants by tokens, not by requests.",
    "A virtual token counter tracks the weighted service each tenant received.",
    "Streams end with a usage chunk that counts prompt and completion tokens.",
    "system user assistant: you are a helpful assistant. Answer briefly.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def main(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    out.mkdir(parents=True, exist_ok=True)

    special = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=special[4:],
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "inferplane.json").write_text(json.dumps({"version": VERSION, "seed": SEED}) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_tiny_model.py OUTPUT_DIR")
    main(Path(sys.argv[1]))
