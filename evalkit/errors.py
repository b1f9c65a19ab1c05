"""The error every stage raises for a mistake in the user's input, below them all: what only reads (compare, the
untrusted-input checks) raises it without importing the config schema and Hydra's OmegaConf."""


class ConfigError(ValueError):
    """A mistake in the user's input, reported as one line before any engine starts."""
