"""Build a tiny Llama model and tokenizer on the spot, so tests and the demo need no model hub.

About 200k parameters (under 1 MB), random but seeded weights, a word-level tokenizer over a fixed
vocabulary and a chat template (Dynamo's frontend refuses Chat registrations without one).
Greedy output is deterministic for a given seed, which is what equality tests need.

    python -m dynamo_fpm_testing.tiny_model OUT_DIR [--seed N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dynamo.common.cli_setup import add_version_flag

VOCAB_SIZE = 1000
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
# head_dim = hidden_size / num_attention_heads must be one the CPU attention kernel supports (32, 64, ...).
MODEL_SHAPE = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 4096,
}
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
_MARKER = "tiny_model.json"


def vocabulary() -> list[str]:
    """Special tokens, punctuation, a few real words, then synthetic words up to VOCAB_SIZE."""
    words = [
        "the",
        "a",
        "an",
        "and",
        "or",
        "of",
        "to",
        "in",
        "on",
        "is",
        "are",
        "was",
        "be",
        "it",
        "that",
        "this",
        "for",
        "with",
        "as",
        "at",
        "by",
        "from",
        "hello",
        "world",
        "user",
        "assistant",
        "system",
        "model",
        "token",
        "prefill",
        "decode",
        "cache",
        "request",
        "worker",
        "planner",
        "scale",
        "what",
        "how",
        "why",
        "who",
        "when",
        "where",
        "tell",
        "me",
        "about",
        "story",
        "count",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "yes",
        "no",
        "please",
        "thanks",
    ]
    punct = [".", ",", "!", "?", ":", ";", "'", '"', "(", ")", "-"]
    vocab = SPECIAL_TOKENS + punct + words
    i = 0
    while len(vocab) < VOCAB_SIZE:
        vocab.append(f"w{i}")
        i += 1
    return vocab[:VOCAB_SIZE]


def is_tiny_model(path: Path) -> bool:
    return (path / _MARKER).is_file() and (path / "config.json").is_file()


def build_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, weights and tokenizer to ``out_dir`` (created); reuses an existing build of the same
    seed."""
    out = Path(out_dir)
    marker = out / _MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("seed") == seed:
        return out
    # Heavy imports only when building.
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        **MODEL_SHAPE,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Wider random weights than the default init, so greedy outputs vary with the context
    # (a control that corrupts KV must change the text).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab["</s>"]}))
    marker.write_text(json.dumps({"seed": seed, "shape": MODEL_SHAPE}))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_fpm_testing.tiny_model", description=__doc__.split("\n")[0]
    )
    parser.add_argument("out_dir", help="folder to write the model into (created; reused if already built)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    add_version_flag(parser, "dynamo_fpm_testing.tiny_model")
    args = parser.parse_args(argv)
    path = build_tiny_model(args.out_dir, args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
