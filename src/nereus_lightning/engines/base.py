"""The rollout-engine interfaces and what every engine shares: the output, per-sample seeded sampling, eos.

:class:`RolloutEngine` generates; :class:`StageEngine` is one the strategy holds for a generation
model-stage across steps (weights loaded with their version, sleep, wake, close), built by its
:class:`EngineKind` (:mod:`nereus_lightning.engines.registry`).

Sampling is seeded per sample, not per batch: row ``i`` draws its tokens from its own Gumbel
noise, seeded by ``sample_seeds[i]`` (derive them from the global sample index with
:func:`sample_seeds`). Sampling ``argmax(logits / T + Gumbel)`` is exact sampling from
``softmax(logits / T)``, and a sample's tokens do not depend on which other samples share its
batch, so a rollout is the same under any DP partition of the prompts (up to float ties).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from nereus_lightning.spec.errors import NereusConfigError, require
from nereus_lightning.spec.workload import GenerationEngine


@dataclass
class RolloutOutput:
    """Left-padded prompts and right-padded responses; a response's mask covers its eos.

    ``policy_version`` (``[B]``, where the engine records it): per row, the policy version (weight
    syncs of the generation model-stage, one per update) of the weights that generated it.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    policy_version: Tensor | None = field(default=None, kw_only=True)

    @property
    def sequences(self) -> Tensor:
        """``prompt_ids`` followed by ``response_ids``."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=-1)

    @property
    def attention_mask(self) -> Tensor:
        """Mask of :attr:`sequences`."""
        return torch.cat([self.prompt_mask, self.response_mask], dim=-1)


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses for a batch of left-padded prompts."""

    def generate(
        self,
        prompt_ids: Tensor,
        attention_mask: Tensor,
        max_new_tokens: int,
        do_sample: bool = True,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        sample_seeds: Sequence[int] | Tensor | None = None,
    ) -> RolloutOutput:
        """Responses (``max_new_tokens`` wide, padded) and their masks; greedy when ``do_sample`` is False."""
        ...


@dataclass(frozen=True)
class Decoding:
    """How a generation model-stage's responses end and are padded, and the built-in engine's decode loop.

    ``eos_token_id`` None: responses run to ``max_new_tokens`` (``ignore_eos``); ``decode``: one of
    :data:`~nereus_lightning.engines.static.DECODE_MODES`.
    """

    eos_token_id: int | None
    pad_token_id: int
    decode: str = "auto"


@dataclass(frozen=True)
class GenerationSite:
    """Where a generation model-stage's rollout engine runs under a plan, and what it runs.

    ``replicas``: each replica's ranks (TP order); ``unit``: this rank's compute module of the
    model-stage (None off its ranks, or before the units exist).
    """

    model_stage: str
    replicas: tuple[tuple[int, ...], ...]
    tp: int
    pp: int
    config: Any  # the model's transformers config
    dtype: torch.dtype | None = None  # the generation unit's parameter dtype (None before the units exist)
    unit: Any = None


@dataclass(frozen=True)
class UnitShards:
    """This rank's shards of a generation unit as an engine takes them (global names, TP shards).

    ``shapes`` and ``placements`` (:mod:`nereus_lightning.models.sharding`) say how each full
    parameter is cut; ``policy_version`` is the unit's, which the engine records.
    """

    params: Mapping[str, Tensor]
    shapes: Mapping[str, Sequence[int]]
    placements: Mapping[str, Any]
    tp_rank: int
    policy_version: int


@runtime_checkable
class StageEngine(RolloutEngine, Protocol):
    """The rollout engine of a generation model-stage on this rank, held by the strategy across steps.

    Its kind (:class:`EngineKind`) builds it for a plan's generation layout. It decodes either
    on the generation unit's own tensors (:attr:`on_unit`: the unit is on its device while it
    generates) or on weights of its own, which :meth:`load` replaces with the unit's shards.
    """

    #: Whether it decodes on the unit's own tensors (else on weights it took with :meth:`load`).
    on_unit: bool

    @property
    def policy_version(self) -> int | None:
        """The unit's policy version of the weights it decodes with (None: not known here)."""
        ...

    def load(self, shards: UnitShards) -> None:
        """Take the generation unit's current weights, this rank's shards, and their policy version."""
        ...

    def sleep(self) -> None:
        """Free the device memory it holds between generations (the next use brings it back)."""
        ...

    def wake(self) -> None:
        """Bring back what :meth:`sleep` freed."""
        ...

    def close(self) -> None:
        """Release everything it holds (it is not used again)."""
        ...


class EngineKind(Protocol):
    """One kind of rollout engine (``algorithm.rollout_engine``), as the registry holds it."""

    #: Whether its engines decode on the generation unit's own tensors (:attr:`StageEngine.on_unit`).
    on_unit: bool

    def require_installed(self, key: str) -> None:
        """Refuse, when the job is configured, a kind whose library is missing (naming ``key``)."""
        ...

    def check_model(self, config: Any, key: str) -> None:
        """Refuse, before any process starts, a model (transformers config) this kind cannot run."""
        ...

    def check_sites(self, sites: Sequence[GenerationSite]) -> None:
        """Refuse, before anything moves, a plan's generation layout this kind cannot take."""
        ...

    def place(
        self,
        sites: Sequence[GenerationSite],
        previous: Sequence[GenerationSite],
        held: Mapping[str, StageEngine],
        decoding: Decoding,
        settings: GenerationEngine,
    ) -> dict[str, StageEngine]:
        """This rank's engine of each generation model-stage at ``sites`` (collective over the world).

        ``held``: this rank's engines placed for ``previous`` (the sites of the last plan, empty at
        first; the same on every rank); one that still serves its site is kept, the others are
        closed. A model-stage this rank does not run has no engine.
        """
        ...


def response_rows(out: RolloutOutput) -> list[tuple[list[int], int | None, list[float] | None]]:
    """Each row's response ids (up to and with its eos), the policy version that generated it (or None), and
    the engine's log-prob of each of its tokens where the engine reports them (vLLM; else None)."""
    lengths = out.response_mask.sum(-1).tolist()
    versions = [None] * len(lengths) if out.policy_version is None else out.policy_version.tolist()
    engine_log_probs = getattr(out, "log_probs", None)
    scored = [None] * len(lengths) if engine_log_probs is None else engine_log_probs.tolist()
    rows = zip(out.response_ids.tolist(), lengths, versions, scored, strict=True)
    return [(ids[:k], v, None if lp is None else lp[:k]) for ids, k, v, lp in rows]


def version_tensor(versions: Sequence[int | None], device: torch.device | str = "cpu") -> Tensor | None:
    """Per-sample policy versions as a ``[B]`` tensor; None unless every sample's is known."""
    if any(v is None for v in versions):
        return None
    return torch.tensor(list(versions), dtype=torch.long, device=device)


def sample_seeds(seed: int, step: int, indices: Sequence[int] | Tensor) -> list[int]:
    """One sampling seed per global sample index, fixed by ``(seed, step, index)``."""
    if isinstance(indices, Tensor):
        indices = indices.tolist()
    return [random.Random(f"nereus-sample:{seed}:{step}:{int(i)}").getrandbits(63) for i in indices]


GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


def gumbel_noise(seeds: Tensor, step: int, vocab: int) -> Tensor:
    """Gumbel(0, 1) noise ``[B, vocab]`` for decoding step ``step`` of rows seeded by ``seeds`` (int64).

    A counter-based draw (splitmix64 of seed, step and token id, on the seeds' device): a row's
    noise depends only on its seed and the step, costs one ``[B, vocab]`` pass per step (no
    ``[B, steps, vocab]`` buffer; that would be 10 GB for 64 rows of a 151k vocabulary at 256 steps),
    and is the same on every device and in every decoding loop, eager or captured.
    """

    # int64 tensor products wrap, so the arithmetic is modulo 2^64 as splitmix64's; the masks
    # after each right shift make it logical rather than arithmetic.
    def mix(z: Tensor) -> Tensor:
        z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * _MIX1
        z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * _MIX2
        return z ^ ((z >> 31) & 0x1FFFFFFFF)

    row = mix(seeds.to(torch.int64) + torch.full_like(seeds, step + 1, dtype=torch.int64) * GOLDEN)
    tokens = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    z = mix(row.unsqueeze(-1) + (tokens + 1) * GOLDEN)
    u = (((z >> 40) & 0xFFFFFF).to(torch.float32) + 0.5) / 16777216.0  # 24 bits in (0, 1)
    return -torch.log(-torch.log(u))


def response_mask_from_ids(response_ids: Tensor, eos_token_id: int | None) -> Tensor:
    """1 on every token up to and including the first eos of each row, 0 after it (all 1 without an eos)."""
    if eos_token_id is None:
        return torch.ones_like(response_ids)
    is_eos = (response_ids == eos_token_id).long()
    eos_before = is_eos.cumsum(-1) - is_eos  # eos tokens strictly before this position
    return (eos_before == 0).long()


class SeededGumbel:
    """A logits processor that turns greedy decoding into per-row seeded sampling."""

    def __init__(
        self,
        seeds: list[int],
        prompt_len: int,
        max_new_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
    ):
        self.seeds = seeds
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self._seeds: Tensor | None = None

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self._seeds is None:
            self._seeds = torch.tensor(self.seeds, dtype=torch.int64, device=scores.device)
        scores = scores.float() / self.temperature
        if self.top_k > 0:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            drop_sorted = probs.cumsum(-1) - probs > self.top_p  # mass before this token already covers top_p
            scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        step = input_ids.shape[-1] - self.prompt_len
        return scores + gumbel_noise(self._seeds, step, scores.shape[-1])


def check_sampling(
    batch: int,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    seeds: Sequence[int] | Tensor | None,
) -> list[int] | None:
    """Validate the sampling arguments of :meth:`RolloutEngine.generate`; one seed per row (None: greedy)."""
    require(max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {max_new_tokens}")
    if not do_sample:
        return None
    require(temperature > 0, "rollout.temperature", f"must be > 0 when sampling, got {temperature}")
    require(0.0 < top_p <= 1.0, "rollout.top_p", f"must be in (0, 1], got {top_p}")
    require(top_k >= 0, "rollout.top_k", f"must be >= 0 (0 = off), got {top_k}")
    if seeds is None:
        raise NereusConfigError("sample_seeds: sampling needs one seed per row (engines.base.sample_seeds)")
    seeds = seeds.tolist() if isinstance(seeds, Tensor) else list(seeds)
    require(len(seeds) == batch, "sample_seeds", f"{len(seeds)} seeds for {batch} prompts")
    return seeds


def make_picker(
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    seeds: Sequence[int] | Tensor | None,
) -> SeededGumbel | None:
    """The seeded processor, or None for greedy decoding (arguments checked by :func:`check_sampling`)."""
    checked = check_sampling(batch, max_new_tokens, do_sample, temperature, top_k, top_p, seeds)
    if checked is None:
        return None
    return SeededGumbel(checked, prompt_len, max_new_tokens, temperature, top_k, top_p)


def finish_rollout(
    prompt_ids: Tensor, prompt_mask: Tensor, response: Tensor, max_new_tokens: int, eos: int | None, pad: int
) -> RolloutOutput:
    """Pad responses to ``max_new_tokens``, mask everything after the first eos."""
    if response.shape[-1] < max_new_tokens:  # every row stopped early
        fill = response.new_full((response.shape[0], max_new_tokens - response.shape[-1]), pad)
        response = torch.cat([response, fill], dim=-1)
    mask = response_mask_from_ids(response, eos)
    return RolloutOutput(prompt_ids, prompt_mask, response.masked_fill(mask == 0, pad), mask)
