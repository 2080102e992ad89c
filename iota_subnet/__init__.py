"""iota-subnet: miners and validators for pipeline + data parallel LLM pretraining on a Bittensor subnet."""
from .version import __version__, weights_version_key  # noqa: F401
