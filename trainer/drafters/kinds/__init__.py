"""The built-in drafter kinds, one module each, registered with trainer.drafters.spec on import."""
