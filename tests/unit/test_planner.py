"""`draftsmith plan`: exact parameter, gradient and optimizer counts against real modules, the activation estimate
against tensors measured on CPU, recipe reading and the command's output."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.planner import PRESETS, Shape, drafter_activation_bytes, estimate, main, parse_bytes, plan_from_recipe
from trainer.training.objective import DraftObjective
from trainer.training.optimizers import Optim

ROOT = Path(__file__).resolve().parents[2]
KD = str(ROOT / "recipes" / "quickstart" / "kd.yaml")

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)


def _llama(**config) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa"))


@pytest.mark.parametrize(
    "config",
    [
        TINY,
        dict(TINY, tie_word_embeddings=True),
        dict(TINY, num_key_value_heads=4, head_dim=32, attention_bias=True),
        dict(TINY, hidden_size=96, intermediate_size=200, num_hidden_layers=3, mlp_bias=True),
    ],
)
def test_parameter_count_is_exact(config):
    model = _llama(**config)
    assert Shape.from_config(model.config.to_dict()).parameters() == sum(p.numel() for p in model.parameters())


def test_presets_match_the_published_sizes():
    assert Shape.from_config(PRESETS["llama-3-8b"]).parameters() == 8_030_261_248
    assert Shape.from_config(PRESETS["llama-3-70b"]).parameters() == 70_553_706_496
    assert Shape.from_config(PRESETS["llama-3.2-1b"]).parameters() == 1_235_814_400


def test_weights_grads_and_adamw_states_match_a_real_step():
    model = _llama(**TINY)
    shape = Shape.from_config(model.config.to_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.randint(0, 512, (2, 16)), labels=torch.randint(0, 512, (2, 16))).loss.backward()
    optimizer.step()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    states = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    by_stage = {e.stage: e for e in estimate(shape, shape, batch=2, seq=16, gpus=4, precision="32-true")}
    assert by_stage["ddp"].drafter_weights == weights and by_stage["ddp"].gradients == grads
    assert by_stage["ddp"].optimizer == states
    # each stage shards one more part across the 4 ranks; DeepSpeed's optimizer adds its fp32 master partition (a
    # clone of the fp32 weights) to AdamW's moments, and keeps that partition's fp32 gradient and two gradient buckets
    params = sum(p.numel() for p in model.parameters())
    assert by_stage["zero1"].optimizer == -(-(states + weights) // 4) and by_stage["zero1"].gradients == grads
    assert by_stage["zero2"].gradients == -(-grads // 4) and by_stage["zero2"].drafter_weights == weights
    assert by_stage["zero3"].drafter_weights == -(-weights // 4)
    assert by_stage["zero3"].target_weights < by_stage["zero2"].target_weights
    # AdamW's foreach step: the square roots of the second moments, one copy of the parameters it updates
    assert by_stage["ddp"].buffers == weights
    assert by_stage["zero1"].buffers == by_stage["zero2"].buffers == 2 * -(-grads // 4) + 2 * params * 4
    assert by_stage["zero3"].buffers == 2 * -(-grads // 4)


@pytest.mark.parametrize(
    "batch, seq, config", [(2, 64, TINY), (4, 128, dict(TINY, hidden_size=128, intermediate_size=344))]
)
def test_activation_estimate_against_measured_saved_tensors(batch, seq, config):
    """The tensors autograd keeps for backward (distinct storages, measured on CPU) within 0.8x-1.25x of the plan."""
    model = _llama(**config)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 512, (batch, seq))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # [B, S, H]
    measured = sum(n for ptr, n in seen.items() if ptr not in params)
    planned = drafter_activation_bytes(Shape.from_config(model.config.to_dict()), batch, seq, act_bytes=4)
    assert hidden.shape == (batch, seq, config["hidden_size"])
    print(f"activations measured {measured} planned {planned} ratio {measured / planned:.2f}")
    assert 0.8 * planned <= measured <= 1.25 * planned, (measured, planned)


def test_recipe_reading_applies_drafter_config(tmp_path):
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(dict(TINY, model_type="llama")))
    plan = plan_from_recipe([KD], target_config=str(target_dir))
    # kd.yaml: a 2-layer, hidden-128 student with the target's vocabulary; batch 8 x 256, fp32
    assert plan.drafter.num_hidden_layers == 2 and plan.drafter.hidden_size == 128
    assert plan.drafter.vocab_size == 512 and plan.drafter.head_dim == 32
    assert (plan.batch, plan.seq, plan.precision) == (8, 256, "32-true")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  init_args:\n    drafter_config:\n      num_hiden_layers: 2\n")
    with pytest.raises(ValueError, match="num_hiden_layers"):
        plan_from_recipe([KD, str(bad)], target="llama-3-8b")
    with pytest.raises(ValueError, match="llama-9b"):
        plan_from_recipe([KD], target="llama-9b")


@pytest.mark.parametrize("recipe", ["kd.yaml", "on_policy.yaml", "kd_offline.yaml"])
def test_quickstart_recipes_plan_without_their_artifacts(recipe, tmp_path, monkeypatch, capsys):
    """The recipes name artifacts/tiny_target, absent here: the recipe parses, the target shape is the preset's."""
    monkeypatch.chdir(tmp_path)
    path = str(ROOT / "recipes" / "quickstart" / recipe)
    seq = ["--seq_len", "128"] if "offline" in recipe else []  # a ShardDataModule's length is in its shards
    assert main(["--config", path, "--gpus", "2", "--target", "llama-3.2-1b", *seq]) == 0
    out = capsys.readouterr().out
    assert "fits:" in out and "| zero3 |" in out
    plan = plan_from_recipe([path], target="llama-3.2-1b", seq=128 if seq else None)
    assert plan.target == Shape.from_config(PRESETS["llama-3.2-1b"])
    assert (plan.drafter.num_hidden_layers, plan.drafter.hidden_size) == (2, 128)
    assert (plan.batch, plan.seq, plan.precision, plan.chunk_size) == (8, 128 if seq else 256, "32-true", 512)
    if "offline" in recipe:
        assert main(["--config", path, "--gpus", "2", "--target", "llama-3.2-1b"]) == 2
        assert "seq_len" in capsys.readouterr().err


def test_composed_recipe_and_fit_arguments(tmp_path):
    ddp = str(ROOT / "recipes" / "_base" / "ddp.yaml")
    plan = plan_from_recipe([KD, ddp], target="llama-3-8b", overrides=["--data.init_args.batch_size", "3"])
    assert plan.batch == 3 and plan.seq == 256 and plan.chunk_size == 512
    with pytest.raises(ValueError, match="batch_sise"):
        plan_from_recipe([KD, ddp], target="llama-3-8b", overrides=["--data.init_args.batch_sise", "3"])


def test_what_a_recipe_omits_comes_from_the_signatures(tmp_path):
    """A recipe without loss_chunk_size, batch_size, seq_len and precision: the KD objective's, the datamodule's and
    the Trainer's defaults, as fit would use them."""
    from trainer.data.text import TextDataModule
    from trainer.methods.draft_model.kd import KnowledgeDistillation

    lines = Path(KD).read_text().splitlines()
    dropped = ("loss_chunk_size:", "batch_size:", "seq_len:", "precision:")
    bare = tmp_path / "bare.yaml"
    bare.write_text("\n".join(line for line in lines if not line.strip().startswith(dropped)) + "\n")
    plan = plan_from_recipe([str(bare)], target="llama-3-8b")

    def default(cls, name):
        return inspect.signature(cls.__init__).parameters[name].default

    assert plan.chunk_size == default(KnowledgeDistillation, "loss_chunk_size")
    assert plan.batch == default(TextDataModule, "batch_size") and plan.seq == default(TextDataModule, "seq_len")
    assert plan.precision == "32-true"  # Lightning's default precision (None) resolves to 32-true
    # what a recipe sets wins over the default
    sets = tmp_path / "sets.yaml"
    sets.write_text("model:\n  init_args:\n    loss_chunk_size: 64\ndata:\n  init_args:\n    seq_len: 32\n")
    plan = plan_from_recipe([str(bare), str(sets)], target="llama-3-8b")
    assert (plan.chunk_size, plan.seq) == (64, 32)


def test_command_prints_the_table_and_what_fits(capsys):
    assert (
        main(
            [
                "--config",
                KD,
                "--gpus",
                "8",
                "--gpu_memory",
                "80GB",
                "--target",
                "llama-3-70b",
                "--precision",
                "bf16-mixed",
                "--batch_size",
                "1",
                "--seq_len",
                "2048",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"ddp", "zero1", "zero2", "zero3"}
    # a 70B bf16 target (131 GiB) fits 80 GB GPUs only when ZeRO-3 partitions it
    assert rows["ddp"].rstrip().endswith("| no |") and rows["zero3"].rstrip().endswith("| yes |")
    assert out.strip().splitlines()[-1] == "fits: zero3"
    assert main(["--config", KD, "--gpus", "1", "--gpu_memory", "lots"]) == 2
    assert "lots" in capsys.readouterr().err
    assert parse_bytes("80GB") == 80 * 1024**3 and parse_bytes("512MiB") == 512 * 1024**2


# ---------------------------------------------------------------------------------------------- every method's recipe

QUICKSTART = ROOT / "recipes" / "quickstart"
# recipes the planner builds from a target alone (mtp_extend and mtp_refresh start from another run's checkpoint;
# the precompute recipes are not fit recipes)
BUILDABLE = sorted(
    p.name
    for p in QUICKSTART.glob("*.yaml")
    if "precompute" not in p.name and p.name not in ("mtp_extend.yaml", "mtp_refresh.yaml")
)


@pytest.fixture(scope="module")
def random_target(tiny_corpus, tmp_path_factory):
    """A random 4-layer Llama (the quickstart recipes' target layers need 4) with the tiny corpus' tokenizer."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("plan_target")
    tok = AutoTokenizer.from_pretrained(tiny_corpus.tokenizer_dir)
    _llama(**dict(TINY, vocab_size=len(tok), num_hidden_layers=4, max_position_embeddings=512)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _overrides(recipe: Path, target: Path, tokenizer: str) -> list[str]:
    from trainer.training.recipe import parse_recipe

    model = parse_recipe([str(recipe)]).model.init_args
    out = []
    if model.get("target"):
        out += ["--model.init_args.target", str(target)]
    if "tokenizer" in model and model.get("tokenizer"):
        out += ["--model.init_args.tokenizer", tokenizer]
    if "draft_vocab_size" in model:
        out += ["--model.init_args.draft_vocab_size", "256"]  # the random target has 512 tokens
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILDABLE)
def test_every_method_counts_what_its_objective_builds(name, random_target, tiny_corpus, one_thread):
    """The planner's counts (objective built on the meta device) equal the objective built for real from the target's
    weights: trained parameters and their bytes, frozen elements, for every method's quickstart recipe."""
    from trainer.planner.build import init_arguments, objective_class
    from trainer.training.recipe import parse_recipe

    recipe = QUICKSTART / name
    overrides = _overrides(recipe, random_target, str(tiny_corpus.tokenizer_dir))
    seq = 64 if "offline" in name else None
    plan = plan_from_recipe([str(recipe)], seq=seq, overrides=overrides)
    parsed = parse_recipe([str(recipe)], overrides).model
    built = objective_class(parsed.class_path)(**init_arguments(parsed.init_args))
    trained = [p for p in built.trainable_module().parameters() if p.requires_grad]
    assert plan.counts.method == type(built).__name__
    assert plan.counts.trainable == sum(p.numel() for p in trained) > 0
    assert plan.counts.trainable_bytes == sum(p.numel() * p.element_size() for p in trained)
    assert plan.activations > 0
    (ddp, zero1, zero2, zero3) = plan.estimates(2)
    assert ddp.gradients == plan.counts.trainable_bytes and ddp.optimizer == 2 * plan.counts.trainable_bytes
    assert zero3.total <= zero2.total <= zero1.total + zero2.buffers - zero1.buffers


FIT_RECIPES = sorted(p for p in QUICKSTART.glob("*.yaml") if p.read_text().startswith("# draftsmith fit"))


@pytest.mark.parametrize("recipe", FIT_RECIPES, ids=lambda p: p.stem)
def test_every_quickstart_recipe_plans_through_its_objectives_estimate(recipe, tiny_corpus, capsys):
    """Every quickstart fit recipe plans from a preset target, its activations the objective's own estimate (the
    planner names no objective class). A recipe that starts from another run's checkpoint (init_from) is refused
    naming it, and plans without it but for mtp_extend, which copies the checkpoint's first module."""
    from trainer.planner.build import objective_class
    from trainer.training.recipe import parse_recipe

    model = parse_recipe([str(recipe)]).model
    cls = objective_class(model.class_path)
    assert cls.activation_bytes is not DraftObjective.activation_bytes, f"{cls.__name__} has no activation estimate"
    fit = ["--model.init_args.tokenizer", str(tiny_corpus.tokenizer_dir)] if model.init_args.get("tokenizer") else []
    command = ["--config", str(recipe), "--gpus", "2", "--target", "llama-3.2-1b", "--seq_len", "128", "--", *fit]
    if model.init_args.get("init_from"):
        assert main(command) == 2 and f"{model.init_args.init_from!r} does not exist" in capsys.readouterr().err
        command += ["--model.init_args.init_from", "null"]
    status = main(command)
    out, err = capsys.readouterr()
    if recipe.name == "mtp_extend.yaml":
        assert status == 2 and "no model.init_from is given" in err
        return
    assert status == 0, err
    assert out.startswith(f"{cls.__name__}: trained ") and "| zero3 |" in out


class Unplanned(DraftObjective):
    """An objective that states no activation estimate (as a new method might forget to)."""

    def __init__(self, target: str, optim: Optim = Optim()) -> None:
        """
        Args:
            target: the target.
            optim: optimizer and learning-rate schedule.
        """
        super().__init__(optim)
        self.load_target(target)
        self.head = torch.nn.Linear(4, 4)

    def trainable_module(self) -> torch.nn.Module:
        return self.head


def test_an_objective_without_an_estimate_is_refused_by_name(tmp_path, capsys):
    recipe = tmp_path / "unplanned.yaml"
    data = {"tokenizer": "t", "train_files": ["a"], "batch_size": 1, "seq_len": 16}
    recipe.write_text(json.dumps({
        "model": {"class_path": f"{__name__}.Unplanned", "init_args": {"target": "t"}},
        "data": {"class_path": "trainer.data.text.TextDataModule", "init_args": data},
    }))  # fmt: skip
    assert main(["--config", str(recipe), "--gpus", "1", "--target", "llama-3.2-1b"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: draftsmith plan: Unplanned has no activation estimate: it does not implement "
        "DraftObjective.activation_bytes (docs/developer/add-a-method.md)"
    ]


def test_one_process_estimate_follows_lightning_precision():
    """A CPU fit (one process, DDP row): fp32-built trained weights stay fp32 under bf16-mixed, with AdamW's two
    moments in their dtype and autocast's bf16 copy; bf16-true casts the module tree (trained and in-tree frozen)."""
    from trainer.planner import Counts, estimate_counts

    counts = Counts("X", trainable=1000, trainable_bytes=4000, frozen=500, frozen_bytes=1000, frozen_in_tree=100,
                    frozen_in_tree_bytes=400)  # fmt: skip
    (mixed,) = estimate_counts(counts, 10, 1, "bf16-mixed")[:1]
    assert (mixed.drafter_weights, mixed.gradients, mixed.optimizer) == (4000, 4000, 8000)
    assert mixed.activations == 10 + 2000 and mixed.target_weights == 1000
    (true,) = estimate_counts(counts, 10, 1, "bf16-true")[:1]
    assert (true.drafter_weights, true.optimizer, true.activations) == (2000, 4000, 10)
    assert true.target_weights == (1000 - 400) + 200


def test_real_recipes_plan_from_their_published_configs(capsys, tmp_path):
    """Every real-model fit recipe plans against its target's published config (tests/fixtures/real_configs); a
    pretrained drafter named by hub id (the KD student) by the planner's preset of its shape, a recipe from shards at
    the rows its precompute recipe writes."""
    from trainer.planner.shapes import PRESETS

    configs = ROOT / "tests" / "fixtures" / "real_configs"
    student = tmp_path / "llama-3.2-1b"
    student.mkdir()
    (student / "config.json").write_text(json.dumps({"model_type": "llama", **PRESETS["llama-3.2-1b"]}))
    (tmp_path / "student.yaml").write_text(f"model:\n  init_args:\n    drafter: {student}\n")
    recipes = [p for p in sorted((ROOT / "recipes").glob("*_*.yaml")) if p.read_text().startswith("# draftsmith fit")]
    for recipe in recipes:
        key = next(k for k in ("llama31_8b", "qwen3_8b", "qwen3_5_9b") if k in recipe.name)
        argv = ["--config", str(recipe), "--gpus", "8", "--target", str(configs / key), "--cpu"]
        if "drafter: meta-llama/" in recipe.read_text():
            argv += ["--config", str(tmp_path / "student.yaml"), "--seq_len", "2048"]
        assert main(argv) == 0, recipe
        out = capsys.readouterr().out
        assert "| zero2 |" in out and "one CPU process (bf16-mixed, " in out


# ------------------------------------------------------------------------------------------------- bad inputs


def test_draft_vocabulary_larger_than_the_targets_is_named(tmp_path):
    target = tmp_path / "t"
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(target)
    from trainer.interface.errors import RecipeError

    for recipe in ("eagle3.yaml", "peagle.yaml"):
        with pytest.raises(RecipeError, match=r"model\.draft_vocab_size=600 must be in 1\.\.512"):
            plan_from_recipe([str(QUICKSTART / recipe)], target_config=str(target),
                             overrides=["--model.init_args.draft_vocab_size", "600"])  # fmt: skip


@pytest.mark.parametrize(
    "drop, change, match",
    [
        ("rope_parameters", {}, "has no rope_theta"),
        ("hidden_size", {}, "has no hidden_size"),
        ("head_dim", {"hidden_size": 66, "num_attention_heads": 4, "num_key_value_heads": 2}, "refused by Hugging"),
    ],
)
def test_target_config_missing_a_key_is_named(tmp_path, drop, change, match):
    """A config.json without a key Hugging Face would silently default: refused naming the file and key, before any
    weight is read (the folder holds none)."""
    from trainer.interface.errors import ModelFolderError
    from trainer.models.target import FrozenTarget

    config = LlamaConfig(**TINY).to_dict()
    config.update(change)
    config.pop(drop, None)
    config.pop("rope_theta", None) if drop == "rope_parameters" else None
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match=match) as err:
        FrozenTarget.from_pretrained(str(tmp_path))
    assert "config.json" in str(err.value)


def test_sequence_beyond_the_targets_context_is_named():
    from trainer.interface.errors import RecipeError
    from trainer.models.target import check_context

    config = LlamaConfig(**TINY, max_position_embeddings=128)
    check_context(config, 128, "t")
    with pytest.raises(RecipeError, match=r"data\.seq_len=256 is beyond the context of the target 't': "
                       r"max_position_embeddings=128"):  # fmt: skip
        check_context(config, 256, "t")


def test_bf16_on_a_cpu_without_native_bf16_is_named_and_kept():
    """PyTorch emulates bf16 on such CPUs: the run keeps bf16 (the planner's precision) with a warning naming the
    keys that ask for it; nothing to say on a CPU with native bf16, or without bf16."""
    from trainer.models.target import emulated_bf16_message

    dtypes = {"model.target_dtype": "bfloat16", "model.drafter_dtype": "float32"}
    message = emulated_bf16_message("bf16-mixed", dtypes, native=False)
    assert "trainer.precision=bf16-mixed, model.target_dtype=bfloat16" in message and "emulates" in message
    assert emulated_bf16_message("bf16-mixed", dtypes, native=True) is None
    assert emulated_bf16_message("32-true", {"model.target_dtype": "float32"}, native=False) is None


@pytest.mark.parametrize(
    ("pieces", "stage"),
    [([], "ddp"), (["deepspeed_zero1.yaml"], "zero1"), (["deepspeed_zero3.yaml"], "zero3"), (["fsdp.yaml"], "ddp")],
)
def test_the_cpu_estimate_is_the_row_of_the_recipes_strategy(pieces, stage):
    """``--cpu`` reports the row of the strategy the recipe composes: DeepSpeed's stage, else DDP's."""
    configs = [str(ROOT / "recipes" / "quickstart" / "kd.yaml")] + [str(ROOT / "recipes" / "_base" / p) for p in pieces]
    assert plan_from_recipe(configs, target="llama-3.2-1b").stage == stage


# ------------------------------------------------------------------------------------------------- long rows

LLAMA31_8B = str(ROOT / "tests" / "fixtures" / "real_configs" / "llama31_8b")


def test_dense_ttt_attention_keeps_the_scores_the_plan_counts():
    """EAGLE-3's dense training-time-test attention (what ``auto`` runs on CPU) keeps, for backward, storages of one
    score per query, key and head: measured on CPU in bf16, the score-sized ones (at least a byte a score) are the
    plan's :func:`dense_scores` (float32 probabilities and their bf16 copy) within 0.8x-1.25x."""
    from trainer.methods.eagle3.module import ttt_attention
    from trainer.training.activation_memory import dense_scores

    B, nh, nkv, S, D, i = 2, 4, 2, 64, 8, 2
    torch.manual_seed(0)
    q = torch.randn(B, nh, S, D, dtype=torch.bfloat16, requires_grad=True)  # [B, nh, S, D]
    keys = [torch.randn(B, nkv, S, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(i + 1)]
    values = [torch.randn(B, nkv, S, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(i + 1)]
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ttt_attention(q, keys, values, "dense")  # [B, nh, S, D]
    assert out.shape == (B, nh, S, D)
    measured = sum(n for n in seen.values() if n >= B * nh * S * S)
    planned = dense_scores(B, nh, S, S + i, 2)
    assert 0.8 * planned <= measured <= 1.25 * planned, (measured, planned)


@pytest.mark.parametrize("recipe", ["eagle3_llama31_8b.yaml", "dflash_llama31_8b.yaml"])
def test_long_rows_grow_linearly_fused_and_quadratically_dense(recipe):
    """The 8B recipes at 8k, 16k and 24k tokens: with flex attention (the GPU rows) the activations grow by the same
    bytes for each 8k more tokens (linear in S: no score is kept); dense (the --cpu line, or ``attention: dense``)
    the extra bytes over the flex estimate are the scores per head, naively: EAGLE-3 keeps two TTT steps' float32
    probabilities and bf16 copy ([S, S + 6], recompute) and one step's backward gradients (bf16 + 2 float32); DFlash
    keeps them in each of its 5 layers for its 512 x 16 slots over S + 16 keys, one layer's gradients in flight."""
    flex = ["--model.init_args.attention", "flex"]
    plans = [plan_from_recipe([str(ROOT / "recipes" / recipe)], target_config=LLAMA31_8B, seq=s, overrides=flex)
             for s in (8192, 16384, 24576)]  # fmt: skip
    gpu = [p.activations for p in plans]
    assert gpu[2] - gpu[1] == gpu[1] - gpu[0] > 0
    for plan in plans:
        S, heads = plan.seq, 32
        if recipe.startswith("eagle3"):
            scores = S * (S + 6) * heads  # B = 1
            expected = 2 * scores * (2 + 4) + scores * (2 + 4 + 4)
        else:
            scores = 512 * 16 * (S + 16) * heads
            expected = 5 * scores * (2 + 4) + scores * (2 + 4 + 4)
        assert plan.cpu_activations - plan.activations == expected


def test_sequence_parallel_plans_each_ranks_slice_of_the_row(capsys):
    """``--sequence_parallel P`` (DeepSpeed-Ulysses): each GPU holds S / P positions, so under flex the 8B EAGLE-3.1
    long recipe at S plans what it plans at S / P without sequence parallelism (the TTT phase is the peak); dense, each
    rank keeps the scores of the whole row for 1 / P of the heads (naive count as in the test above). Objectives whose
    estimate does not plan it, and degrees Ulysses cannot run, are refused by name."""
    recipe = [str(ROOT / "recipes" / "eagle3_1_llama31_8b_long.yaml")]
    whole = plan_from_recipe(recipe, target_config=LLAMA31_8B, seq=16384)
    split = plan_from_recipe(recipe, target_config=LLAMA31_8B, seq=32768, sequence_parallel=2)
    assert split.activations == whole.activations
    # without the flag, the recipe's model.sequence_parallel (what fit runs)
    overrides = ["--model.init_args.sequence_parallel", "2"]
    recipe_split = plan_from_recipe(recipe, target_config=LLAMA31_8B, seq=32768, overrides=overrides)
    assert recipe_split.sequence_parallel == 2 and recipe_split.activations == split.activations
    assert whole.sequence_parallel == 1
    S, heads = 32768, 32 // 2
    scores = S * (S + 6) * heads
    assert split.cpu_activations - split.activations == 2 * scores * (2 + 4) + scores * (2 + 4 + 4)
    command = ["--config", recipe[0], "--gpus", "8", "--target", LLAMA31_8B, "--sequence_parallel"]
    assert main([*command, "2"]) == 0
    assert "sequence parallel 2: 16384 positions per GPU" in capsys.readouterr().out
    assert main([*command, "3"]) == 2
    assert "draftsmith plan --sequence_parallel=3 does not divide the attention's 8 key/value heads" in (
        capsys.readouterr().err
    )
    dflash = ["--config", str(ROOT / "recipes" / "dflash_llama31_8b_long.yaml"), *command[2:], "2"]
    assert main(dflash) == 2
    assert "--sequence_parallel 2: DFlash does not plan sequence parallelism" in capsys.readouterr().err
