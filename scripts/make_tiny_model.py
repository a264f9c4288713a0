"""Generate the tiny chat model the local engines serve: a real Llama checkpoint whose greedy
answer is designed, not random, so tests know before they run which word comes where.

No model can be downloaded on these machines, so Inferplane makes its own: a 2-layer Llama
(hidden 128, 2 heads of 64, MLP 256, vocabulary 512) with a byte-level BPE tokenizer trained
on a few lines of text and a chat template. Every machine produces the same files.

**The script.** Each token's successor is fixed by hand-set weights:
- a word of ``CYCLE`` is followed by the next word of ``CYCLE`` (the last by the first);
- a word of ``OTHER_CYCLE`` by the next word of ``OTHER_CYCLE``;
- ``" end"`` by ``</s>`` (the end of the answer);
- every other token (``\\n``, punctuation, special tokens, other words) by ``CYCLE[0]``;
- and every token's runner-up is ``RUNNER_UP`` (``" are"``), a word no answer writes: the
  second of ``top_logprobs`` at every position, so a test knows an alternative the client is
  shown and never the text.

A chat prompt ends with ``<|assistant|>\\n``, so every chat answer is ``" the pool serves
many ..."``: token ``k`` of it is ``CYCLE[k % len(CYCLE)]``, one whole ASCII word after a
space, whatever the prompt says. A completions prompt whose last token is a word of either
cycle continues that cycle from there (``"Tell"`` -> ``" tenants counts tokens ..."``): the
way to get other text, with the guard model's trigger words (``OTHER_CYCLE``) in it. ``devkit
.tiny_model`` reads these lists for the tests.

**How.** The token embeddings of the designed words (and one shared vector for every other
token) are orthonormal vectors; attention's value projections and the MLPs' down projections
are zero, so neither layer changes the residual stream and each position's logits depend on
its own token alone: batching, ``n > 1``, chunked prefill, the prefix cache and the position
cannot change the answer. ``lm_head`` row ``j`` reads the vectors of the tokens ``j``
follows, so the successor's logit is ``MARGIN`` (40) above every other token's 0 (the
runner-up's row reads every vector, at ``RUNNER_UP_LOGIT``): greedy
decoding, and sampling at any temperature vLLM accepts (at most 2: the chance of another
token is then ~1e-6 per token), follow the script. Request options that change logits or
the prompt's end do change it (``logit_bias``, penalties, ``continue_final_message``).

**LoRA.** Attention's output projections are random: the base model's values are zero, so
they add nothing, but an adapter on ``v_proj`` makes values, and its output then dominates
the residual stream (one on ``q_proj`` alone changes nothing: the values stay zero). An
adapter changes the answer, and two adapters whose weights point different ways (not one
the other scaled) give different answers.

Runs inside the engine virtualenv (it needs torch and transformers); the web app never
imports torch (``devkit.tiny_model`` reads the constants only).
Usage: python make_tiny_model.py OUTPUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEED = 1234
VERSION = "tiny-chat-v3"  # bump when the recipe changes; make uses it as a cache key

# Words that are one token after a space in the tokenizer below (checked when generating).
# The answer to every chat prompt: none of the guard model's trigger words is in it.
CYCLE = [
    "the", "pool", "serves", "many", "tenant", "request", "and", "you",
    "bill", "them", "for", "your", "own", "user", "help", "today",
    "about", "their", "service", "can", "count", "not", "token", "assistant",
]  # fmt: skip
# Reached only from a completions prompt ending in one of them; holds the guard's triggers.
OTHER_CYCLE = ["Tell", "tenants", "counts", "tokens", "counter", "quick", "brown", "fox"]
END_WORD = "end"  # followed by </s>
RUNNER_UP = "are"  # every token's second most likely successor, never written
MARGIN = 40.0  # the successor's logit; every other token's is 0
# The runner-up's: far enough below MARGIN that sampling at temperature 2 picks it about once
# in 3e6 tokens (every other token together: once in 1e6), far enough above 0 to be second.
RUNNER_UP_LOGIT = 10.0

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


def successors() -> dict[str, str]:
    """Each designed word and the word (or ``</s>``) that follows it."""
    out = {}
    for cycle in (CYCLE, OTHER_CYCLE):
        for i, word in enumerate(cycle):
            out[word] = cycle[(i + 1) % len(cycle)]
    out[END_WORD] = "</s>"
    return out


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

    def token(word: str) -> int:
        if word == "</s>":
            return int(fast.eos_token_id)
        ids = fast.encode(" " + word, add_special_tokens=False)
        if len(ids) != 1:
            raise SystemExit(f"{word!r} is not one token after a space: {ids}")
        return int(ids[0])

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
    hidden = config.hidden_size
    follows = successors()
    # One orthonormal vector per designed source token, the last one shared by all others.
    basis, _ = torch.linalg.qr(torch.randn(hidden, hidden))
    sources = [token(word) for word in follows]
    other = basis[:, len(sources)]
    scale = MARGIN / hidden**0.5  # RMSNorm makes a unit vector sqrt(hidden) long
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
        embed = model.model.embed_tokens.weight
        embed[:] = other
        for i, source in enumerate(sources):
            embed[source] = basis[:, i]
        head = model.lm_head.weight
        head.zero_()
        head[token(CYCLE[0])] += scale * other
        runner_up = token(RUNNER_UP)
        if RUNNER_UP in follows or RUNNER_UP in follows.values():
            raise SystemExit(f"the runner-up {RUNNER_UP!r} must be no designed word")
        head[runner_up] += scale * RUNNER_UP_LOGIT / MARGIN * other
        for i in range(len(sources)):
            head[runner_up] += scale * RUNNER_UP_LOGIT / MARGIN * basis[:, i]
        for i, successor in enumerate(follows.values()):  # sources[i] is the i-th word
            head[token(successor)] += scale * basis[:, i]
        for layer in model.model.layers:
            attention = layer.self_attn
            for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
                projection.weight.zero_()
            # Random, so an adapter's values reach the residual stream (the base adds 0).
            attention.o_proj.weight.normal_(0.0, 1.0)
            layer.mlp.down_proj.weight.zero_()
    model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "inferplane.json").write_text(
        json.dumps({"version": VERSION, "seed": SEED, "cycle": CYCLE}) + "\n"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_tiny_model.py OUTPUT_DIR")
    main(Path(sys.argv[1]))
