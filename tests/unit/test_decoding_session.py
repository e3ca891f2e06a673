"""The target session: its own layer loop equals HF's forward, slices compose, self-speculation reuses the cache."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from tests.helpers import tiny_llama, tiny_model
from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import NoProposer, PromptLookupProposer
from trainer.decoding.session import FINAL_PRENORM, TargetSession
from trainer.decoding.tree import DraftTree
from trainer.methods.layerskip.proposer import EarlyExitProposer

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "deepseek_v3"]


def model_of(family: str, seed: int = 0):
    return tiny_llama(seed, vocab=96, layers=3) if family == "llama" else tiny_model(family, seed)


@pytest.mark.parametrize("family", FAMILIES)
def test_own_layer_loop_equals_the_models_forward(family: str) -> None:
    """A committed prefix, then a tree over five more tokens: logits and every hidden state as HF computes them."""
    model = model_of(family)
    session = TargetSession(model)
    assert session.sliced, session.refusal
    L = session.num_layers
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(1))
    session.forward(input_ids=ids[:7])
    session.commit(torch.arange(7))
    tree = DraftTree(tokens=ids[8:12], parents=torch.tensor([-1, 0, 0, 2]))  # root ids[7], a fork after node 0
    out = session.forward(
        input_ids=ids[7:12],
        position_ids=tree.position_ids(7),
        attention_mask=tree.attention_mask(7, torch.float64),
        layers=(0, 1, L, FINAL_PRENORM),
        logits_rows=5,
    )
    for node, path in ((1, [7, 8, 9]), (3, [7, 8, 10, 11])):  # input rows of nodes 1 and 3, each on its own path
        tokens = torch.cat([ids[:7], ids[path]])
        ref = model(input_ids=tokens[None], output_hidden_states=True)
        row = node + 1
        torch.testing.assert_close(out.logits[row], ref.logits[0, -1], rtol=0, atol=1e-10)
        for i in (0, 1, L):
            torch.testing.assert_close(out.layers[i][row], ref.hidden_states[i][0, -1], rtol=0, atol=1e-10)
        # the pre-norm state is the last layer's output: the final norm of it is HF's last hidden state
        normed = model.get_decoder().norm(out.layers[FINAL_PRENORM][row])
        torch.testing.assert_close(normed, ref.hidden_states[L][0, -1], rtol=0, atol=1e-10)


def test_slices_compose_into_the_full_forward() -> None:
    model = tiny_llama(2, vocab=96, layers=4)
    ids = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(2))
    full, split = TargetSession(model), TargetSession(model)
    whole = full.forward(input_ids=ids, logits_rows=9)
    h = split.forward(input_ids=ids, stop=1).hidden  # [9, H] entering layer 1
    h = split.forward(hidden=h, start=1, stop=3).hidden
    assert split.layer_length(0) == 9 and split.layer_length(3) == 0
    with pytest.raises(ValueError, match="different numbers of cache entries"):
        split.forward(hidden=h, start=2)
    part = split.forward(hidden=h, start=3, logits_rows=9)
    torch.testing.assert_close(part.logits, whole.logits, rtol=0, atol=1e-12)
    # early exit through the model's own norm and head at the last layer is the full model's logits
    torch.testing.assert_close(split.logits(part.hidden), whole.logits, rtol=0, atol=1e-12)
    for a, b in zip(full.cache.layers, split.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="enter at layer 0"):
        split.forward(input_ids=ids, start=1)


class CountingLayers:
    """Counts the tokens every decoder layer runs on."""

    def __init__(self, model) -> None:
        self.tokens = [0] * model.config.num_hidden_layers
        for i, layer in enumerate(model.get_decoder().layers):
            layer.register_forward_pre_hook(self._hook(i))

    def _hook(self, i: int):
        def count(module, args):
            self.tokens[i] += args[0].shape[1]

        return count


@pytest.mark.parametrize("exit_layer", [1, 2, 3])
def test_early_exit_self_speculation_is_lossless_and_runs_each_layer_once_per_token(exit_layer: int) -> None:
    model = tiny_llama(3, vocab=64, hidden=32, layers=4)
    prompt = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(3))
    reference = speculative_generate(model, prompt, NoProposer(), 1, 30).tokens
    counter = CountingLayers(model)
    for k in (1, 3, 5):
        counter.tokens = [0] * 4
        result = speculative_generate(model, prompt, EarlyExitProposer(exit_layer), k, 30)
        assert result.tokens == reference
        # every layer runs once on the prompt and on each round's root and drafts: the drafts' entries in layers
        # [0, E) are reused (a draft with its own cache would run layers [0, E) twice for every token)
        verified = prompt.numel() + len(result.rounds) - 1 + sum(r.nodes for r in result.rounds)
        assert counter.tokens == [verified] * 4


def test_early_exit_samples_and_the_cache_keeps_only_the_committed_tokens() -> None:
    model = tiny_llama(4, vocab=64, layers=3)
    prompt = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(4))
    session = TargetSession(model)
    generator = torch.Generator().manual_seed(0)
    result = speculative_generate(session, prompt, EarlyExitProposer(2), 4, 20, temperature=1.0, generator=generator)
    committed = torch.cat([prompt, torch.tensor(result.tokens[:-1])])
    fresh = DynamicCache(config=model.config)
    model(input_ids=committed[None], cache=fresh, use_cache=True)
    assert session.committed == committed.numel()
    for a, b in zip(session.cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="exit layer 3 must be in 1..2"):
        speculative_generate(model, prompt, EarlyExitProposer(3), 4, 5)


def test_a_family_the_session_does_not_slice_runs_through_its_own_forward() -> None:
    model = tiny_model("mistral", 5, sliding_window=4096)  # sliding-window attention: not sliced
    session = TargetSession(model)
    assert not session.sliced and "sliding" in session.refusal
    prompt = torch.randint(0, 96, (8,), generator=torch.Generator().manual_seed(5))
    reference = speculative_generate(model, prompt, NoProposer(), 1, 24).tokens
    assert speculative_generate(session, prompt, PromptLookupProposer(), 4, 24).tokens == reference
    with pytest.raises(ValueError, match="sliding"):
        speculative_generate(session, prompt, EarlyExitProposer(1), 4, 5)
    with pytest.raises(ValueError, match="sliding"):
        TargetSession(model, sliced=True)


def test_a_target_with_recurrent_layers_is_refused_by_name():
    """Qwen3.5's linear-attention layers keep a recurrent state that cutting the cache cannot take back: a session on
    such a target is refused, naming the layer type, before anything is drafted (found by the real-shape rehearsal)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.interface.errors import ModelFolderError

    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ModelFolderError, match=r"linear_attention layers \(layer 0 first, model_type 'qwen3_5_text'\)"):
        TargetSession(model)
