"""The trained model out of the network: a Hugging Face folder (:mod:`.export`), and using it
with ``transformers`` (:mod:`.runtime`: ``generate``, ``eval``). :mod:`.remote` holds the modeling
code copied into exports of bottlenecked models (loaded with ``trust_remote_code=True``)."""
from .export import ExportError, export_run
from .runtime import ModelFolderError, evaluate_file, generate_text, load

__all__ = ["ExportError", "ModelFolderError", "evaluate_file", "export_run", "generate_text", "load"]
