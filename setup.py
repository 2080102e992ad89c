"""Packaging for iota-subnet: node software (miner, validator, devnet) for pipeline-parallel LLM pretraining on Bittensor."""
import re
from pathlib import Path

from setuptools import find_packages, setup

VERSION = re.search(r'__version__ = "([^"]+)"', (Path(__file__).parent / "iota_subnet" / "version.py").read_text()).group(1)

setup(
    name="iota-subnet",
    version=VERSION,
    description="Miners and validators for pipeline + data parallel LLM pretraining on a Bittensor subnet",
    python_requires=">=3.11",
    packages=find_packages(include=["iota_subnet", "iota_subnet.*", "neurons"]),
    install_requires=[
        "bittensor==11.3.0",
        # CPU machines take the 2.13.0 wheel that lies on disk (see Makefile); GPU hosts any 2.4+.
        "torch>=2.4",
        "aiohttp>=3.9",
        "numpy>=1.26",
        "safetensors>=0.4",
        "loguru>=0.7",
        "tokenizers>=0.19",
        "datasets>=2.19",
        "pyarrow>=15",
        "pydantic>=2.6",
        "pyyaml>=6",
        "tqdm>=4.66",
        "prometheus-client>=0.20",
        "pytest>=8",
        # export / generate / eval, and stages built from its model families (iota_subnet.model.hf_family):
        # the 5.x layer classes, masking_utils and rope_parameters
        "transformers>=5.0,<6",
        # the devnet's MEV shield: ML-KEM-768 (FIPS 203) and XChaCha20-Poly1305, as the SDK encrypts
        "kyber-py>=1.2",
        "pycryptodome>=3.20",
        # the fake silent chain endpoint in the tests; also what the SDK connects with
        "websockets>=12",
    ],
    extras_require={
        # selenium drives Debian's chromium (make browser) in the dashboard test; pillow reads its screenshot.
        "test": ["pytest-timeout>=2.3", "selenium>=4.20", "pillow>=10", "import-linter>=2.1", "pylint>=3.2"],
        # scripts/bench_churn.py plots every run's loss curve into one PNG
        "bench": ["matplotlib>=3.7"],
    },
    # the dashboard's page and vendored assets; the Hugging Face modeling code copied into exports
    package_data={"iota_subnet.dashboard": ["static/*.html", "static/*.js", "static/*.css", "static/vendor/*"],
                  "iota_subnet.hf": ["remote/*.py"]},
    entry_points={"console_scripts": ["iota-subnet=iota_subnet.cli:main"]},
)
