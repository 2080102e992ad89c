"""iota-subnet: miners and validators for pipeline + data parallel LLM pretraining on a Bittensor subnet."""
from .version import __version__, weights_version_key  # noqa: F401
from . import config_hf  # noqa: F401,E402  (registers the transformers model kind of run configs)
