"""Writes the tiny random-weight Llama that the real-vLLM tests and benchmarks serve.

Run with the Python of vLLM's environment (it needs torch, transformers and tokenizers), as
scripts/build-vllm.sh does:

    python scripts/make-vllm-model.py OUT

`OUT/model` gets a Hugging Face model folder: `config.json` (a 2-layer `LlamaConfig`, hidden 128,
two heads of 64: vLLM's CPU attention refuses heads of 16), bf16 `model.safetensors` (N(0, 0.05),
seed 0), and a byte-level BPE tokenizer (at most 2,048 tokens) trained here on a generated
English-like text, with a chat template of its own. Every byte string tokenizes (the byte alphabet
is in the vocabulary), the same input always gives the same files, and its text is nonsense: what
is real is the engine around it (paged KV cache, prefix caching, batching, metrics, KV-cache
events). `OUT/lora-0` and `OUT/lora-1` get two rank-8 LoRA adapters of it (on the attention's
q and v projections, PEFT's file layout, written without PEFT), for `--enable-lora`.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB = 2048
ADAPTERS = 2
SPECIAL = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# role tags as special tokens; a message's content is a string or a list of text parts (as the
# Anthropic and Responses APIs arrive after vLLM's conversion)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>' }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
WORDS = (  # noqa: SIM905 -- a word list reads better as prose
    "the a an of to and in is it that for on with as was by at be this from or have not are but had "
    "they which you one were all we when there can an your who more if will about so out up what "
    "fox dog cat bird weather rain sun cloud wind snow river tree forest city road car train house "
    "question answer model token cache replica router engine request session prompt system user "
    "assistant document summary chapter section page line word number time day night year "
    "quick brown lazy jumps over under run walk far near fast slow why how where when which"
).split()


def corpus(seed: int = 0, lines: int = 20000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 999)))
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return out


def main(out: Path) -> None:
    import torch  # noqa: PLC0415 -- vLLM's environment has these; the router's does not
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: PLC0415

    dest = out / "model"
    dest.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dest)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok.get_vocab()),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    model.to(torch.bfloat16).save_pretrained(dest, safe_serialization=True)
    for i in range(ADAPTERS):
        write_adapter(out / f"lora-{i}", dest, config, seed=i + 1)


def write_adapter(path: Path, base: Path, config: object, seed: int, rank: int = 8) -> None:
    """A LoRA adapter of the model in PEFT's layout (adapter_config.json, adapter_model.safetensors)."""
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    path.mkdir(parents=True, exist_ok=True)
    hidden = config.hidden_size  # type: ignore[attr-defined]
    layers = config.num_hidden_layers  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj in ("q_proj", "v_proj"):
            name = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            for part, shape in (("lora_A", (rank, hidden)), ("lora_B", (hidden, rank))):
                weight = torch.randn(*shape, generator=generator) * 0.05
                tensors[f"{name}.{part}.weight"] = weight.to(torch.bfloat16)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make-vllm-model.py OUT")
    main(Path(sys.argv[1]))
