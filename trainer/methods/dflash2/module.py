"""The DFlash2 drafter: the DFlash drafter (trainer/methods/dflash/module.py) with a dynamic convolution around each
sublayer of its layers (conv.py) and a path selector over each slot's top-k candidates (selector.py), as speculators
0.9's ``DFlash2DraftModel`` extends its ``DFlashDraftModel``.

The layers are built through DFlash's ``make_layer`` hook, their convolutions reset to the identity after DFlash's
initialisation (speculators' order), and the selector after the backbone under speculators' name,
``candidate_selector.*``, so that the ``dflash2`` export is the state dict itself. A DFlash2 drafter whose
convolutions are the identity computes a DFlash drafter's slots (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter
from trainer.methods.dflash2.conv import DFlash2Layer, check_conv
from trainer.methods.dflash2.selector import CandidateSelector, check_selector

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "sliding_window_non_causal")
"""The config fields of DFlash2 (:class:`DFlash2Config`), written in the ``dflash2`` export under these names."""


@dataclass
class DFlash2Config(DFlashConfig):
    """The DFlash drafter's shape with DFlash2's convolutions and selector. Defaults are speculators'
    ``DFlash2SpeculatorConfig``'s (a ``dflash2`` file that leaves a field out is read with them).

    Attributes:
        conv_kernel_size: the taps of each convolution (slot k reads slots k - taps + 1 .. k of its block).
        conv_group_size: channels sharing one dynamic tap (it divides hidden_size).
        selector_rank: r, the rank of the selector's bilinear term.
        selector_top_k: the candidates kept per slot (drafts are among a slot's top-k unary tokens).
        sliding_window_non_causal: a sliding layer's slots see the whole block (DFlash2's default is true, DFlash's
            false).
    """

    sliding_window_non_causal: bool = True
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        check_conv(self.hidden_size, self.block_size, self.conv_kernel_size, self.conv_group_size)
        check_selector(self.selector_rank, self.selector_top_k, self.vocab_size)

    def fields(self) -> dict:
        """DFlash2's fields (:data:`DFLASH2_KEYS`) and their values."""
        return {key: getattr(self, key) for key in DFLASH2_KEYS}


class DFlash2Drafter(DFlashDrafter):
    """The DFlash drafter with convolutions in its layers and a candidate selector."""

    refiner_modules = ("candidate_selector",)
    config: DFlash2Config

    def __init__(self, config: DFlash2Config) -> None:
        """
        Args:
            config: the drafter's shape, convolutions and selector.
        """
        super().__init__(config)
        for layer in self.layers:
            layer.reset_convolutions()  # DFlash's initialisation of every Linear set the projections
        c = config
        self.candidate_selector = CandidateSelector(c.vocab_size, c.hidden_size, c.selector_rank, c.selector_top_k)

    def make_layer(self, index: int) -> DFlash2Layer:
        """A draft layer with its convolutions."""
        return DFlash2Layer(self.config, self.config.conv_kernel_size, self.config.conv_group_size)

    @classmethod
    def is_refiner_weight(cls, name: str) -> bool:
        """The selector's weights and the layers' convolutions (``layers.{i}.attention_conv.*``, ``mlp_conv.*``)."""
        inside = name.startswith("layers.") and name.split(".")[2] in ("attention_conv", "mlp_conv")
        return inside or super().is_refiner_weight(name)
