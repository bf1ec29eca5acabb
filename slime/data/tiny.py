"""The tiny model kit: a byte-level tokenizer, a tiny random Qwen2 (or Qwen3-MoE, GLM-4.5) and arithmetic data.

Every test and `make run` need a model, a tokenizer and a task whose answers can be checked, and they
must work on a CPU with no network. `make_tiny_kit` builds all of that locally and deterministically from
a small YAML recipe (`datasets/tiny/recipe.yaml`): the same recipe always gives byte-identical files, so
runs are reproducible and a kit can be cached. Layout of the output directory:

    model/            HF checkpoint (config, safetensors, generation config) plus the tokenizer files
    data/train.jsonl  RL prompts   {"prompt": "12+34=", "label": "46", "metadata": {...}}
    data/eval.jsonl   held-out prompts, same format, disjoint from train and sft
    data/sft.jsonl    chat SFT     {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}
    kit.json          recipe, sha256 of every file, sizes; written last, so it marks a complete kit
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import random
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

import slime
from slime.data.arithmetic import draw_problem
from slime.data.glm4_moe_shapes import draw_expert_bias, glm4_moe_config
from slime.data.pretrain import PretrainRecipe, pretrain
from slime.errors import ConfigError, DataFormatError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

KIT_MANIFEST = "kit.json"
KIT_FORMAT_VERSION = 1
PAD_TOKEN, IM_START, IM_END, UNK_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)
SPLITS = ("train", "eval", "sft")
KIT_SHARD_BYTES = 5 * 1024**3  # safetensors shards of a drawn-weights (bfloat16) model, as HF's published 7Bs

# ChatML as Qwen2 writes it. `{% generation %}` marks what the assistant produced (content and its closing
# <|im_end|>) so `return_assistant_tokens_mask=True` gives the SFT loss mask; the "\n" after it is template.
CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nTo call a function, reply with <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\nAvailable functions:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not (tools and loop.first) %}{{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}{%- endif %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- generation %}
{{- message.content or '' }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if (message.content or '') or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>' }}
{%- endgeneration %}
{{- '\n' }}
{%- elif message.role in ['user', 'tool'] %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- else %}
{{- raise_exception('unsupported chat role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Digits = Annotated[int, Field(ge=1, le=15)]


GLM_FIELDS = ("n_shared_experts", "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
              "partial_rotary_factor", "expert_bias_scale")


class MoeRecipe(_Strict):
    """The sparse MLP that makes the checkpoint a Qwen3-MoE (`model_type` qwen3_moe, the default): in every layer
    `num_experts` SwiGLU experts of width `moe_intermediate_size`, each token routed to the top `num_experts_per_tok`
    (their weights renormalised, `norm_topk_prob`, as Qwen3-30B-A3B ships). `model_type` glm4_moe: a GLM-4.5
    (slime/data/glm4_moe_shapes.py's `glm4_moe_config`): the first `first_k_dense_replace` layers dense, then MoE
    layers with `n_shared_experts` shared experts beside the routed ones, sigmoid routing with an expert bias
    (drawn N(0, expert_bias_scale^2), seeded, so it changes which experts are picked, as a trained GLM-4.5's does)
    over `n_group` groups of which the `topk_group` best are kept, the weights renormalised and scaled by
    `routed_scaling_factor`, `partial_rotary_factor` of each head rotated, q/k norms and q/k/v biases. The GLM
    fields are refused on a qwen3_moe."""

    model_type: Literal["qwen3_moe", "glm4_moe"] = "qwen3_moe"
    num_experts: int = Field(8, gt=1)
    num_experts_per_tok: int = Field(2, gt=0)
    moe_intermediate_size: int = Field(256, gt=0)
    # glm4_moe only (GLM-4.5-Air's values, but the bias scale: the tiny GLM4_MOE_SHAPES')
    n_shared_experts: int = Field(1, ge=0)
    first_k_dense_replace: int = Field(1, ge=0)
    n_group: int = Field(1, gt=0)
    topk_group: int = Field(1, gt=0)
    routed_scaling_factor: float = Field(1.0, gt=0)
    partial_rotary_factor: float = Field(0.5, gt=0, le=1)
    expert_bias_scale: float = Field(0.1, ge=0)

    @model_validator(mode="after")
    def _topk_fits(self) -> MoeRecipe:
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("num_experts_per_tok must not exceed num_experts")
        if self.model_type == "qwen3_moe":
            if glm := [f for f in GLM_FIELDS if f in self.model_fields_set]:
                raise ValueError(f"{', '.join(glm)}: GLM-4.5 fields; set model_type: glm4_moe")
            return self
        if self.num_experts % self.n_group:
            raise ValueError("n_group must divide num_experts")
        if self.topk_group > self.n_group:
            raise ValueError("topk_group must not exceed n_group")
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError("num_experts_per_tok must not exceed the experts of the topk_group groups kept")
        return self

    def manifest_json(self) -> dict[str, Any]:
        """As kit.json records it: a qwen3_moe without `model_type` and the GLM fields, as kits built before them."""
        dump = self.model_dump(mode="json")
        if self.model_type == "qwen3_moe":
            for name in ("model_type", *GLM_FIELDS):
                del dump[name]
        return dump


class ModelRecipe(_Strict):
    """Shape of the random checkpoint: a Qwen2, or a Qwen3-MoE or GLM-4.5 when `moe` is set."""

    hidden_size: int = Field(256, gt=0)
    num_hidden_layers: int = Field(4, gt=0)
    num_attention_heads: int = Field(8, gt=0)
    num_key_value_heads: int = Field(4, gt=0)
    intermediate_size: int = Field(1024, gt=0)
    max_position_embeddings: int = Field(512, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    tie_word_embeddings: bool = True
    vocab_multiple: int = Field(128, gt=0)  # Megatron pads the vocab to a multiple of 128
    # float32: the model is built by transformers (its seeded init) and saved whole, as every small kit is.
    # bfloat16: the weights are drawn tensor by tensor (a generator per tensor, seeded by the kit seed and the
    # tensor's name, on every CPU core) and written in shards of 5 GB with their index, without building the model:
    # what makes a 7B kit a minute's work (datasets/gpu-7b/recipe.yaml). Dense models without `pretrain` only.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # None: a dense Qwen2. Set: a Qwen3-MoE (qk-norm attention, head_dim hidden_size / num_attention_heads,
    # every MLP sparse; `intermediate_size` is then only the config's width for dense layers, of which it has none),
    # or a GLM-4.5 (`moe.model_type` glm4_moe; same head_dim; its `first_k_dense_replace` dense layers have
    # `intermediate_size`).
    moe: MoeRecipe | None = None

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelRecipe:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        if self.dtype != "float32" and self.moe is not None:
            raise ValueError(f"dtype {self.dtype}: the drawn-weights writer makes dense models only; an MoE kit is "
                             "float32")
        if self.moe is not None and self.moe.first_k_dense_replace >= self.num_hidden_layers and \
                self.moe.model_type == "glm4_moe":
            raise ValueError("moe.first_k_dense_replace must leave at least one MoE layer (< num_hidden_layers)")
        return self


class DataRecipe(_Strict):
    """Synthetic integer arithmetic: operand digit tiers and split sizes."""

    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"], min_length=1)
    # false: the SFT answer is the bare result ("125"). true: it is worked out, as in long multiplication
    # ("a*b" lists a times each digit of b in place, then adds them up line by line) and ends with
    # \boxed{result}, the form slime's math rewards read.
    worked_steps: bool = False
    train_digits: list[Digits] = Field(default_factory=lambda: [2], min_length=1)
    eval_digits: list[Digits] = Field(default_factory=lambda: [2], min_length=1)
    allow_negative: bool = False
    num_train: int = Field(2000, ge=0)
    num_eval: int = Field(200, ge=0)
    num_sft: int = Field(4000, ge=0)


class TinyKitRecipe(_Strict):
    """Everything that determines a tiny kit; its JSON dump is stored in kit.json."""

    seed: int = 1234
    model: ModelRecipe = Field(default_factory=ModelRecipe)
    data: DataRecipe = Field(default_factory=DataRecipe)
    # None: the model is the random init. Set: it is pretrained on another task first (slime/data/pretrain.py),
    # a base for LoRA, which cannot learn through a random init's frozen embeddings.
    pretrain: PretrainRecipe | None = None

    @model_validator(mode="after")
    def _pretrain_needs_a_model(self) -> TinyKitRecipe:
        if self.pretrain is not None and self.model.dtype != "float32":
            raise ValueError(f"pretrain trains the model transformers builds: model.dtype must be float32, not "
                             f"{self.model.dtype}")
        return self

    def manifest_json(self) -> dict[str, Any]:
        """The recipe as kit.json records it (no `pretrain` or `model.moe` key when there is none, no `model.dtype`
        when it is float32, no GLM-4.5 fields in a qwen3_moe's `model.moe`, as kits built before those fields
        existed)."""
        dump = self.model_dump(mode="json")
        if dump["model"]["dtype"] == "float32":
            del dump["model"]["dtype"]
        if dump["pretrain"] is None:
            del dump["pretrain"]
        if self.model.moe is None:
            del dump["model"]["moe"]
        else:
            dump["model"]["moe"] = self.model.moe.manifest_json()
        return dump


@dataclass(frozen=True)
class TinyKit:
    """Paths of a complete kit."""

    root: Path
    model_dir: Path
    train: Path
    eval: Path
    sft: Path
    manifest: Path

    @classmethod
    def at(cls, root: Path) -> TinyKit:
        data = root / "data"
        return cls(
            root,
            root / "model",
            data / "train.jsonl",
            data / "eval.jsonl",
            data / "sft.jsonl",
            root / KIT_MANIFEST,
        )


def default_recipe_path() -> Path:
    return Path(slime.__file__).resolve().parents[1] / "datasets" / "tiny" / "recipe.yaml"


def load_recipe(path: str | Path | None = None) -> TinyKitRecipe:
    """Read and validate a recipe YAML (default: datasets/tiny/recipe.yaml of the project)."""
    path = Path(path) if path is not None else default_recipe_path()
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read tiny-kit recipe ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: tiny-kit recipe is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: tiny-kit recipe must be a YAML mapping, got {type(raw).__name__}")
    try:
        return TinyKitRecipe.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '<root>'}': {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{path}: invalid tiny-kit recipe: {problems}") from None


def _byte_symbols() -> list[str]:
    """The byte-level BPE alphabet (GPT-2/Qwen2): the printable character that stands for each byte 0..255."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    symbols, shifted = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:  # control bytes, space and a few others are moved above 255 so every symbol is visible
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def build_tokenizer(recipe: TinyKitRecipe | None = None) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges, Qwen2 special tokens and a ChatML template (built in memory).

    transformers 5 always loads a qwen2 checkpoint's tokenizer as `Qwen2Tokenizer`, which rebuilds the
    pipeline (NFC, Qwen2 split regex, byte-level) around the saved vocab. Building that same class here
    makes the in-memory tokenizer and every reloaded copy (tests, SGLang, training) tokenize alike. With
    no merges each byte is one token: every ASCII character (printable, "\n") is one token and any other
    character is one token per UTF-8 byte, so no input is unknown; <|unk|> exists but is never produced.
    """
    from transformers import Qwen2Tokenizer

    recipe = recipe or TinyKitRecipe()
    # Ids 0..255 are the bytes; the special tokens follow, as in Qwen2 (vocab order is fixed).
    vocab = {sym: b for b, sym in enumerate(_byte_symbols())}
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        bos_token=None,  # Qwen2 adds no BOS
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=[IM_START],
        model_max_length=recipe.model.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def padded_vocab_size(tokenizer_len: int, multiple: int) -> int:
    return -(-tokenizer_len // multiple) * multiple


# --- data -------------------------------------------------------------------------------------------


def _draw(rng: random.Random, digits: int, data: DataRecipe) -> dict[str, Any]:
    return draw_problem(rng, digits, data.ops, data.allow_negative)


def worked_answer(a: int, op: str, b: int) -> str:
    """The SFT answer with its working: for `*` one line per digit of `b` (least significant first) with
    that digit in place (`347*80=27760`), then the running sum of those lines, then the boxed result.

        347*86=  ->  347*6=2082
                     347*80=27760
                     2082+27760=29842
                     \\boxed{29842}

    `+` and `-` get the boxed result alone. Every step is checkable, which is what lets a model of ~100M
    parameters learn multi-digit products from scratch that it cannot learn as one bare number.
    """
    if op != "*":
        return rf"\boxed{{{a + b if op == '+' else a - b}}}"
    digits = str(b)[::-1]
    parts = [a * int(d) * 10**i for i, d in enumerate(digits)]
    lines = [f"{a}*{int(d) * 10**i}={p}" for i, (d, p) in enumerate(zip(digits, parts, strict=True))]
    total = parts[0]
    for p in parts[1:]:
        lines.append(f"{total}+{p}={total + p}")
        total += p
    return "\n".join([*lines, rf"\boxed{{{total}}}"])


def _draw_split(
    rng: random.Random, n: int, tiers: list[int], data: DataRecipe, exclude: set[str] | None
) -> list:
    """`exclude=None`: eval, distinct questions cycling through the tiers; else random tiers, `exclude` avoided."""
    out: list[dict[str, Any]] = []
    seen, attempts = set(exclude or ()), 0
    while len(out) < n:
        if (attempts := attempts + 1) > 100 * n + 1000:  # small tiers hold few distinct questions
            raise ConfigError(
                f"tiny-kit recipe: cannot draw {n} problems avoiding repeats from digit tiers {tiers}"
            )
        rec = _draw(rng, tiers[len(out) % len(tiers)] if exclude is None else rng.choice(tiers), data)
        if rec["prompt"] not in seen:
            out.append(rec)
            if exclude is None:
                seen.add(rec["prompt"])
    return out


def make_datasets(recipe: TinyKitRecipe) -> dict[str, list[dict[str, Any]]]:
    """Eval first (distinct questions), then train and sft with every eval question rejected."""
    d = recipe.data
    # One RNG per split so changing one split's size does not reshuffle the others.
    rng = {s: random.Random(f"{recipe.seed}:{s}") for s in SPLITS}
    eval_rows = _draw_split(rng["eval"], d.num_eval, d.eval_digits, d, None)
    held_out = {r["prompt"] for r in eval_rows}
    train = _draw_split(rng["train"], d.num_train, d.train_digits, d, held_out)
    def answer(r: dict[str, Any]) -> str:
        m = r["metadata"]
        return worked_answer(m["a"], m["op"], m["b"]) if d.worked_steps else r["label"]

    sft = [
        {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": answer(r)}]}
        for r in _draw_split(rng["sft"], d.num_sft, d.train_digits, d, held_out)
    ]
    return {"train": train, "eval": eval_rows, "sft": sft}


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# --- model ------------------------------------------------------------------------------------------


def _model_config(m: ModelRecipe, vocab_size: int, ids: dict[str, int]) -> Any:
    """The HF config of the recipe's model: `Qwen2Config`, `Qwen3MoeConfig` or (`moe.model_type` glm4_moe)
    `Glm4MoeConfig` when `m.moe` is set."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        intermediate_size=m.intermediate_size,
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.rms_norm_eps,
        tie_word_embeddings=m.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        dtype=m.dtype,
        **ids,
    )
    if m.moe is None:
        return Qwen2Config(use_sliding_window=False, **common)
    if m.moe.model_type == "glm4_moe":
        moe = m.moe
        common["rope_parameters"]["partial_rotary_factor"] = moe.partial_rotary_factor
        # every field of GLM4_MOE_SHAPES' tiny is set here: its shape gives only the traits the recipe does
        # not vary (q/k norm, q/k/v biases, top-k renormalised, no MTP layer)
        return glm4_moe_config(
            "tiny", head_dim=m.hidden_size // m.num_attention_heads, n_routed_experts=moe.num_experts,
            num_experts_per_tok=moe.num_experts_per_tok, moe_intermediate_size=moe.moe_intermediate_size,
            n_shared_experts=moe.n_shared_experts, first_k_dense_replace=moe.first_k_dense_replace,
            n_group=moe.n_group, topk_group=moe.topk_group, routed_scaling_factor=moe.routed_scaling_factor,
            **common)
    # Qwen3MoeConfig's head_dim defaults to 128 whatever the hidden size; every layer sparse (decoder_sparse_step 1,
    # no mlp_only_layers), as the published Qwen3-MoE checkpoints and mbridge's bridge have them
    return Qwen3MoeConfig(
        head_dim=m.hidden_size // m.num_attention_heads,
        num_experts=m.moe.num_experts,
        num_experts_per_tok=m.moe.num_experts_per_tok,
        moe_intermediate_size=m.moe.moe_intermediate_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **common,
    )


def _save_model(model_dir: Path, recipe: TinyKitRecipe, tokenizer: PreTrainedTokenizerFast) -> int:
    import torch
    from transformers import GenerationConfig, Glm4MoeForCausalLM, Qwen2ForCausalLM, Qwen3MoeForCausalLM

    m = recipe.model
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    ids = {"bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad}  # Qwen2 uses <|endoftext|> as bos
    config = _model_config(m, padded_vocab_size(len(tokenizer), m.vocab_multiple), ids)
    if m.dtype != "float32":
        count = write_drawn_weights(model_dir, config, recipe.seed)
        GenerationConfig(**ids).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        return count
    old_dtype = torch.get_default_dtype()
    # Seed the init without disturbing the caller's RNG state or default dtype.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        torch.set_default_dtype(torch.float32)
        try:
            model_class = Qwen2ForCausalLM if m.moe is None else (
                Glm4MoeForCausalLM if m.moe.model_type == "glm4_moe" else Qwen3MoeForCausalLM)
            model = model_class(config)
        finally:
            torch.set_default_dtype(old_dtype)
        if m.moe is not None and m.moe.model_type == "glm4_moe":
            draw_expert_bias(model, m.moe.expert_bias_scale)  # from the seeded RNG, after the init
    if recipe.pretrain is not None:
        pretrain(model, tokenizer, recipe.pretrain, recipe.seed)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def drawn_weights(config: Any, seed: int) -> tuple[list[tuple[str, tuple[int, ...]]], Callable[[str], Any]]:
    """The parameters of `config`'s causal LM as (name, shape), in `named_parameters` order (a tied lm_head is not
    listed: the checkpoint does not hold it), and `draw(name)`: that tensor in `config`'s dtype, drawn as
    transformers initialises it (linear and embedding weights N(0, initializer_range^2), the embedding's padding
    row and biases zero, norm weights one) from a CPU generator seeded by `seed` and `name` alone, so any order
    or thread gives the same bytes. The model is built on the meta device: no memory, no init."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dtype = getattr(torch, str(config.dtype).removeprefix("torch."))
    std = config.initializer_range
    rules: dict[str, tuple[str, int | None]] = {}  # name -> (normal | zeros | ones, padding row)
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for leaf, _ in module.named_parameters(recurse=False):
            name = prefix + leaf
            if isinstance(module, torch.nn.Embedding):
                rules[name] = ("normal", module.padding_idx)
            elif isinstance(module, torch.nn.Linear):
                rules[name] = ("normal" if leaf == "weight" else "zeros", None)
            elif "norm" in type(module).__name__.lower() and leaf == "weight":
                rules[name] = ("ones", None)
            else:
                raise ConfigError(f"drawn weights: no init rule for {name} ({type(module).__name__})")
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}

    def draw(name: str) -> Any:
        kind, padding = rules[name]
        if kind != "normal":
            return (torch.zeros if kind == "zeros" else torch.ones)(shapes[name], dtype=dtype)
        generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
        out = torch.empty(shapes[name], dtype=torch.float32).normal_(0.0, std, generator=generator).to(dtype)
        if padding is not None:
            out[padding].zero_()
        return out

    return list(shapes.items()), draw


def write_drawn_weights(model_dir: Path, config: Any, seed: int, workers: int | None = None,
                        max_shard_bytes: int | None = None) -> int:
    """Write `config`'s model with drawn weights (`drawn_weights`) to `model_dir`: config.json and the weights,
    sharded as transformers does (slime/data/hf_weights.py), the tensors drawn on `workers` threads (default:
    every core), at most twice that many ahead of the writer, in shards of `max_shard_bytes` (default
    KIT_SHARD_BYTES). Returns the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    from slime.data.hf_weights import save_hf_weights

    params, draw = drawn_weights(config, seed)
    workers = workers or os.cpu_count() or 1
    config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
    model_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(model_dir)

    def ordered() -> Iterator[tuple[str, Any]]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # parallel across tensors: each generator is sequential anyway
        try:
            with ThreadPoolExecutor(workers) as pool:
                names = iter([name for name, _ in params])
                pending = deque((name, pool.submit(draw, name)) for name in itertools.islice(names, 2 * workers))
                while pending:
                    name, future = pending.popleft()
                    yield name, future.result()
                    pending.extend((more, pool.submit(draw, more)) for more in itertools.islice(names, 1))
        finally:
            torch.set_num_threads(threads)

    save_hf_weights(ordered(), str(model_dir), max_shard_bytes or KIT_SHARD_BYTES)
    return sum(math.prod(shape) for _, shape in params)


# --- kit --------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:  # in blocks: a 7B kit's shards are 5 GB each
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _sha256_all(paths: list[Path]) -> list[str]:
    """`_sha256` of each path, on several threads (hashlib releases the GIL on large blocks)."""
    if len(paths) < 2:
        return [_sha256(p) for p in paths]
    with ThreadPoolExecutor(min(len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(_sha256, paths))


def _existing_kit(root: Path, recipe: TinyKitRecipe) -> TinyKit | None:
    """The kit already in `root` if it was built from `recipe`; None if `root` is absent or empty."""
    if not root.exists() or (root.is_dir() and not any(root.iterdir())):
        return None
    manifest_path = root / KIT_MANIFEST
    if not manifest_path.is_file():
        raise ConfigError(
            f"{root} exists but holds no complete tiny kit; pick another directory or delete it"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataFormatError(f"{manifest_path}: unreadable kit manifest ({exc}); delete {root}") from None
    want = {"format_version": KIT_FORMAT_VERSION, "recipe": recipe.manifest_json()}
    if {k: manifest.get(k) for k in want} != want:
        raise ConfigError(f"{root} holds a tiny kit of another recipe; pick another directory or delete it")
    rels = list(manifest["files"])
    for rel in rels:
        if not (root / rel).is_file():
            raise DataFormatError(f"{root / rel}: missing or changed since the kit was built; delete {root}")
    for rel, digest in zip(rels, _sha256_all([root / rel for rel in rels]), strict=True):
        if digest != manifest["files"][rel]:
            raise DataFormatError(f"{root / rel}: missing or changed since the kit was built; delete {root}")
    return TinyKit.at(root)


def _build(tmp: Path, recipe: TinyKitRecipe) -> dict[str, Any]:
    tokenizer = build_tokenizer(recipe)
    kit = TinyKit.at(tmp)
    param_count = _save_model(kit.model_dir, recipe, tokenizer)
    kit.train.parent.mkdir()
    rows = make_datasets(recipe)
    for split in SPLITS:
        _write_jsonl(getattr(kit, split), rows[split])
    for p in tmp.rglob("*"):  # safetensors writes 0600 files; the kit is meant to be shared
        p.chmod(0o755 if p.is_dir() else 0o644)
    paths = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
    files = {p.relative_to(tmp).as_posix(): d for p, d in zip(paths, _sha256_all(paths), strict=True)}
    manifest = {
        "format_version": KIT_FORMAT_VERSION,
        "recipe": recipe.manifest_json(),
        "tokenizer_vocab_size": len(tokenizer),
        "model_vocab_size": padded_vocab_size(len(tokenizer), recipe.model.vocab_multiple),
        "param_count": param_count,
        "model_dir": kit.model_dir.relative_to(tmp).as_posix(),
        "data": {split: getattr(kit, split).relative_to(tmp).as_posix() for split in SPLITS},
        "files": files,
    }
    # Written last: its presence is what marks the kit complete.
    (tmp / KIT_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def make_tiny_kit(out_dir: str | Path, recipe: TinyKitRecipe | None = None) -> TinyKit:
    """Build the kit into `out_dir` (no network, deterministic); return at once if it is already there."""
    recipe = recipe or load_recipe()
    root = Path(out_dir).absolute()
    if (kit := _existing_kit(root, recipe)) is not None:
        logger.info("tiny kit already present at %s", root)
        return kit
    root.parent.mkdir(parents=True, exist_ok=True)
    # Build in a hidden sibling and rename it into place, so a crash never leaves a half kit at `root`.
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        manifest = _build(tmp, recipe)
        tmp.chmod(0o755)  # mkdtemp makes it private
        with contextlib.suppress(OSError):
            root.rmdir()  # only succeeds on the empty directory _existing_kit accepted
        try:
            os.rename(tmp, root)
        except OSError:
            # Another process published first; accept its kit if it has our recipe.
            if (kit := _existing_kit(root, recipe)) is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return kit
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("built tiny kit at %s (%d params)", root, manifest["param_count"])
    return TinyKit.at(root)
