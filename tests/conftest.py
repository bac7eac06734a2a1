"""Shared fixtures: tiny models built locally (never downloaded), once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlora_lab.tiny import build_tiny_model

# Determinism and a quiet, offline environment for every test (torchrun children inherit it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_models(arch) -> path``: a saved tiny model + tokenizer directory, built once per arch."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, str] = {}

    def get(arch: str = "llama") -> str:
        if arch not in cache:
            cache[arch] = build_tiny_model(arch, Path(root) / arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def llama_path(tiny_models) -> str:
    return tiny_models("llama")
