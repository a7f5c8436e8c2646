"""The semantic projector of ``semantic_id``: a token's K‖V (one KV head) → a small semantic vector.

Two linear layers with a GELU between them, one module shared by every layer and KV head (so it stays
tiny: for head_dim 64 and the default 16 semantic dimensions, 4,656 parameters, about 0.003% of
SmolLM2-135M). Its input is ``[k / |k|, v / |v|]``: each half unit-normalised, so keys (usually much
larger) do not drown the values, as ``semantic_id``'s thresholds judge K and V separately too.

Deterministic initialisation that already preserves similarity (never random noise): the first layer
holds an orthonormal basis ``U`` twice with opposite signs, ``[U; -U]`` (bias ``[-Uμ; Uμ]``), and the
second layer subtracts the halves, ``[I, -I]``. Since ``GELU(z) - GELU(-z) = zΦ(z) + zΦ(-z) = z``,
the module computes exactly ``U (x - μ)``: the input's coordinates along ``U``. With ``U`` the top
principal directions of calibration K‖V rows (``from_pca``/``load_pca``) that is PCA, which keeps the
angles between rows as well as any ``sem_dim``-dimensional linear map can. Without calibration rows the
basis is block pooling (semantic coordinate j = the normalised sum of one contiguous block of input
channels). Distillation then trains both layers from there.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from zoomkv.errors import ConfigError


def semantic_input(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[..., dk]`` and ``[..., dv]`` → float32 ``[..., dk + dv]``: each half unit-normalised."""
    return torch.cat([F.normalize(keys.float(), dim=-1), F.normalize(values.float(), dim=-1)], dim=-1)


def pca_basis(
    rows: torch.Tensor, weights: torch.Tensor | None, sem_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean ``[..., D]`` and top-``sem_dim`` principal directions ``[..., sem_dim, D]`` of
    ``rows`` ``[..., n, D]`` (``weights`` ``[..., n]``, 0 drops a row; None weighs every row 1).

    Batched over leading dimensions. Each direction's sign is fixed (its largest-magnitude entry is
    positive) so the basis, and every hash built on it, is deterministic.
    """
    rows = rows.float()
    dim = rows.shape[-1]
    if sem_dim > dim:
        raise ConfigError(f"sem_dim ({sem_dim}) cannot exceed the projector's input size ({dim})")
    w = torch.ones(rows.shape[:-1], device=rows.device) if weights is None else weights.float()
    total = w.sum(-1, keepdim=True).clamp_min(1e-12)
    mean = (w[..., None] * rows).sum(-2) / total
    centered = (rows - mean[..., None, :]) * w[..., None].sqrt()
    # float64 eigh: small covariances of near-duplicate rows are ill-conditioned in float32.
    cov = (centered.transpose(-1, -2).double() @ centered.double()) / total[..., None].double()
    _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
    basis = vecs[..., -sem_dim:].flip(-1).transpose(-1, -2)  # [..., sem_dim, D], largest variance first
    pivot = basis.abs().argmax(-1, keepdim=True)
    basis = basis * torch.where(basis.gather(-1, pivot) < 0, -1.0, 1.0)
    return mean, basis.float()


def block_basis(sem_dim: int, dim: int) -> torch.Tensor:
    """``[sem_dim, dim]`` orthonormal rows, row j the normalised indicator of the j-th block of channels."""
    edges = torch.linspace(0, dim, sem_dim + 1, device="cpu").round().long().tolist()  # cpu: also under meta
    basis = torch.zeros(sem_dim, dim)
    for j in range(sem_dim):
        lo, hi = edges[j], max(edges[j + 1], edges[j] + 1)
        basis[j, lo:hi] = 1.0 / (hi - lo) ** 0.5
    return basis


class SemanticProjector(nn.Module):
    """``SemanticProjector(head_dim, sem_dim=16, hidden=None)``: K‖V → ``sem_dim`` semantic coordinates.

    ``hidden`` defaults to ``2 * sem_dim`` (the smallest width that holds the exact linear
    initialisation); wider layers start with their extra units switched off (zero weights)."""

    def __init__(self, head_dim: int, sem_dim: int = 16, hidden: int | None = None, value_dim: int | None = None):
        super().__init__()
        if head_dim < 1 or sem_dim < 1:
            raise ConfigError(f"head_dim and sem_dim must be >= 1, got {head_dim}, {sem_dim}")
        hidden = 2 * sem_dim if hidden is None else hidden
        if hidden < 2 * sem_dim:
            raise ConfigError(f"hidden ({hidden}) must be at least 2 * sem_dim ({2 * sem_dim})")
        self.head_dim = head_dim
        self.value_dim = value_dim or head_dim
        self.in_dim = head_dim + self.value_dim
        if sem_dim > self.in_dim:
            raise ConfigError(f"sem_dim ({sem_dim}) cannot exceed the input size ({self.in_dim})")
        self.sem_dim = sem_dim
        self.hidden = hidden
        self.up = nn.Linear(self.in_dim, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, sem_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The deterministic block-pooling initialisation (used until calibration rows are given)."""
        self.load_pca(torch.zeros(self.in_dim), block_basis(self.sem_dim, self.in_dim))

    @torch.no_grad()
    def load_pca(self, mean: torch.Tensor, basis: torch.Tensor) -> SemanticProjector:
        """Set the weights so that ``forward(x) == basis @ (x - mean)`` exactly (see the module docstring)."""
        s, dim = self.sem_dim, self.in_dim
        if basis.shape != (s, dim) or mean.shape != (dim,):
            raise ConfigError(f"a PCA basis for this projector is [{s}, {dim}] with a [{dim}] mean")
        basis, mean = basis.float(), mean.float()
        self.up.weight.zero_()
        self.up.bias.zero_()
        self.down.weight.zero_()
        self.down.bias.zero_()
        shift = basis @ mean
        self.up.weight[:s] = basis
        self.up.weight[s : 2 * s] = -basis
        self.up.bias[:s] = -shift
        self.up.bias[s : 2 * s] = shift
        eye = torch.eye(s)
        self.down.weight[:, :s] = eye
        self.down.weight[:, s : 2 * s] = -eye
        return self

    @classmethod
    def from_pca(cls, keys: torch.Tensor, values: torch.Tensor, sem_dim: int = 16,
                 hidden: int | None = None) -> SemanticProjector:
        """A projector initialised from calibration rows ``[..., n, d]`` (flattened over leading dims)."""
        x = semantic_input(keys, values).reshape(-1, keys.shape[-1] + values.shape[-1])
        mean, basis = pca_basis(x, None, sem_dim)
        module = cls(keys.shape[-1], sem_dim, hidden, values.shape[-1])
        return module.load_pca(mean, basis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_dim]`` (see ``semantic_input``) → ``[..., sem_dim]``."""
        return self.down(self.act(self.up(x)))

    def project(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return self.forward(semantic_input(keys, values))

    # -- files (plain safetensors, nothing executes on load) --------------------------------------------
    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        meta = {"head_dim": str(self.head_dim), "value_dim": str(self.value_dim), "sem_dim": str(self.sem_dim),
                "hidden": str(self.hidden)}
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> SemanticProjector:
        from safetensors import safe_open

        path = Path(path).expanduser()
        if not path.is_file():
            raise ConfigError(f"semantic projector weights not found: {path}")
        with safe_open(str(path), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
        try:
            hidden, in_dim = state["up.weight"].shape
            sem_dim = state["down.weight"].shape[0]
        except KeyError as err:
            raise ConfigError(f"{path} is not a semantic projector (missing {err})") from None
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        head_dim = int(meta.get("head_dim", in_dim // 2))
        module = cls(head_dim, sem_dim, hidden, in_dim - head_dim)
        module.load_state_dict(state)
        return module


class InputCorrection(nn.Module):
    """``InputCorrection(in_dim, rank=8)``: a trained correction of K‖V *before* the per-sequence PCA,
    ``x → x ⊙ (1 + gain) + (x A) B``, so the method keeps the PCA it fits to each sequence and head and
    training only reshapes the space that PCA is fitted in (one of the projector's designs, recipe key
    ``design: pca_correction``).

    Starts as the identity (``gain`` and ``B`` zero; ``A`` starts as a block-pooling basis, deterministic and
    non-zero, so the gradient reaches ``B`` from the first step): untrained, the method is exactly its PCA
    start. ``in_dim`` + 2 ·
    ``in_dim`` · ``rank`` parameters (2,176 for head_dim 64 at rank 8)."""

    def __init__(self, in_dim: int, rank: int = 8):
        super().__init__()
        if in_dim < 1 or not 0 <= rank <= in_dim:
            raise ConfigError(f"an input correction needs in_dim >= 1 and 0 <= rank <= in_dim, got {in_dim}, {rank}")
        self.in_dim = in_dim
        self.rank = rank
        self.gain = nn.Parameter(torch.zeros(in_dim))
        self.mix_in = nn.Parameter(torch.zeros(in_dim, rank))
        self.mix_out = nn.Parameter(torch.zeros(rank, in_dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.gain.zero_()
        self.mix_out.zero_()
        if self.rank:
            self.mix_in.copy_(block_basis(self.rank, self.in_dim).T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_dim]`` (see ``semantic_input``) → the corrected ``[..., in_dim]``."""
        return x * (1.0 + self.gain) + (x @ self.mix_in) @ self.mix_out
