"""The XPress drafter: the DFlash drafter (trainer/methods/dflash/module.py) with XPress's causal refiner head
(head.py) as its block refiner (trainer/methods/dflash/refiner.py), as speculators' ``XPressDraftModel`` extends its
``DFlashDraftModel``.

The head is built after the backbone (it keeps speculators' own initialisation) under speculators' name,
``refiner_head.*`` beside the backbone's weights, so that the ``xpress`` export is the state dict itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter
from trainer.methods.xpress.head import XPressRefinerHead, check_refiner

REFINER_KEYS = ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes")
"""The config fields of the refiner (:class:`XPressConfig`), written in the ``xpress`` export under these names."""


@dataclass
class XPressConfig(DFlashConfig):
    """The DFlash drafter's shape and XPress's refiner. Defaults are speculators' ``XPressSpeculatorConfig``'s (an
    ``xpress`` file that leaves a field out is read with them).

    Attributes:
        xpress_rank: r, the width of the refiner's space (head.py).
        xpress_mlp_ratio: the refiner's SwiGLU MLP is ``r * xpress_mlp_ratio`` wide.
        num_jacobi_passes: K, the parallel refine passes that resolve a block when drafting greedily (proposer.py).
    """

    xpress_rank: int = 256
    xpress_mlp_ratio: int = 2
    num_jacobi_passes: int = 6

    def __post_init__(self) -> None:
        super().__post_init__()
        check_refiner(self.xpress_rank, self.xpress_mlp_ratio, self.num_jacobi_passes)

    def refiner(self) -> dict:
        """The refiner's fields (:data:`REFINER_KEYS`) and their values."""
        return {key: getattr(self, key) for key in REFINER_KEYS}


class XPressDrafter(DFlashDrafter):
    """The DFlash drafter with XPress's causal refiner head."""

    refiner_modules = ("refiner_head",)

    def __init__(self, config: XPressConfig) -> None:
        """
        Args:
            config: the drafter's shape and refiner.
        """
        super().__init__(config)
        c = config
        self.refiner_head = XPressRefinerHead(
            c.vocab_size, c.hidden_size, c.block_size, c.xpress_rank, c.xpress_mlp_ratio
        )
