"""LogitScaling: read from each architecture's config, it turns ``lm_head(final hidden state)`` into the logits of that
architecture's own forward; absent keys (None, 0) are no scaling; bad values are refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers import SCALED_FAMILIES, tiny_scaled_model
from trainer.models.logit_scaling import LogitScaling
from trainer.models.target import FrozenTarget

EXPECTED = {
    "llama": LogitScaling(),
    "gemma2": LogitScaling(softcap=0.5),
    "granite": LogitScaling(multiplier=0.25),
    "cohere": LogitScaling(multiplier=0.25),
}


@pytest.mark.parametrize("name", SCALED_FAMILIES)
def test_from_config_turns_the_bare_head_into_the_forwards_logits(name):
    model = tiny_scaled_model(name)
    scaling = LogitScaling.from_config(model.config)
    assert scaling == EXPECTED[name] and scaling.is_identity == (name == "llama")
    assert FrozenTarget(model).logit_scaling == scaling
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits  # [B, S, V]
        final = model.get_decoder()(ids).last_hidden_state  # [B, S, H], normed
        bare = model.lm_head(final)  # [B, S, V]
    torch.testing.assert_close(scaling(bare), logits)
    assert (name == "llama") == torch.allclose(bare, logits)


def test_the_operations_and_their_order():
    x = torch.linspace(-8.0, 8.0, 17, dtype=torch.float64)
    torch.testing.assert_close(LogitScaling(multiplier=3.0)(x), 3.0 * x)
    torch.testing.assert_close(LogitScaling(softcap=2.0)(x), 2.0 * torch.tanh(x / 2.0))
    both = LogitScaling(multiplier=0.5, softcap=2.0)
    torch.testing.assert_close(both(x), 2.0 * torch.tanh(0.5 * x / 2.0))  # multiplied first, then soft-capped
    identity = LogitScaling()
    assert identity.is_identity and identity(x) is x  # no operation at all
    assert not both.is_identity and both(x.float()).dtype == torch.float32


def test_absent_keys_and_both_scales():
    """None or 0 is absent, as each architecture's own forward reads its key; Cohere's and Granite's scales
    compose."""
    absent = SimpleNamespace(logit_scale=0, logits_scaling=None, final_logit_softcapping=0.0)
    assert LogitScaling.from_config(absent).is_identity
    assert LogitScaling.from_config(SimpleNamespace()).is_identity  # a foreign config without any of the keys
    both = SimpleNamespace(logit_scale=0.5, logits_scaling=8.0, final_logit_softcapping=30.0)
    assert LogitScaling.from_config(both) == LogitScaling(multiplier=0.0625, softcap=30.0)


@pytest.mark.parametrize(
    ("multiplier", "softcap"), [(0.0, None), (-1.0, None), (float("inf"), None), (1.0, 0.0), (1.0, -30.0)]
)
def test_bad_values_are_refused(multiplier, softcap):
    with pytest.raises(ValueError, match="must be finite and > 0"):
        LogitScaling(multiplier=multiplier, softcap=softcap)
