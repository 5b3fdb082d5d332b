#!/usr/bin/env python3
"""Independent correctness reference for Arbor.

Builds tiny seeded Llama / Qwen2 / Qwen3 / Mistral models with Hugging Face transformers on the CPU,
saves each one as a Hugging Face folder under tests/fixtures/<name>/, loads the SAVED folder back
with AutoModelForCausalLM / AutoTokenizer and writes reference.json (token ids, last-position
logits, 32-token greedy continuations, rendered chat prompt).

    python tools/reference/make_fixtures.py            # (re)write tests/fixtures/tiny-*
    python tools/reference/make_fixtures.py --check    # reload the committed folders, compare

See tools/reference/README.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import time
import unicodedata
import warnings
from pathlib import Path

# Single-threaded CPU math so that reruns produce the same bytes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import (  # noqa: E402
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

warnings.filterwarnings("ignore")
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
FIXTURES = REPO / "tests" / "fixtures"
CORPUS = HERE / "corpus.txt"

# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

BPE_VOCAB = 497  # 256 byte symbols + 241 merges
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 497, 498, 499
TOKENIZER_VOCAB = BPE_VOCAB + len(SPECIAL_TOKENS)  # 500
ENDOFTEXT, IM_START, IM_END = 497, 498, 499

# Llama-3 pre-tokenizer regex (numbers split in runs of up to 3 digits).
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 pre-tokenizer regex (single digits). transformers' Qwen2Tokenizer rebuilds exactly this
# pipeline (NFC + Split(QWEN2_REGEX) + ByteLevel(use_regex=False)) and ignores the normalizer and
# pre-tokenizer stored in tokenizer.json, so the tokenizer.json we write must match it.
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML, SmolLM2 style (one line, Jinja "\n" escapes inside string literals), BOS prefixed.
CHATML_BOS_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ChatML, Qwen2.5 style (multi-line with whitespace control), no BOS.
CHATML_QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message.role == 'system' and loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def train_base_tokenizer() -> Tokenizer:
    """Byte-level BPE, 497 BPE tokens + 3 special tokens appended at ids 497..499."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = CORPUS.read_text(encoding="utf-8")
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    assert tok.get_vocab_size() == BPE_VOCAB, tok.get_vocab_size()
    tok.add_special_tokens(SPECIAL_TOKENS)
    assert tok.token_to_id("<|endoftext|>") == ENDOFTEXT
    assert tok.token_to_id("<|im_end|>") == IM_END
    return tok


def family_tokenizer_json(base: Tokenizer, family: str, merges_style: str) -> str:
    """tokenizer.json text for one family: its own normalizer / pre-tokenizer / post-processor,
    the shared vocab and merges, merges stored either as "a b" strings or ["a", "b"] pairs."""
    tok = Tokenizer.from_str(base.to_str())
    bos = ("<|endoftext|>", ENDOFTEXT)
    bos_template = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|>:1 $B:1", special_tokens=[bos]
    )
    if family == "llama3":  # like Meta-Llama-3: Split regex + ByteLevel, BOS via TemplateProcessing
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
            ]
        )
        tok.post_processor = processors.Sequence(
            [processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True), bos_template]
        )
        tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    elif family == "gpt2":  # plain ByteLevel pre-tokenizer (GPT-2 regex), BOS via TemplateProcessing
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        tok.post_processor = bos_template
        tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    elif family == "qwen2":  # exactly what transformers' Qwen2Tokenizer builds; no BOS
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    else:
        raise ValueError(family)
    data = json.loads(tok.to_str())
    merges = data["model"]["merges"]
    for a, b in merges:  # byte-level symbols never contain a literal space: "a b" is unambiguous
        assert " " not in a and " " not in b, (a, b)
    if merges_style == "strings":
        data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    elif merges_style == "pairs":
        data["model"]["merges"] = [[a, b] for a, b in merges]
    else:
        raise ValueError(merges_style)
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def added_tokens_decoder() -> dict:
    return {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in zip(range(ENDOFTEXT, TOKENIZER_VOCAB), SPECIAL_TOKENS)
    }


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------

# Each spec: how to build, how to spell config.json, which tokenizer flavour, generation config.
SPECS = [
    {
        "name": "tiny-llama",
        "architecture": "LlamaForCausalLM",
        "seed": 1000,
        "model_cls": LlamaForCausalLM,
        "config": lambda: LlamaConfig(
            vocab_size=TOKENIZER_VOCAB,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
            bos_token_id=ENDOFTEXT,
            eos_token_id=IM_END,
            attention_bias=False,
            mlp_bias=False,
        ),
        "config_spelling": "v4",
        "shards": 2,
        "tokenizer_family": "llama3",
        "merges_style": "strings",
        "tokenizer_config": {
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "chat_template": CHATML_BOS_TEMPLATE,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
        "generation_config": {"bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT]},
    },
    {
        "name": "tiny-qwen2",
        "architecture": "Qwen2ForCausalLM",
        "seed": 2000,
        "model_cls": Qwen2ForCausalLM,
        "config": lambda: Qwen2Config(
            vocab_size=512,  # padded: the tokenizer has 500 tokens
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=2,
            bos_token_id=ENDOFTEXT,
            eos_token_id=IM_END,
        ),
        "config_spelling": "v4",
        "shards": 1,
        "tokenizer_family": "qwen2",
        "merges_style": "pairs",
        "tokenizer_config": {
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "chat_template": CHATML_QWEN_TEMPLATE,
            "tokenizer_class": "Qwen2Tokenizer",
            "errors": "replace",
            "split_special_tokens": False,
        },
        "generation_config": {
            "bos_token_id": ENDOFTEXT,
            "eos_token_id": [IM_END, ENDOFTEXT],
            "pad_token_id": ENDOFTEXT,
        },
    },
    {
        "name": "tiny-qwen3",
        "architecture": "Qwen3ForCausalLM",
        "seed": 3000,
        "model_cls": Qwen3ForCausalLM,
        "config": lambda: Qwen3Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # != hidden / heads (16)
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=2,
            bos_token_id=ENDOFTEXT,
            eos_token_id=IM_END,
        ),
        "config_spelling": "v5",
        "shards": 1,
        "tokenizer_family": "qwen2",
        "merges_style": "pairs",
        "tokenizer_config": {
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "chat_template": CHATML_QWEN_TEMPLATE,
            "tokenizer_class": "Qwen2Tokenizer",
            "errors": "replace",
            "split_special_tokens": False,
        },
        "generation_config": {"bos_token_id": ENDOFTEXT, "eos_token_id": IM_END, "pad_token_id": ENDOFTEXT},
    },
    {
        "name": "tiny-mistral",
        "architecture": "MistralForCausalLM",
        "seed": 4000,
        "model_cls": MistralForCausalLM,
        "config": lambda: MistralConfig(
            vocab_size=TOKENIZER_VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,  # MQA: 4 query heads share one KV head
            head_dim=16,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            sliding_window=None,
            tie_word_embeddings=False,
            bos_token_id=ENDOFTEXT,
            eos_token_id=IM_END,
        ),
        "config_spelling": "v5",
        "shards": 1,
        "tokenizer_family": "gpt2",
        "merges_style": "strings",
        "tokenizer_config": {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "chat_template": CHATML_BOS_TEMPLATE,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
        "generation_config": {"bos_token_id": ENDOFTEXT, "eos_token_id": IM_END},
    },
]

# Std of the random init per parameter kind (norm weights are uniform in [0.8, 1.2]).
EMBED_STD = 0.5
LM_HEAD_STD = 0.5
LINEAR_STD = 0.15
BIAS_STD = 0.2
PAD_ROW_STD = 0.02  # embedding rows past the tokenizer (padded vocab): small, never the argmax

PROMPTS = [
    "The radix cache is",  # ~5 tokens
    "Arbor batches requests and streams 128 tokens back.",  # ~23 tokens
    # ~60 tokens, non-ASCII (Latin-1 letters, CJK, a 4-byte emoji)
    "Grüße aus München! Le café est chaud. 東京 🚀 The radix cache evicts the least used prefix first.",
]
CHAT_MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is a radix cache? Answer in one sentence."},
]
# Extra texts used only to check that transformers and the raw tokenizers library agree.
EXTRA_TEXTS = [
    "",
    " ",
    "  leading spaces and trailing  ",
    "line one\nline two\r\n\ttabbed\n\n",
    "Numbers: 1 12 123 1234 12345 3.14159 1e-5",
    "It's we're they've I'm you'll he'd DON'T",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "Русский текст: привет, мир. 中文句子：我们今天在北京见面。",
    "e\u0301 vs \u00e9 (decomposed vs composed)",
    "emoji 🚀✨🙂👍 and ±≤≥≠→←",
    "\u00a0non-breaking\u2003em space\u200bzero width",
]
NEW_TOKENS = 32
MIN_MARGIN = 1e-2  # required top1-top2 gap on every greedy step (the task asks for > 1e-3)
MIN_DISTINCT = 8  # greedy continuations stuck on one token test little: want this many distinct ids
MAX_SEED_TRIES = 200


def init_weights(model: torch.nn.Module, seed: int, tokenizer_vocab: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):  # input/post_attention/final/q_norm/k_norm
                lo, hi = (0.5, 1.5) if ("q_norm" in name or "k_norm" in name) else (0.8, 1.2)
                p.copy_(lo + (hi - lo) * torch.rand(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * BIAS_STD)
            elif "embed_tokens" in name:
                w = torch.randn(p.shape, generator=g) * EMBED_STD
                w[tokenizer_vocab:] *= PAD_ROW_STD / EMBED_STD
                p.copy_(w)
            elif name == "lm_head.weight":
                w = torch.randn(p.shape, generator=g) * LM_HEAD_STD
                w[tokenizer_vocab:] *= PAD_ROW_STD / LM_HEAD_STD
                p.copy_(w)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * LINEAR_STD)
            else:
                raise ValueError(f"unhandled parameter {name} {tuple(p.shape)}")


def spell_config(cfg: dict, spelling: str) -> dict:
    """transformers 5 writes rope_parameters (with rope_theta inside) and dtype; 4.x wrote
    rope_theta + rope_scaling (null when no scaling) and torch_dtype."""
    cfg = dict(cfg)
    if spelling == "v5":
        cfg["dtype"] = "float32"
        cfg.pop("torch_dtype", None)
        return cfg
    assert spelling == "v4"
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "float32"
    cfg.pop("layer_types", None)  # added by transformers 5; absent from 4.x configs
    return cfg


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def save_tensors(tensors: dict, path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)  # safetensors creates the file 0600


def save_folder(spec: dict, seed: int, base_tok: Tokenizer, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config = spec["config"]()
    config.architectures = [spec["architecture"]]
    torch.manual_seed(seed)
    model = spec["model_cls"](config).eval()
    init_weights(model, seed, TOKENIZER_VOCAB)

    # config.json: what transformers 5 writes, then respelled.
    cfg = json.loads(config.to_json_string(use_diff=True))
    write_json(out / "config.json", spell_config(cfg, spec["config_spelling"]))

    # Weights: float32, contiguous; tied lm_head is not stored (as save_pretrained does).
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    names = sorted(state)
    if spec["shards"] == 1:
        save_tensors({k: state[k] for k in names}, out / "model.safetensors")
    else:
        n = spec["shards"]
        total = sum(state[k].numel() * state[k].element_size() for k in names)
        groups: list[list[str]] = [[] for _ in range(n)]
        acc = 0
        for k in names:  # contiguous split by bytes
            idx = min(n - 1, int(acc * n // total))
            groups[idx].append(k)
            acc += state[k].numel() * state[k].element_size()
        assert all(groups), "empty shard"
        weight_map = {}
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_tensors({k: state[k] for k in group}, out / fname)
            weight_map.update({k: fname for k in group})
        write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )

    # Tokenizer files.
    (out / "tokenizer.json").write_text(
        family_tokenizer_json(base_tok, spec["tokenizer_family"], spec["merges_style"]), encoding="utf-8"
    )
    tcfg = {
        "added_tokens_decoder": added_tokens_decoder(),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        **spec["tokenizer_config"],
    }
    write_json(out / "tokenizer_config.json", tcfg)
    special_map = {
        k: tcfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if tcfg.get(k) is not None
    }
    write_json(out / "special_tokens_map.json", special_map)
    gen = {"transformers_version": transformers.__version__, **spec["generation_config"]}
    write_json(out / "generation_config.json", gen)


# ----------------------------------------------------------------------------------------------
# Reference computation (always from the saved folder)
# ----------------------------------------------------------------------------------------------


def load_folder(d: Path):
    tok = AutoTokenizer.from_pretrained(str(d))
    model, info = AutoModelForCausalLM.from_pretrained(
        str(d), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    model.eval()
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), (d.name, key, info[key])
    # Every stored tensor must reach the model unchanged (no silent re-init or conversion).
    params = dict(model.named_parameters(remove_duplicate=False))
    stored = set()
    for f in sorted(d.glob("*.safetensors")):
        with safetensors.safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                t = sf.get_tensor(k)
                assert t.dtype == torch.float32, (d.name, k, t.dtype)
                assert torch.equal(params[k].detach(), t), (d.name, k)
                stored.add(k)
    missing = set(params) - stored
    if model.config.tie_word_embeddings:
        assert missing == {"lm_head.weight"}, missing
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert not missing, missing
    return tok, model


def check_tokenizer(d: Path, tok, texts: list[str]) -> None:
    """transformers' tokenizer (which may rebuild the pipeline from vocab+merges) must agree with
    the tokenizers library reading tokenizer.json directly (what the Rust side does)."""
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    for text in texts:
        for special in (True, False):
            a = tok(text, add_special_tokens=special)["input_ids"]
            b = raw.encode(text, add_special_tokens=special).ids
            assert a == b, (d.name, text, special, a, b)
        ids = raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == raw.decode(ids, skip_special_tokens=False), (d.name, text)
        if "<|" not in text:  # byte-level round trip (modulo NFC for the qwen pipeline)
            expect = unicodedata.normalize("NFC", text) if raw.normalizer else text
            assert raw.decode(ids, skip_special_tokens=False) == expect, (d.name, text)
    # Same merges, whatever the encoding on disk.
    saved = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"]
    saved = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in saved]
    loaded = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    loaded = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in loaded]
    assert saved == loaded, d.name
    assert len(tok) == TOKENIZER_VOCAB, (d.name, len(tok))


def expected_llama3_inv_freq(rope: dict, head_dim: int) -> np.ndarray:
    """Independent re-implementation of Llama-3 rope scaling (float64)."""
    base = rope["rope_theta"]
    inv = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / lo, old / hi
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def check_config(spec: dict, model) -> dict:
    cfg = model.config
    rope = dict(cfg.rope_parameters)
    want = spec["config"]().rope_parameters
    for k, v in want.items():
        assert rope.get(k) == v, (spec["name"], k, rope.get(k), v)
    info = {"rope_parameters": rope}
    if rope["rope_type"] == "llama3":
        got = model.model.rotary_emb.inv_freq.double().numpy()
        exp = expected_llama3_inv_freq(rope, cfg.head_dim)
        assert np.allclose(got, exp, rtol=1e-6), (got, exp)
        plain = 1.0 / rope["rope_theta"] ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
        info["inv_freq_total"] = len(exp)
        info["inv_freq_scaled"] = int(np.sum(~np.isclose(exp, plain)))
        info["inv_freq_smoothed"] = int(np.sum(~np.isclose(exp, plain) & ~np.isclose(exp, plain / rope["factor"])))
        # The scaling must matter for the positions the fixtures use: the same weights with plain
        # RoPE give clearly different logits on the longest prompt (+ its 32 new tokens).
        plain_cfg = copy.deepcopy(cfg)
        plain_cfg.rope_parameters = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
        plain_model = type(model)(plain_cfg).eval()
        plain_model.load_state_dict(model.state_dict())
        x = torch.tensor([list(range(96))])  # positions 0..95 cover every prompt + continuation
        with torch.no_grad():
            a, b = model(x).logits[0], plain_model(x).logits[0]
        info["plain_rope_logit_diff"] = float((a - b).abs().max() / a.abs().max())
        assert info["plain_rope_logit_diff"] > 1e-2, info
    return info


def greedy_manual(model, ids: list[int], n: int) -> list[int]:
    """Full-recompute greedy loop (no KV cache), cross-checks generate()."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(torch.argmax(logits)))
    return seq[len(ids) :]


def compute_reference(spec: dict, d: Path, seed: int) -> tuple[dict, dict]:
    tok, model = load_folder(d)
    rope_info = check_config(spec, model)
    model.generation_config.eos_token_id = None  # all 32 tokens come out (in memory only)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else ENDOFTEXT

    rendered = tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
    chat_ids = tok.apply_chat_template(CHAT_MESSAGES, tokenize=True, add_generation_prompt=True)
    if not isinstance(chat_ids, list):
        chat_ids = chat_ids["input_ids"]
    assert chat_ids == tok(rendered, add_special_tokens=False)["input_ids"]
    check_tokenizer(d, tok, PROMPTS + EXTRA_TEXTS + [rendered])

    prompts = []
    for text in PROMPTS:
        ids = tok(text)["input_ids"]
        x = torch.tensor([ids])
        with torch.no_grad():
            last = model(x).logits[0, -1].float()
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=pad_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        gen = out.sequences[0, len(ids) :].tolist()
        assert len(gen) == NEW_TOKENS, (spec["name"], len(gen))
        step_logits = torch.stack([s[0] for s in out.logits]).float()
        top2 = torch.topk(step_logits, 2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        assert torch.equal(torch.argmax(step_logits, -1), torch.tensor(gen))
        assert torch.allclose(step_logits[0], last, rtol=0, atol=1e-4 * float(last.abs().max()))
        assert greedy_manual(model, ids, NEW_TOKENS) == gen, spec["name"]
        raw_text = Tokenizer.from_file(str(d / "tokenizer.json")).decode(gen, skip_special_tokens=False)
        assert tok.decode(gen, skip_special_tokens=False) == raw_text, spec["name"]
        prompts.append(
            {
                "text": text,
                "input_ids": ids,
                "last_logits": [float(v) for v in last.numpy().astype(np.float32)],
                "greedy_ids": gen,
                "greedy_text": tok.decode(gen, skip_special_tokens=False),
                "min_margin": float(min(margins)),
            }
        )

    # The same prompts as one left-padded batch must give the same greedy tokens.
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = "<|endoftext|>"
    batch = tok(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        bout = model.generate(
            **batch, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=pad_id
        )
    width = batch["input_ids"].shape[1]
    assert batch["attention_mask"][:, 0].tolist() == [0, 0, 1], "expected left padding"
    for i, p in enumerate(prompts):
        assert bout[i, width:].tolist() == p["greedy_ids"], (spec["name"], "batch != single", i)

    return {
        "model": spec["name"],
        "architecture": spec["architecture"],
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "seed": seed,
        "tokenizer_class": type(tok).__name__,
        "tokenizer_vocab_size": len(tok),
        "model_vocab_size": model.config.vocab_size,
        "add_bos": prompts[0]["input_ids"][0] == ENDOFTEXT,
        "max_new_tokens": NEW_TOKENS,
        "prompts": prompts,
        "chat": {"messages": CHAT_MESSAGES, "rendered": rendered, "input_ids": chat_ids},
    }, rope_info


def acceptable(ref: dict) -> str | None:
    for p in ref["prompts"]:
        if p["min_margin"] <= MIN_MARGIN:
            return f"min_margin {p['min_margin']:.2e} <= {MIN_MARGIN}"
        if max(p["greedy_ids"]) >= ref["tokenizer_vocab_size"]:
            return "greedy picked a padded-vocab id"
        if len(set(p["greedy_ids"])) < MIN_DISTINCT:
            return f"only {len(set(p['greedy_ids']))} distinct greedy ids"
    return None


def build_all(only: list[str] | None) -> None:
    t0 = time.time()
    base = train_base_tokenizer()
    again = train_base_tokenizer()
    assert base.to_str() == again.to_str(), "BPE training is not deterministic"
    for spec in SPECS:
        if only and spec["name"] not in only:
            continue
        d = FIXTURES / spec["name"]
        for attempt in range(MAX_SEED_TRIES):
            seed = spec["seed"] + attempt
            save_folder(spec, seed, base, d)
            ref, rope_info = compute_reference(spec, d, seed)
            why = acceptable(ref)
            if why is None:
                break
            print(f"  {spec['name']}: seed {seed} rejected ({why})")
        else:
            sys.exit(f"{spec['name']}: no acceptable seed in {MAX_SEED_TRIES} tries")
        write_json(d / "reference.json", ref)
        summarize(ref, d)
        if "plain_rope_logit_diff" in rope_info:
            print(
                f"{'':13s} llama3 rope: {rope_info['inv_freq_scaled']} of {rope_info['inv_freq_total']} "
                f"inv_freq changed ({rope_info['inv_freq_smoothed']} smoothed); plain-RoPE logits differ by "
                f"{rope_info['plain_rope_logit_diff']:.3f} x max|logit|"
            )
    print(f"done in {time.time() - t0:.1f}s")


def summarize(ref: dict, d: Path) -> None:
    size = sum(f.stat().st_size for f in d.iterdir())
    lens = [len(p["input_ids"]) for p in ref["prompts"]]
    margins = ", ".join(f"{p['min_margin']:.4f}" for p in ref["prompts"])
    print(
        f"{ref['model']:13s} seed={ref['seed']} tok={ref['tokenizer_class']} bos={ref['add_bos']} "
        f"prompt_lens={lens} chat_len={len(ref['chat']['input_ids'])} min_margins=[{margins}] "
        f"size={size / 1024:.0f} KiB"
    )


def check_all(only: list[str] | None) -> None:
    """Reload every committed folder in this process and compare with its reference.json."""
    ok = True
    for spec in SPECS:
        if only and spec["name"] not in only:
            continue
        d = FIXTURES / spec["name"]
        want = json.loads((d / "reference.json").read_text(encoding="utf-8"))
        got, _ = compute_reference(spec, d, want["seed"])
        worst = 0.0
        exact = True
        for pw, pg in zip(want["prompts"], got["prompts"]):
            for key in ("text", "input_ids", "greedy_ids", "greedy_text"):
                if pw[key] != pg[key]:
                    ok = False
                    print(f"MISMATCH {spec['name']} {key}: {pw[key]!r} != {pg[key]!r}")
            a, b = np.array(pw["last_logits"]), np.array(pg["last_logits"])
            worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))
            exact &= bool(np.array_equal(a, b))
        if worst > 1e-4:
            ok = False
        for key in ("rendered", "input_ids"):
            if want["chat"][key] != got["chat"][key]:
                ok = False
                print(f"MISMATCH {spec['name']} chat.{key}")
        print(f"{spec['name']:13s} greedy/ids/chat ok, last_logits rel err {worst:.2e} (bit-exact: {exact})")
    if not ok:
        sys.exit("reference check FAILED")
    print("reference check passed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="reload tests/fixtures/tiny-* and compare")
    ap.add_argument("--only", nargs="*", help="model names (default: all)")
    args = ap.parse_args()
    if args.check:
        check_all(args.only)
    else:
        build_all(args.only)


if __name__ == "__main__":
    main()
