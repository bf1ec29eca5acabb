"""Tests of the tiny model kit (slime/data/tiny.py): tokenizer, chat template, checkpoint, data, manifest."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from slime.data import tiny
from slime.data.tiny import TinyKit, TinyKitRecipe, build_tokenizer, load_recipe, make_tiny_kit
from slime.errors import ConfigError, DataFormatError

IM_START, IM_END, PAD, UNK = 257, 258, 256, 259  # ids fixed by the tokenizer's vocab order


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


TEST_RECIPE = Path(__file__).resolve().parents[1] / "tiny_kit_recipe.yaml"


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> TinyKit:
    """The test suite's kit (1-4 digit + and -: every tier and op of the generator in play)."""
    return make_tiny_kit(tmp_path_factory.mktemp("kit") / "tiny", load_recipe(TEST_RECIPE))


def _manifest(kit: TinyKit) -> dict:
    return json.loads(kit.manifest.read_text())


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _b(text: str) -> list[int]:
    """Expected ids of plain text: the vocab maps each byte to the id of the same value."""
    return list(text.encode("utf-8"))


# --- tokenizer ----------------------------------------------------------------------------------------

TRICKY = [
    "",
    " ",
    "  two leading, two trailing  ",
    "a\nb\n\n\nc\n",
    " \n \n",
    "12+34=",
    "x  y   z",
    "!\"#$%&'()*+,-./:;<>?@[\\]^_`{|}~",
    "tab\tcafé über 世界 🙂",
    "I'm what's 's 'll",  # Qwen2's split regex treats contractions specially
]


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids == _b(text)


def test_every_ascii_char_is_one_token(tok) -> None:
    chars = "\n" + "".join(chr(c) for c in range(32, 127))
    ids = [tok.encode(c, add_special_tokens=False) for c in chars]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == len(chars)


def test_special_tokens(tok) -> None:
    assert len(tok) == 260
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", IM_END)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", PAD)
    assert (tok.unk_token, tok.unk_token_id) == ("<|unk|>", UNK)
    assert tok.bos_token is None
    assert tok.convert_tokens_to_ids("<|im_start|>") == IM_START
    # Special tokens in text are single tokens; encode adds no BOS/EOS of its own.
    assert tok.encode("<|im_start|>a<|im_end|>") == [IM_START, ord("a"), IM_END]
    assert tok.decode([IM_START, ord("a"), IM_END], skip_special_tokens=True) == "a"


# --- chat template ------------------------------------------------------------------------------------

CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "10-4="},
    {"role": "assistant", "content": "6"},
]


def test_chat_template_text(tok) -> None:
    text = tok.apply_chat_template(CONVO, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n1+2=<|im_end|>\n"
        "<|im_start|>assistant\n3<|im_end|>\n"
        "<|im_start|>user\n10-4=<|im_end|>\n"
        "<|im_start|>assistant\n6<|im_end|>\n"
    )


def test_assistant_mask(tok) -> None:
    out = tok.apply_chat_template(CONVO, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    # Build the expected ids segment by segment; 1 marks what the assistant wrote (content + <|im_end|>).
    segments: list[tuple[list[int], int]] = [
        ([IM_START, *_b("system\nBe brief."), IM_END, *_b("\n")], 0),
        ([IM_START, *_b("user\n1+2="), IM_END, *_b("\n")], 0),
        ([IM_START, *_b("assistant\n")], 0),
        ([*_b("3"), IM_END], 1),
        (_b("\n"), 0),
        ([IM_START, *_b("user\n10-4="), IM_END, *_b("\n")], 0),
        ([IM_START, *_b("assistant\n")], 0),
        ([*_b("6"), IM_END], 1),
        (_b("\n"), 0),
    ]
    assert out["input_ids"] == [i for ids, _ in segments for i in ids]
    assert out["assistant_masks"] == [m for ids, m in segments for _ in ids]
    assert sum(out["assistant_masks"]) == 4


def test_generation_prompt(tok) -> None:
    text = tok.apply_chat_template(
        [{"role": "user", "content": "5+5="}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\n5+5=<|im_end|>\n<|im_start|>assistant\n"
    assert not tok.apply_chat_template(CONVO[:2], tokenize=False).endswith("<|im_start|>assistant\n")


def test_tools_and_tool_calls(tok) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "2+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2}}}],
        },
        {"role": "tool", "content": "4"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nUse tools.\n\n")
    assert (
        '<tools>\n{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n</tools>'
        in system
    )
    assert rest == (
        "<|im_start|>user\n2+2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n4<|im_end|>\n"
    )
    assert text.count("<|im_start|>system") == 1  # the system message is merged into the tools block


# --- checkpoint and manifest -----------------------------------------------------------------------------


def test_loads_offline_and_runs(kit: TinyKit, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(kit.model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(kit.model_dir, local_files_only=True)
    # The reloaded tokenizer (transformers rebuilds it as Qwen2Tokenizer) must match the in-memory one.
    assert tok.backend_tokenizer.to_str() == build_tokenizer().backend_tokenizer.to_str()
    assert tok.encode("12 + 34 =\n") == _b("12 + 34 =\n")
    assert tok.apply_chat_template(CONVO, tokenize=False) == build_tokenizer().apply_chat_template(
        CONVO, tokenize=False
    )
    cfg = model.config
    assert cfg.model_type == "qwen2" and model.dtype == torch.float32
    assert cfg.vocab_size == 384 and cfg.vocab_size % 128 == 0 and cfg.vocab_size >= len(tok)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        128,
        4,
        4,
        2,
    )
    assert cfg.rope_parameters["rope_theta"] == 10000.0 and cfg.tie_word_embeddings
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (IM_END, PAD, PAD)
    assert model.generation_config.eos_token_id == IM_END
    ids = torch.tensor([tok.encode("123+45=")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_param_count(kit: TinyKit) -> None:
    from safetensors.torch import load_file

    n = sum(t.numel() for t in load_file(kit.model_dir / "model.safetensors").values())
    manifest = _manifest(kit)
    assert manifest["param_count"] == n  # tied lm_head is not stored twice
    assert 300_000 <= n <= 5_000_000
    assert (manifest["tokenizer_vocab_size"], manifest["model_vocab_size"]) == (260, 384)


def test_manifest_lists_every_file(kit: TinyKit) -> None:
    manifest = _manifest(kit)
    on_disk = {p.relative_to(kit.root).as_posix() for p in kit.root.rglob("*") if p.is_file()} - {"kit.json"}
    assert set(manifest["files"]) == on_disk
    for rel, digest in manifest["files"].items():
        assert hashlib.sha256((kit.root / rel).read_bytes()).hexdigest() == digest
    assert manifest["recipe"] == load_recipe(TEST_RECIPE).manifest_json()
    assert kit.root / manifest["model_dir"] == kit.model_dir
    assert [kit.root / manifest["data"][s] for s in ("train", "eval", "sft")] == [
        kit.train,
        kit.eval,
        kit.sft,
    ]
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"} <= {
        p.name for p in kit.model_dir.iterdir()
    }


def test_deterministic(kit: TinyKit, tmp_path: Path) -> None:
    other = make_tiny_kit(tmp_path / "again", load_recipe(TEST_RECIPE))
    assert _manifest(other)["files"] == _manifest(kit)["files"]
    assert (other.model_dir / "model.safetensors").read_bytes() == (
        kit.model_dir / "model.safetensors"
    ).read_bytes()
    assert other.manifest.read_bytes() == kit.manifest.read_bytes()


def test_model_init_depends_only_on_seed(tmp_path: Path) -> None:
    import torch

    small = {"model": {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}}
    weights = {}
    for name, seed in [("a", 1), ("b", 1), ("c", 2)]:
        torch.rand(3)  # advance the global RNG: the init must not depend on it
        state = torch.random.get_rng_state()
        tiny._save_model(
            tmp_path / name, TinyKitRecipe.model_validate({**small, "seed": seed}), build_tokenizer()
        )
        assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is left alone
        weights[name] = (tmp_path / name / "model.safetensors").read_bytes()
    assert weights["a"] == weights["b"] != weights["c"]


def test_different_seed_differs() -> None:
    a, b = tiny.make_datasets(TinyKitRecipe()), tiny.make_datasets(TinyKitRecipe(seed=7))
    assert a["train"] != b["train"] and a["eval"] != b["eval"]


# --- data ------------------------------------------------------------------------------------------------


def _check_problem(row: dict) -> None:
    meta = row["metadata"]
    a, b, op, digits = meta["a"], meta["b"], meta["op"], meta["digits"]
    assert row["prompt"] == f"{a}{op}{b}="
    assert int(row["label"]) == (a + b if op == "+" else a - b)
    assert row["label"] == str(int(row["label"]))  # canonical integer text, nothing else
    assert len(str(a)) == len(str(b)) == digits
    assert int(row["label"]) >= 0  # allow_negative is false in the default recipe


def test_labels_are_correct(kit: TinyKit) -> None:
    train, evals = _jsonl(kit.train), _jsonl(kit.eval)
    assert (len(train), len(evals)) == (2000, 200)
    for row in train + evals:
        assert set(row) == {"prompt", "label", "metadata"}
        _check_problem(row)
    assert {r["metadata"]["op"] for r in train} == {"+", "-"}
    assert {r["metadata"]["digits"] for r in train} == {1, 2, 3, 4}


def test_sft_format(kit: TinyKit) -> None:
    sft = _jsonl(kit.sft)
    assert len(sft) == 2000
    for row in sft:
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", user["content"]).groups()
        assert int(assistant["content"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_eval_disjoint_from_train_and_sft(kit: TinyKit) -> None:
    evals = [r["prompt"] for r in _jsonl(kit.eval)]
    train = {r["prompt"] for r in _jsonl(kit.train)}
    sft = {r["messages"][0]["content"] for r in _jsonl(kit.sft)}
    assert len(set(evals)) == len(evals)
    assert not set(evals) & train
    assert not set(evals) & sft
    tiers = [r["metadata"]["digits"] for r in _jsonl(kit.eval)]
    assert {t: tiers.count(t) for t in set(tiers)} == {1: 50, 2: 50, 3: 50, 4: 50}


def test_harder_eval_tiers_and_impossible_counts() -> None:
    rows = tiny.make_datasets(TinyKitRecipe.model_validate({"data": {"eval_digits": [5, 6], "num_eval": 10}}))
    assert {r["metadata"]["digits"] for r in rows["eval"]} == {5, 6}
    # The 1-digit tier holds only 155 distinct questions with these ops.
    with pytest.raises(ConfigError, match="cannot draw"):
        tiny.make_datasets(TinyKitRecipe.model_validate({"data": {"eval_digits": [1], "num_eval": 200}}))


# --- kit directory handling ------------------------------------------------------------------------------


def test_idempotent(kit: TinyKit, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p: p.stat().st_mtime_ns for p in kit.root.rglob("*")}
    monkeypatch.setattr(tiny, "_build", lambda *a: pytest.fail("rebuilt a kit that was already there"))
    again = make_tiny_kit(kit.root, load_recipe(TEST_RECIPE))
    assert again == kit
    assert {p: p.stat().st_mtime_ns for p in kit.root.rglob("*")} == before


def test_other_recipe_into_same_dir_raises(kit: TinyKit) -> None:
    with pytest.raises(ConfigError, match="another recipe"):
        make_tiny_kit(kit.root, TinyKitRecipe(seed=99))


def test_non_kit_dir_raises_and_empty_dir_is_used(tmp_path: Path) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="no complete tiny kit"):
        make_tiny_kit(tmp_path / "busy")
    small = TinyKitRecipe.model_validate({"data": {"num_train": 5, "num_eval": 4, "num_sft": 5}})
    (tmp_path / "empty").mkdir()
    assert make_tiny_kit(tmp_path / "empty", small).manifest.is_file()


def test_corrupted_kit_is_detected(kit: TinyKit, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(kit.root, copy)
    assert make_tiny_kit(copy, load_recipe(TEST_RECIPE)).root == copy
    with (copy / "data" / "train.jsonl").open("a") as f:
        f.write("\n")
    with pytest.raises(DataFormatError, match="train.jsonl"):
        make_tiny_kit(copy, load_recipe(TEST_RECIPE))


def test_crash_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(recipe):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "make_datasets", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        make_tiny_kit(tmp_path / "kit")
    assert list(tmp_path.iterdir()) == []  # neither the kit nor the temporary sibling


# --- recipe ----------------------------------------------------------------------------------------------


def test_the_default_kit_is_two_digit_addition_on_a_4m_model(tmp_path: Path) -> None:
    """What `make run` trains: the shipped recipe's kit."""
    default = make_tiny_kit(tmp_path / "default")
    manifest = _manifest(default)
    assert 3_500_000 < manifest["param_count"] < 4_500_000
    # kit.json holds the sha256 of every file: the kit is byte for byte what it was before the drawn-weights
    # writer (bf16 kits, test_kit_drawn.py) came in beside the transformers-built float32 model
    assert hashlib.sha256(default.manifest.read_bytes()).hexdigest() == \
        "aef2cb8b0f536b87390c9883dd76212d60386f94a2913a4af2bd76a50fd99030"
    rows = {split: _jsonl(getattr(default, split)) for split in ("train", "eval")}
    assert (len(rows["train"]), len(rows["eval"]), len(_jsonl(default.sft))) == (2000, 200, 4000)
    for row in rows["train"] + rows["eval"]:
        _check_problem(row)
        assert row["metadata"]["op"] == "+" and row["metadata"]["digits"] == 2
    assert not {r["prompt"] for r in rows["eval"]} & {r["prompt"] for r in rows["train"]}


def test_the_moe_kit_is_the_tiny_kits_data_with_a_qwen3_moe(tmp_path: Path) -> None:
    """datasets/tiny-moe/recipe.yaml: the tiny kit's data files, a seeded random Qwen3-MoE of the recipe's shape
    (every layer sparse, top-k renormalised, experts one tensor each as the published checkpoints hold them)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    recipe = load_recipe(tiny.default_recipe_path().parents[1] / "tiny-moe" / "recipe.yaml")
    assert recipe.data == load_recipe().data and recipe.seed == load_recipe().seed
    assert recipe.model.model_copy(update={"moe": None}) == load_recipe().model
    moe = make_tiny_kit(tmp_path / "moe", recipe)
    dense = make_tiny_kit(tmp_path / "dense")
    for split in ("train", "eval", "sft"):
        assert getattr(moe, split).read_bytes() == getattr(dense, split).read_bytes()
    config = AutoConfig.from_pretrained(moe.model_dir)
    assert config.model_type == "qwen3_moe" and config.norm_topk_prob and config.mlp_only_layers == []
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 512)
    assert config.head_dim == 32 and config.tie_word_embeddings and config.vocab_size == 384
    weights = load_file(moe.model_dir / "model.safetensors")
    assert weights["model.layers.3.mlp.experts.7.down_proj.weight"].shape == (256, 512)
    assert weights["model.layers.0.mlp.gate.weight"].shape == (8, 256)
    manifest = _manifest(moe)
    assert manifest["recipe"]["model"]["moe"] == {"num_experts": 8, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 512}
    assert "moe" not in _manifest(dense)["recipe"]["model"]  # dense kits' kit.json as before the field
    # byte for byte the kit built before the GLM-4.5 fields (model_type, n_group, ...) came into `model.moe`
    assert hashlib.sha256(moe.manifest.read_bytes()).hexdigest() == \
        "c607af9f7ff2d094237fd76a210e2961939c9f0008c0a6fcbc4c16312fffe071"
    assert make_tiny_kit(tmp_path / "again", recipe).manifest.read_bytes() == moe.manifest.read_bytes()


def test_the_glm_kit_is_the_tiny_kits_data_with_a_glm4_moe(tmp_path: Path) -> None:
    """datasets/tiny-glm/recipe.yaml: the tiny kit's data files, a seeded random GLM-4.5 of the recipe's shape, every
    GLM-4.5 trait set (random_models.glm4_moe_config), its expert bias drawn (non-zero, seeded)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    recipe = load_recipe(tiny.default_recipe_path().parents[1] / "tiny-glm" / "recipe.yaml")
    assert recipe.data == load_recipe().data and recipe.seed == load_recipe().seed
    glm = make_tiny_kit(tmp_path / "glm", recipe)
    dense = make_tiny_kit(tmp_path / "dense")
    for split in ("train", "eval", "sft"):
        assert getattr(glm, split).read_bytes() == getattr(dense, split).read_bytes()
    config = AutoConfig.from_pretrained(glm.model_dir)
    assert config.model_type == "glm4_moe" and config.norm_topk_prob and config.num_nextn_predict_layers == 0
    assert (config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 256)
    assert (config.n_shared_experts, config.first_k_dense_replace, config.n_group, config.topk_group) == (1, 1, 2, 1)
    assert config.routed_scaling_factor == 2.5 and config.rope_parameters["partial_rotary_factor"] == 0.5
    assert config.use_qk_norm and config.attention_bias and not config.tie_word_embeddings
    assert config.head_dim == 32 and config.vocab_size == 384 and config.intermediate_size == 1024
    weights = load_file(glm.model_dir / "model.safetensors")
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (1024, 256)  # the dense first layer
    assert "model.layers.0.mlp.gate.weight" not in weights
    assert weights["model.layers.3.mlp.experts.7.down_proj.weight"].shape == (256, 256)
    assert weights["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (256, 256)
    biases = [weights[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in (1, 2, 3)]
    assert all(b.shape == (8,) and (b != 0).all() and 0.02 < b.std() < 0.5 for b in biases)  # N(0, 0.1^2)
    assert not biases[0].equal(biases[1])
    manifest = _manifest(glm)
    assert manifest["recipe"]["model"]["moe"]["model_type"] == "glm4_moe"
    assert manifest["recipe"]["model"]["moe"]["expert_bias_scale"] == 0.1
    assert make_tiny_kit(tmp_path / "again", recipe).manifest.read_bytes() == glm.manifest.read_bytes()


def test_default_recipe_file_matches_model_defaults() -> None:
    # Every field is spelled out in the YAML; they must agree with the code's defaults.
    raw = load_recipe()
    assert raw == TinyKitRecipe()
    assert not (tiny.default_recipe_path().parents[1] / "__init__.py").exists()  # datasets/ is no package


@pytest.mark.parametrize(
    ("yaml_text", "field"),
    [
        ("seed: 1\nmodel:\n  hidden_size: -4\n", "model.hidden_size"),
        ("data:\n  ops: ['/']\n", "data.ops.0"),
        ("data:\n  num_trian: 10\n", "data.num_trian"),
        ("model:\n  num_attention_heads: 3\n", "model"),
        ("model:\n  moe:\n    num_experts: 2\n    num_experts_per_tok: 3\n", "model.moe"),
        ("model:\n  moe:\n    num_expert: 8\n", "model.moe.num_expert"),
        ("model:\n  moe:\n    n_group: 2\n", "model.moe"),  # a GLM-4.5 field on a qwen3_moe
        ("model:\n  moe:\n    model_type: glm4_moe\n    n_group: 3\n", "model.moe"),
        ("model:\n  moe:\n    model_type: glm4_moe\n    n_group: 4\n    topk_group: 1\n    num_experts_per_tok: 3\n",
         "model.moe"),
        ("model:\n  num_hidden_layers: 1\n  moe:\n    model_type: glm4_moe\n", "model"),
        ("model:\n  moe:\n    model_type: deepseek_v3\n", "model.moe.model_type"),
    ],
)
def test_bad_recipe_field(tmp_path: Path, yaml_text: str, field: str) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    assert str(path) in str(info.value)
    assert f"field '{field}'" in str(info.value)


def test_missing_or_malformed_recipe(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_recipe(tmp_path / "list.yaml")


def test_worked_multiplication_answers_check_out() -> None:
    text = tiny.worked_answer(347, "*", 86)
    assert text == "347*6=2082\n347*80=27760\n2082+27760=29842\n\\boxed{29842}"
    for a, b in [(305, 104), (99, 10), (7, 8), (123, 999)]:
        lines = tiny.worked_answer(a, "*", b).split("\n")
        assert lines[-1] == f"\\boxed{{{a * b}}}"
        for line in lines[:-1]:  # every step is true arithmetic
            left, right = line.split("=")
            x, op, y = re.fullmatch(r"(\d+)([*+])(\d+)", left).groups()
            assert int(right) == (int(x) * int(y) if op == "*" else int(x) + int(y)), line
    assert tiny.worked_answer(12, "+", 30) == "\\boxed{42}"


def test_worked_steps_kit_data() -> None:
    recipe = TinyKitRecipe.model_validate({"data": {"ops": ["*"], "worked_steps": True, "train_digits": [2, 3],
                                                    "eval_digits": [3], "num_train": 20, "num_eval": 10,
                                                    "num_sft": 30}})
    rows = tiny.make_datasets(recipe)
    for row in rows["sft"]:
        prompt, answer = row["messages"][0]["content"], row["messages"][1]["content"]
        a, b = map(int, prompt.rstrip("=").split("*"))
        assert answer == tiny.worked_answer(a, "*", b)
    assert all(r["label"] == str(r["metadata"]["a"] * r["metadata"]["b"]) for r in rows["eval"])
    assert {r["metadata"]["digits"] for r in rows["eval"]} == {3}
